"""Run stock Megatron-Core on a machine without a GPU (CPU tensors, gloo process groups).

Megatron-Core hard-codes CUDA in code paths that have nothing to do with the math: device
literals (`torch.zeros([], device="cuda")` in every pipeline schedule,
`device=torch.cuda.current_device()` in p2p communication and the DDP grad buffers), stream and
event bookkeeping, and CUDA RNG states. None of it changes what is computed, so on a CPU-only
machine we bridge it instead of forking Megatron: the test suite and the example scripts then run
the real GPTModel, pipeline schedules, DDP and `finalize_model_grads` (docs/design.md §7).

`enable_cpu_megatron()` is a no-op on a machine with CUDA unless forced. Everything it does is
process-global and irreversible; call it once at start-up, before building models.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: TorchFunctionMode | None = None

#: Megatron-Core warnings that say nothing new after the first time: each module that has a fused
#: kernel or a Transformer Engine / Apex path warns about its fallback once per process, so a
#: 2-rank run prints ~14 of them; and the cuda_graph_scope default warns per model config. One
#: pattern, one group: a group is shown once per run, on global rank 0, as Megatron worded it.
_REPEATED_WARNINGS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("fallback", re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")),
    ("cuda_graph_scope", re.compile(r"full scope is deprecated")),
)
_shown_groups: set[str] = set()
_original_showwarning: Any = None


def is_cpu_mode() -> bool:
    """True once `enable_cpu_megatron` has bridged this process to CPU."""
    return _ENABLED


def _is_cuda_device(device: Any) -> bool:
    # An int device means "index on the current accelerator" to torch; on this path it can only
    # come from our `torch.cuda.current_device()` stand-in. `bool` is an int subclass: not a device.
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every CUDA device argument to CPU and makes `Tensor.cuda()` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The optimizer wrappers and grad clipping accept only 'torch.cuda.*Tensor' names.
            name = func(*args)
            on_cpu = args[0].device.type == "cpu"
            return name.replace("torch.", "torch.cuda.", 1) if on_cpu else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to:
            # `.to(device)` / `.to(device, dtype)` pass the device positionally.
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _Stream:
    """Stand-in for torch.cuda.Stream: CPU work is synchronous, so every wait is already met."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    """Stand-in for torch.cuda.Event (see `_Stream`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _Stream()


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, and must not re-enter here.
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    """CUDA runtime calls Megatron makes for bookkeeping; on a CPU build they raise."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.is_current_stream_capturing = lambda: False
    # Megatron's "CUDA" RNG streams are the ones its dropout draws from: on CPU that is the
    # CPU default generator, so the tracker must save and restore that one.
    cuda.get_rng_state = cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda state, device="cuda": (
        torch.set_rng_state(state)
    )
    cuda.manual_seed = cuda.random.manual_seed = _cpu_manual_seed


def _run_backward_in_mode(mode: TorchFunctionMode) -> None:
    """Keep the device mode active inside the autograd engine.

    `torch.autograd.backward` itself dispatches through the mode, and a mode is popped while its
    handler runs, so the whole backward pass (Megatron's custom-Function backwards allocate with
    `device=torch.cuda.current_device()`) would otherwise run without it.
    """
    run = torch.autograd._engine_run_backward

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        if mode in torch.overrides._get_current_function_mode_stack():
            return run(*args, **kwargs)
        with mode:
            return run(*args, **kwargs)

    torch.autograd._engine_run_backward = run_backward


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mpu_random
    from megatron.core.transformer.moe import moe_utils

    # These two reach into torch.cuda.default_generators / lazy CUDA init directly; the rest of
    # the tracker (add, fork, model_parallel_cuda_manual_seed) goes through them or through the
    # torch.cuda RNG functions patched above.
    mpu_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mpu_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )
    # With the CUDA and CPU generators now the same, the tracker's "CPU RNG state changed within
    # GPU RNG context" warning fires on every forked draw and means nothing.
    logging.getLogger(mpu_random.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )
    # Without Transformer Engine this name is referenced (router gemm) but never bound.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _show_repeated_once(message, category, filename, lineno, file=None, line=None) -> None:
    text = str(message)
    group = next((name for name, pattern in _REPEATED_WARNINGS if pattern.search(text)), None)
    if group is None:
        _original_showwarning(message, category, filename, lineno, file, line)
        return
    if group in _shown_groups:
        return
    _shown_groups.add(group)
    if _is_rank0():
        note = " (shown once per run; megatron_lossfix hides the repeats)"
        _original_showwarning(text + note, category, filename, lineno, file, line)


def quiet_repeated_megatron_warnings() -> None:
    """Show Megatron-Core's repeated fallback warnings once per run instead of once per module
    and rank: "Transformer Engine and Apex are not installed ...", "Apex is not installed ..."
    and the ``cuda_graph_scope`` default's deprecation. The first of each kind is shown on
    global rank 0 (``RANK`` before ``torch.distributed`` starts), worded as Megatron wrote it;
    every other warning is shown as before. Idempotent; call it before importing Megatron to
    catch the import-time ones. ``-W error`` and other warning filters still apply first.
    """
    global _original_showwarning
    if _original_showwarning is not None:
        return
    _original_showwarning = warnings.showwarning
    warnings.showwarning = _show_repeated_once


def enable_cpu_megatron(force: bool = False) -> bool:
    """Bridge Megatron-Core's CUDA-only code paths to CPU for this process.

    Active only when CUDA is unavailable, or when `force` is True. Idempotent. Returns True when
    the process runs in CPU mode after the call, False on a GPU run (where nothing is changed).
    """
    global _ENABLED, _MODE
    if _ENABLED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    # Transformer Engine and Apex need CUDA: on CPU their fallback warnings are certain and
    # repeat per module and rank.
    quiet_repeated_megatron_warnings()
    _patch_torch_cuda()
    _patch_megatron()
    # Installed for the rest of the process, never exited: schedules and buffers allocate on
    # "cuda" at any time, including from autograd hooks.
    _MODE = _CudaToCpuMode()
    _run_backward_in_mode(_MODE)
    _MODE.__enter__()
    _ENABLED = True
    return True


# ---------------------------------------------------------------------------------- Megatron Bridge
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


class _Unavailable:
    """Stands for a Transformer Engine class: never an instance of anything, never built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Transformer Engine is not installed (CPU run)")


def _te_stub() -> Any:
    import types

    class _Namespace(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            value = _Namespace(f"{self.__name__}.{name}") if name.islower() else _Unavailable
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
        stub = _te_stub()
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
    set_random_seed = initialize._set_random_seed

    @functools.wraps(set_random_seed)
    def set_random_seed_with_one_device(*args: Any, **kwargs: Any) -> Any:
        device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            return set_random_seed(*args, **kwargs)
        finally:
            torch.cuda.device_count = device_count

    initialize._set_random_seed = set_random_seed_with_one_device
    build_loader = loaders.build_pretraining_data_loader
    # Pinned host memory needs a CUDA driver.
    loaders.build_pretraining_data_loader = functools.wraps(build_loader)(
        lambda *args, **kwargs: build_loader(*args, **{**kwargs, "pin_memory": False})
    )


def enable_cpu_bridge(force: bool = False) -> bool:
    """Run Megatron Bridge's training loop (``pretrain``/``finetune``) on a machine without CUDA.

    On top of :func:`enable_cpu_megatron`: lets Bridge initialize without CUDA, skips its dataset
    helper compilation and CUDA JIT warm-up, turns off pinned memory, answers its memory
    bookkeeping, and works around two import-time failures of a CPU install (Bridge's LoRA layers
    importing Transformer Engine; megatron-core rejecting nvidia-resiliency-ext older than 0.6).

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
