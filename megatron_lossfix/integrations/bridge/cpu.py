"""Run Megatron Bridge's training loop (``pretrain``/``finetune``) on a machine without CUDA.

Megatron Bridge asks for CUDA where Megatron-Core alone does not: its initialization asserts it,
compiles dataset helpers and warms up CUDA fusion kernels, pins host memory and logs CUDA memory
statistics. This module bridges those on top of :mod:`megatron_lossfix.harness.cpu_megatron` (the
Megatron-Core CPU mode), and works around two import-time failures of a CPU install.
Used by the Bridge example and its tests; GPU users never need it.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lossfix.harness.cpu_megatron import enable_cpu_megatron, with_one_device

__all__ = ["TEUnavailable", "enable_cpu_bridge", "te_stand_in"]

_BRIDGE_ENABLED = False

#: The oldest nvidia-resiliency-ext whose async checkpointing megatron-core 0.19 accepts; older
#: releases (PyPI's 0.4.1 is the newest installable without CUDA) make its import-time probe fail.
_NVRX_MIN_VERSION = "0.6.0"


def _hide_old_nvrx_checkpointing() -> None:
    """Make an nvidia-resiliency-ext too old for megatron-core look like one without async
    checkpointing (megatron-core then uses its own), instead of crashing megatron-core's import."""
    import importlib.metadata
    import sys

    from packaging.version import Version

    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return
    if Version(version) < Version(_NVRX_MIN_VERSION):
        # A None entry makes `import nvidia_resiliency_ext.checkpointing` raise ImportError.
        sys.modules.setdefault("nvidia_resiliency_ext.checkpointing", None)


class TEUnavailable:
    """Stands for a Transformer Engine class: never an instance of anything, never built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Transformer Engine is not installed (CPU run)")


def te_stand_in() -> Any:
    """A stand-in of the ``transformer_engine`` package (with ``.pytorch``): any lower-case
    attribute is a stand-in module, any other a :class:`TEUnavailable` class."""
    import types

    class _Namespace(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            value = _Namespace(f"{self.__name__}.{name}") if name.islower() else TEUnavailable
            setattr(self, name, value)
            return value

    package = _Namespace("transformer_engine")
    package.pytorch = _Namespace("transformer_engine.pytorch")
    return package


class _LoraLayersFinder:
    """Imports Bridge's ``peft/lora_layers.py`` (which imports Transformer Engine at top level,
    on ``pretrain``'s import path, for TE-only LoRA classes) against a stub of Transformer Engine.

    The stub is in ``sys.modules`` only while that one module's body runs, after its own imports
    are done, so megatron-core's and Bridge's "is Transformer Engine installed?" probes keep
    answering no."""

    name = "megatron.bridge.peft.lora_layers"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _StubbedTELoader(spec.loader)
        return spec


class _StubbedTELoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import importlib
        import sys

        # lora_layers' own imports, loaded for real before the stub goes in.
        for name in (
            "megatron.core.transformer.moe.moe_utils",
            "megatron.bridge.peft.adapter_wrapper",
            "megatron.bridge.peft.lora_merge",
        ):
            importlib.import_module(name)
        stub = te_stand_in()
        names = ("transformer_engine", "transformer_engine.pytorch")
        saved = {name: sys.modules.get(name) for name in names}
        sys.modules["transformer_engine"] = stub
        sys.modules["transformer_engine.pytorch"] = stub.pytorch
        try:
            self._loader.exec_module(module)
        finally:
            for name, previous in saved.items():
                if previous is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = previous


def _patch_torch_cuda_bookkeeping() -> None:
    """Memory statistics and stream selection Bridge's loop calls between steps."""
    cuda = torch.cuda
    for name in (
        "memory_allocated",
        "memory_reserved",
        "max_memory_allocated",
        "max_memory_reserved",
    ):
        setattr(cuda, name, lambda device=None: 0)
    cuda.memory_stats = lambda device=None: {}
    cuda.empty_cache = lambda: None
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.reset_max_memory_allocated = lambda device=None: None
    cuda.set_stream = lambda stream: None


def _patch_bridge() -> None:
    import functools
    import importlib.util

    from megatron.bridge.data import loaders
    from megatron.bridge.training import initialize, setup

    # Bridge asserts CUDA unless told otherwise; setup() never tells it.
    setup.initialize_megatron = functools.partial(
        initialize.initialize_megatron, allow_no_cuda=True
    )
    # The wheel ships the compiled dataset helpers but not the Makefile compile_helpers runs.
    initialize.compile_helpers = lambda: None
    # Warms up CUDA fusion kernels; nothing to compile on CPU.
    initialize._warmup_jit_function = lambda model_config, micro_batch_size: None
    # The model-parallel RNG tracker is seeded only when torch.cuda.device_count() > 0; without
    # it, building any tensor-parallel layer fails.
    initialize._set_random_seed = with_one_device(initialize._set_random_seed)
    if importlib.util.find_spec("transformer_engine") is None:
        from megatron.bridge.peft import module_matcher
        from megatron.bridge.peft import utils as peft_utils

        # Without Transformer Engine megatron-core defines its TE classes as mocks, which
        # Bridge's PEFT counts as Transformer Engine being there: LoRA would then test every
        # layer against the mocks (a TypeError) instead of taking Megatron's own linear layers.
        peft_utils.HAVE_TE = module_matcher.HAVE_TE = False
    build_loader = loaders.build_pretraining_data_loader
    # Pinned host memory needs a CUDA driver.
    loaders.build_pretraining_data_loader = functools.wraps(build_loader)(
        lambda *args, **kwargs: build_loader(*args, **{**kwargs, "pin_memory": False})
    )


def enable_cpu_bridge(force: bool = False) -> bool:
    """Run Megatron Bridge's training loop (``pretrain``/``finetune``) on a machine without CUDA.

    On top of :func:`~megatron_lossfix.harness.cpu_megatron.enable_cpu_megatron`: lets Bridge
    initialize without CUDA, skips its dataset helper compilation and CUDA JIT warm-up, turns off
    pinned memory, answers its memory bookkeeping, and works around two import-time failures of a
    CPU install (Bridge's LoRA layers importing Transformer Engine; megatron-core rejecting
    nvidia-resiliency-ext older than 0.6).

    Call it first, before anything imports Megatron. A no-op where CUDA is available unless
    ``force``; idempotent; process-global and irreversible. Imports Bridge (about 15 s).
    Returns True when the process runs in CPU mode after the call.
    """
    global _BRIDGE_ENABLED
    if _BRIDGE_ENABLED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    import importlib.util
    import sys

    _hide_old_nvrx_checkpointing()
    if importlib.util.find_spec("transformer_engine") is None:
        sys.meta_path.insert(0, _LoraLayersFinder())
    enable_cpu_megatron(force=True)
    _patch_torch_cuda_bookkeeping()
    _patch_bridge()
    _BRIDGE_ENABLED = True
    return True
