"""What Megatron-Core does to a loss, and what differs between its releases, in one place.

Supported: megatron-core 0.16.x through 0.19.x (0.17 and newer need Python >= 3.12).

* Averaging (docs/design.md §1): the factors that undo it, :func:`undo_averaging` for the main
  loss and :func:`undo_mtp_averaging` for MTP (pinned per release by
  ``tests/test_megatron_averaging.py``); :func:`unreduced_gradients`, the structure that must
  reduce a step's gradients across data-parallel ranks.
* ``get_batch_on_this_cp_rank``: from 0.18 ``cp_group=None`` means the world group and
  ``is_hybrid_cp`` is required; :func:`slice_batch_for_cp` passes both.
* ``get_forward_backward_func``: 0.19 adds ``schedule_pg_collection``; :func:`schedule_for`
  passes the sizes every release accepts.
* Process groups: :func:`resolve_groups` takes them from the call's ``ProcessGroupCollection``,
  else from ``parallel_state``.

Megatron is imported inside the functions. A release outside :data:`TESTED_RANGE` warns once.
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

#: The megatron-core releases the suite proves, as ``(lowest, first untested)``.
TESTED_RANGE: tuple[Version, Version] = (Version("0.16.0"), Version("0.20.0"))


@functools.cache
def megatron_core_version() -> Version:
    """The installed megatron-core release (from its metadata, else from the source tree)."""
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:  # a Megatron-LM checkout on PYTHONPATH
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
    """The process groups of a step (None: no such parallelism or not initialized)."""

    dp: dist.ProcessGroup | None
    """Data-parallel group without context parallelism (D)."""
    cp: dist.ProcessGroup | None
    """Context-parallel group: per-sequence counts of CP-sharded data."""
    dp_cp: dist.ProcessGroup | None
    """Data x context-parallel group: the step's counts, checks and metrics."""
    pp: dist.ProcessGroup | None
    """Pipeline group: the last (loss) stage, the verdict and metrics for every stage."""
    tp: dist.ProcessGroup | None = None
    """Tensor-parallel group (self-check)."""
    mp: dist.ProcessGroup | None = None
    """TP x PP (self-check: norms of dense parameters)."""
    expert_mp: dist.ProcessGroup | None = None
    """Expert TP x EP x PP (self-check: norms of expert parameters)."""

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


def resolve_groups(pg_collection: Any = None) -> StepGroups:
    """Groups from an explicit ``ProcessGroupCollection``, else from Megatron's parallel_state
    (the self-check's model-parallel groups only where it is initialized)."""
    from megatron.core import parallel_state as ps

    def pick(name: str, fallback: Callable[[], Any], optional: bool = False) -> Any:
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        if group is not None or (optional and not ps.model_parallel_is_initialized()):
            return group
        return fallback()

    return StepGroups(
        dp=pick("dp", lambda: ps.get_data_parallel_group(with_context_parallel=False)),
        cp=pick("cp", ps.get_context_parallel_group),
        dp_cp=pick("dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        pp=pick("pp", ps.get_pipeline_model_parallel_group),
        tp=pick("tp", ps.get_tensor_model_parallel_group, True),
        mp=pick("mp", ps.get_model_parallel_group, True),
        expert_mp=pick("tp_ep_pp", ps.get_expert_tensor_model_pipeline_parallel_group, True),
    )


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


def unreduced_gradients(chunks: list, model_config: Any, groups: StepGroups) -> str | None:
    """Why this step's gradients would not be summed across data x context-parallel ranks
    (each would silently train on its own share of the plugin's global weights), or None:
    Megatron DDP/FSDP must hold them and ``finalize_model_grads_func`` must reduce them."""
    if groups.dp_cp_size <= 1:
        return None
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    fixes = []
    if not all(isinstance(chunk, _BaseDataParallel) for chunk in chunks):
        kinds = sorted({type(chunk).__name__ for chunk in chunks})
        fixes.append(
            f"wrap the model (here {', '.join(kinds)}) in "
            "megatron.core.distributed.DistributedDataParallel (or FullyShardedDataParallel)"
        )
    if getattr(model_config, "finalize_model_grads_func", None) is None:
        fixes.append(
            "set config.finalize_model_grads_func = finalize_model_grads (from "
            "megatron.core.distributed)"
        )
    if not fixes:
        return None
    return (
        f"data-parallel x context-parallel size is {groups.dp_cp_size}, but the gradients "
        "would not be reduced across those ranks (each would train on its own share); "
        + " and ".join(fixes)
    )


def slice_batch_for_cp(batch: Mapping[str, Any], cp_group: dist.ProcessGroup) -> dict:
    """This context-parallel rank's share of ``batch``, sliced as Megatron slices tokens.

    Slice every tensor that must line up token by token (weights, mask, labels) in one call:
    with ``cu_seqlens`` in the batch, 0.18+ partitions packed documents by index.
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
    """Megatron's ``forward_backward_func`` for this pipeline group and these model chunks,
    with the (virtual) pipeline sizes passed rather than read from global state."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp_size = group_size(pp_group)
    chunks = len(model) if isinstance(model, list) else 1
    vp_size = chunks if pp_size > 1 and chunks > 1 else None
    return get_forward_backward_func(pp_size=pp_size, vp_size=vp_size)
