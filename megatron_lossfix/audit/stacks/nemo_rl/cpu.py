"""``--stack nemo-rl``: NeMo-RL's Megatron training step importable and runnable on a CPU.

Nothing of NeMo-RL, Megatron Bridge or Megatron-Core is edited; what this module does:

* Megatron Bridge's package ``__init__`` imports Transformer Engine unguarded (its LoRA layers,
  through its model registry). ``megatron.bridge`` is registered as the installed package's
  folder without running its ``__init__``: its modules on NeMo-RL's loss path (process-group
  helpers, train utilities) import from that folder as released.
* The Bridge modules NeMo-RL's worker imports for checkpoints, setup and model building (none
  runs in a training step) are stand-ins whose every name refuses to be used, in one line
  (:data:`STAND_INS`).
* The CPU bridge of Megatron-Core (``enable_cpu_megatron``), plus ``torch.cuda.get_device_name``
  (the worker's metrics name the device) and pinned memory, which need a CUDA build with a GPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import torch

__all__ = ["STAND_INS", "prepare_nemo_rl_imports"]

#: Bridge modules (and their names) that NeMo-RL's worker imports but its training step never
#: runs; each is served as a stand-in that refuses to be used.
STAND_INS: tuple[str, ...] = (
    "megatron.bridge.training.checkpointing",
    "megatron.bridge.peft.lora_layers",
    "megatron.bridge.models.hf_pretrained.causal_lm",
    "megatron.bridge.models.hf_pretrained.masked_lm",
    "megatron.bridge.training.config",
    "megatron.bridge.training.initialize",
)


#: Bridge packages whose ``__init__`` imports Transformer Engine (through the model registry or
#: the LoRA layers): registered as their folders, their ``__init__`` not run.
UNEXECUTED: tuple[str, ...] = ("megatron.bridge", "megatron.bridge.models")


def _folder_only(name: str) -> None:
    """Register the installed package ``name`` as its folder, without running its ``__init__``."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not an installed package")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


#: Names NeMo-RL's setup code imports from those packages' ``__init__``: stand-ins too.
STAND_IN_NAMES: dict[str, tuple[str, ...]] = {"megatron.bridge": ("AutoBridge",)}


class _Refuses:
    """A name of a stand-in module: using it (calling, building, reading) raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._name} is a stand-in of the nemo-rl stack audit (Megatron Bridge's module "
            "needs Transformer Engine or a GPU): it is not part of the training step"
        )

    __call__ = _refuse

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Refuses(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __or__(self, other: Any) -> Any:  # in annotations: ``StandIn | None``
        return Any

    __ror__ = __or__

    def __getitem__(self, item: Any) -> Any:  # in annotations: ``StandIn[...]``
        return Any


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Refuses(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in STAND_INS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_PREPARED = False


def prepare_nemo_rl_imports() -> None:
    """Make NeMo-RL's Megatron worker importable here (module docstring); idempotent."""
    global _PREPARED
    if _PREPARED:
        return
    from megatron_lossfix.harness.cpu_megatron import enable_cpu_megatron, is_cpu_mode

    enable_cpu_megatron()
    if "megatron.bridge" not in sys.modules:
        spec = importlib.util.find_spec("megatron.bridge")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                "megatron.bridge is not installed: install NeMo-RL as docs/nemo_rl.md says "
                "(python -m megatron_lossfix install-nemo-rl ...)"
            )
        for name in UNEXECUTED:
            _folder_only(name)
        for name, attrs in STAND_IN_NAMES.items():
            for attr in attrs:
                setattr(sys.modules[name], attr, _Refuses(f"{name}.{attr}"))
    sys.meta_path.insert(0, _StandInFinder())
    if is_cpu_mode():
        torch.cuda.get_device_name = lambda *args, **kwargs: "cpu"  # type: ignore[assignment]
        _no_pinned_memory()
    _PREPARED = True


def _no_pinned_memory() -> None:
    """``pin_memory=True`` needs a GPU; on CPU, allocate the same tensor unpinned."""
    for name in ("empty", "zeros", "ones", "empty_like", "zeros_like", "tensor"):
        original = getattr(torch, name)

        def unpinned(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return _original(*args, **kwargs)

        setattr(torch, name, unpinned)
