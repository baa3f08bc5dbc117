"""Every Megatron-Core call whose signature or meaning differs between releases, in one place.

Supported: megatron-core 0.16.x through 0.19.x (0.17 and newer need Python >= 3.12). What moved:

* ``get_batch_on_this_cp_rank``: from 0.18 ``is_hybrid_cp`` is required and ``cp_group=None``
  no longer means the context-parallel group (it falls back to the world group), so a CP x DP
  layout silently gets the wrong slice. :func:`slice_batch_for_cp` always passes the group.
* ``get_forward_backward_func``: 0.19 adds ``schedule_pg_collection``; :func:`schedule_for`
  picks the schedule from the pipeline group and model chunks instead of global state.
* the process groups: :func:`resolve_groups` takes them from the call's
  ``ProcessGroupCollection`` (newer releases pass one) and falls back to ``parallel_state``.
* ``NullTokenizer``: its EOD id is ``vocab_size`` up to 0.17 and ``vocab_size - 1`` from 0.18;
  :func:`null_tokenizer_eod` asks the installed class.

Also here, because the math layer (``reduction``, ``losses``, ...) never imports Megatron: the
step's process groups (:func:`resolve_groups`) and the factors that undo Megatron's averaging
of a loss (:func:`undo_averaging`, :func:`undo_mtp_averaging`), which the suite pins per
release (``tests/test_megatron_averaging.py``).

Megatron is imported inside the functions, so importing this module stays cheap. A release
outside the tested range warns once (:func:`warn_if_untested`) and names the command that
verifies it: Megatron's averaging, which the plugin undoes, is pinned per release by the suite.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from megatron_lossfix.reduction import group_size

__all__ = [
    "TESTED_RANGE",
    "StepGroups",
    "group_size",
    "undo_averaging",
    "undo_mtp_averaging",
    "megatron_core_version",
    "null_tokenizer_eod",
    "resolve_groups",
    "schedule_for",
    "slice_batch_for_cp",
    "warn_if_untested",
]

#: The megatron-core releases the suite proves, as ``(lowest, first untested)``.
TESTED_RANGE: tuple[Version, Version] = (Version("0.16.0"), Version("0.20.0"))


@functools.cache
def megatron_core_version() -> Version:
    """The installed megatron-core release (from its metadata, else from the source tree)."""
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        # A Megatron-LM checkout on PYTHONPATH carries no distribution metadata.
        from megatron.core import package_info

        return Version(package_info.__version__)


@functools.cache
def warn_if_untested() -> bool:
    """Warn once when megatron-core is outside :data:`TESTED_RANGE`; True when it is inside."""
    version = megatron_core_version()
    low, high = TESTED_RANGE
    if low <= Version(version.base_version) < high:
        return True
    warnings.warn(
        f"megatron_lossfix is tested with megatron-core >={low},<{high}; this is {version}. "
        "A release that changed how its schedule or DDP averages the loss would make the "
        "compensation wrong without an error: run `python -m megatron_lossfix audit` (the "
        "gradient oracle over the layout matrix) before training with it.",
        stacklevel=2,
    )
    return False


@dataclass(frozen=True, slots=True)
class StepGroups:
    """The process groups the plugin needs, taken from Megatron's ``ProcessGroupCollection``."""

    dp: dist.ProcessGroup | None
    """Data-parallel group without context parallelism: sequence and token counts."""
    cp: dist.ProcessGroup | None
    """Context-parallel group: per-sequence counts of CP-sharded data."""
    dp_cp: dist.ProcessGroup | None
    """Data x context-parallel group: the step's counts, checks and reported loss."""
    pp: dist.ProcessGroup | None
    """Pipeline group: finding the last (loss) stage, the verdict and metrics for every stage."""
    tp: dist.ProcessGroup | None = None
    """Tensor-parallel group (the self-check: who broadcasts batches, which copy to count)."""
    mp: dist.ProcessGroup | None = None
    """TP x PP (the self-check: squared norms of dense parameters; with dp_cp, every rank)."""
    expert_mp: dist.ProcessGroup | None = None
    """Expert TP x EP x PP (the self-check: squared norms of expert parameters)."""

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def dp_cp_size(self) -> int:
        return group_size(self.dp_cp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def is_last_stage(self) -> bool:
        return self.pp is None or dist.get_rank(self.pp) == group_size(self.pp) - 1


def undo_averaging(
    per_token: bool, num_tokens: torch.Tensor, num_microbatches: int, groups: StepGroups
) -> torch.Tensor | float:
    """What the main loss's ``sum(w * l)`` is multiplied by so that Megatron's averaging leaves
    it whole: with ``calculate_per_token_loss`` Megatron divides every gradient by the
    all-reduced token count, N; else the schedule multiplies the loss by cp/M and DDP divides
    the gradient by D x cp, so M x D."""
    if per_token:
        return num_tokens.to(torch.float32)
    return float(num_microbatches * groups.dp_size)


def undo_mtp_averaging(
    per_token: bool, num_tokens: torch.Tensor, num_microbatches: int, groups: StepGroups
) -> torch.Tensor | float:
    """The same for an MTP layer's loss: N on the per-token path; else the schedule scales the
    MTP loss by 1/M (no CP factor, unlike the main loss) and DDP divides by D x cp."""
    if per_token:
        return num_tokens.to(torch.float32)
    return float(num_microbatches * groups.dp_size * groups.cp_size)


def resolve_groups(pg_collection: Any = None) -> StepGroups:
    """Groups from an explicit ``ProcessGroupCollection``, else from Megatron's parallel_state.
    The self-check's model-parallel groups are None where neither has them."""
    from megatron.core import parallel_state as ps

    def pick(name: str, fallback: Callable[[], Any]) -> Any:
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        return group if group is not None else fallback()

    def optional(fallback: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: fallback() if ps.model_parallel_is_initialized() else None

    return StepGroups(
        dp=pick("dp", lambda: ps.get_data_parallel_group(with_context_parallel=False)),
        cp=pick("cp", ps.get_context_parallel_group),
        dp_cp=pick("dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        pp=pick("pp", ps.get_pipeline_model_parallel_group),
        tp=pick("tp", optional(ps.get_tensor_model_parallel_group)),
        mp=pick("mp", optional(ps.get_model_parallel_group)),
        expert_mp=pick("tp_ep_pp", optional(ps.get_expert_tensor_model_pipeline_parallel_group)),
    )


def slice_batch_for_cp(batch: Mapping[str, Any], cp_group: dist.ProcessGroup) -> dict:
    """This context-parallel rank's share of ``batch``, sliced as Megatron slices tokens.

    Calls Megatron's ``get_batch_on_this_cp_rank`` with the CP group passed explicitly (from 0.18
    its ``None`` default means the world group). Tensors that must line up token by token (the
    loss weights, the mask, the labels) have to be sliced in one call: with ``cu_seqlens`` in the
    batch, 0.18+ partitions packed documents by index rather than by the zigzag chunks.
    """
    if cp_group is None:
        raise ValueError(
            "slice_batch_for_cp needs the context-parallel group (pg_collection.cp or "
            "parallel_state.get_context_parallel_group()); megatron-core >= 0.18 would slice "
            "over the world group"
        )
    if dist.get_world_size(cp_group) == 1:
        return dict(batch)
    return _get_batch_on_this_cp_rank()(dict(batch), cp_group=cp_group)


@functools.cache
def _get_batch_on_this_cp_rank() -> Callable[..., dict]:
    from megatron.core import utils

    slice_batch = utils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(slice_batch).parameters:
        # Hybrid CP regroups ranks per sample; the plugin supports only the static CP group.
        return functools.partial(slice_batch, is_hybrid_cp=False)
    return slice_batch


def schedule_for(model: Any, pp_group: dist.ProcessGroup | None) -> Callable[..., Any]:
    """Megatron's ``forward_backward_func`` for this pipeline group and these model chunks.

    Passes the pipeline and virtual-pipeline sizes explicitly rather than letting Megatron read
    its global parallel state (0.19 added ``schedule_pg_collection`` to the same function; the
    sizes are the part every release accepts).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp_size = 1 if pp_group is None else dist.get_world_size(pp_group)
    chunks = len(model) if isinstance(model, list) else 1
    vp_size = chunks if pp_size > 1 and chunks > 1 else None
    return get_forward_backward_func(pp_size=pp_size, vp_size=vp_size)


@functools.cache
def null_tokenizer_eod(vocab_size: int) -> int:
    """The EOD id of Megatron's ``NullTokenizer`` for ``--vocab-size vocab_size``."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return int(NullTokenizer(vocab_size).eod)
