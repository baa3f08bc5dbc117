"""Import ms-swift's Megatron trainers where Transformer Engine is not installed.

ms-swift's Megatron trainers (``swift/megatron/trainers/``) import ``mcore_bridge``, whose
package imports Transformer Engine unguarded: ``mcore_bridge/patcher.py`` (run by its
``__init__``) and its LoRA and model modules, which only use it when a model is built from a
Hugging Face checkpoint or LoRA is added to a Transformer Engine layer.
:func:`provide_transformer_engine` lets those modules import against stand-ins of Transformer
Engine whose classes refuse to be built, in ``sys.modules`` only while a ``mcore_bridge``
module's body runs (after megatron-core's, peft's and Megatron's layer specs' own probes have
answered "not installed"): nothing else sees them.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from typing import Any

from megatron_lossfix.integrations.bridge.cpu import TEUnavailable, te_stand_in

__all__ = ["gather_scalars_on_gloo", "provide_transformer_engine"]

#: The package whose modules import Transformer Engine at their top.
PACKAGE = "mcore_bridge"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")
_EXTENSIONS = "megatron.core.extensions.transformer_engine"
_PATCHER = "mcore_bridge.patcher"
#: Modules that mcore_bridge imports and that probe Transformer Engine when imported
#: (megatron-core's layer specs, peft's LoRA): imported before the stand-ins can be seen.
_IMPORTED_FIRST = (
    _EXTENSIONS,
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.hybrid.hybrid_layer_specs",
    "peft.tuners.lora",
)


class _StandInLoader:
    """Runs one ``mcore_bridge`` module's body with the Transformer Engine stand-ins present."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        saved = {name: sys.modules.get(name) for name in _TE_NAMES}
        fresh = saved["transformer_engine"] is None
        if fresh:
            stub = te_stand_in()
            sys.modules["transformer_engine"] = stub
            sys.modules["transformer_engine.pytorch"] = stub.pytorch
        try:
            self._loader.exec_module(module)
        finally:
            if fresh:
                for name, previous in saved.items():
                    if previous is None:
                        sys.modules.pop(name, None)
                    else:
                        sys.modules[name] = previous
        if module.__name__ == _PATCHER:
            # Its apply_patch (run by the package's __init__) sets attributes on megatron-core's
            # Transformer Engine classes, which megatron-core defines as None without it: here
            # those names are stand-ins that refuse to be built (megatron-core's stay None).
            for name, value in list(vars(module).items()):
                if name.startswith("TE") and value is None:
                    setattr(module, name, type(name, (TEUnavailable,), {}))


class _McoreBridgeFinder:
    """Finds ``mcore_bridge`` and its modules as usual, to load with :class:`_StandInLoader`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _StandInLoader(spec.loader)
        return spec


def provide_transformer_engine() -> bool:
    """Where Transformer Engine is not installed, let ``mcore_bridge`` (and so ms-swift's Megatron
    trainers) import against its stand-ins (module docstring). Call it before anything imports
    ``mcore_bridge``; idempotent. Returns True when the stand-ins are in use."""
    if any(isinstance(f, _McoreBridgeFinder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    # The other packages' probes answer first, against the real (missing) package.
    for name in _IMPORTED_FIRST:
        importlib.import_module(name)
    sys.meta_path.insert(0, _McoreBridgeFinder())
    return True


def gather_scalars_on_gloo() -> None:
    """Let ``all_gather_into_tensor`` gather 0-d tensors on gloo as NCCL does (TRL's KTO loss,
    through ms-swift's ``DummyKTOTrainer.gather_for_metrics``, gathers its 0-d KL estimate):
    gloo wants the input one-dimensional. Idempotent; other calls are unchanged."""
    import torch.distributed as dist

    gather = dist.all_gather_into_tensor
    if getattr(gather, "lossfix_scalars", False):
        return

    def all_gather_into_tensor(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        if input.dim() == 0:
            input = input.reshape(1)
        return gather(output, input, *args, **kwargs)

    all_gather_into_tensor.lossfix_scalars = True  # type: ignore[attr-defined]
    dist.all_gather_into_tensor = all_gather_into_tensor
