"""What Megatron-Core does to a loss, and what differs between its releases, in one place.

Supported: megatron-core 0.16.x through 0.20.x (0.17 and newer need Python >= 3.12). 0.20.0 is
Megatron-LM main (NeMo-RL pins it at 14346b6; it is not on the package index): there the
averaging (``forward_step_calc_loss``, DDP, ``finalize_model_grads``) is 0.19's.

* Averaging (docs/design.md §1): :func:`undo_averaging`, the factor that undoes it for the main
  loss and for MTP (pinned per release by ``tests/test_megatron_averaging.py``);
  :func:`unreduced_gradients`, the structure that must reduce a step's gradients across
  data-parallel ranks; :func:`gradient_side_paths`, the terms a scale of the step's gradients
  after the schedule would also rescale. Which data-parallel wrappers the step relies on, and
  their ``scale_gradients``: ``megatron_lossfix.step.wrappers``.
* ``get_batch_on_this_cp_rank``: from 0.18 ``cp_group=None`` means the world group and
  ``is_hybrid_cp`` is required; :func:`slice_batch_for_cp` passes both. 0.20 adds the optional
  ``hybrid_cp_group_func`` and ``use_per_sequence_balancing`` (their defaults are 0.19's slicing).
* ``get_forward_backward_func``: 0.19 adds ``schedule_pg_collection`` (0.20 types it as a
  ``MultiModuleProcessGroupCollection``); :func:`schedule_for` passes the sizes every release
  accepts.
* Process groups: :func:`resolve_groups` (the step's) and :func:`model_parallel_groups` (the
  model's shards) take them from the call's ``ProcessGroupCollection``, else from
  ``parallel_state``.

Megatron is imported inside the functions. A release outside :data:`TESTED_RANGE` warns once.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from megatron_lossfix.runtime.process_groups import ModelParallelGroups, StepGroups, group_size

#: The megatron-core releases the suite proves, as ``(lowest, first untested)``; 0.20.0 in the
#: NeMo-RL page's environment (docs/releases.md).
TESTED_RANGE: tuple[Version, Version] = (Version("0.16.0"), Version("0.21.0"))


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


def _pick(pg_collection: Any, name: str, fallback: Callable[[], Any], optional: bool) -> Any:
    """The group ``name`` of ``pg_collection``, else ``fallback()`` from ``parallel_state``
    (``optional``: None where Megatron's model parallelism is not initialized)."""
    from megatron.core import parallel_state as ps

    group = getattr(pg_collection, name, None) if pg_collection is not None else None
    if group is not None or (optional and not ps.model_parallel_is_initialized()):
        return group
    return fallback()


def resolve_groups(pg_collection: Any = None) -> StepGroups:
    """A step's groups from an explicit ``ProcessGroupCollection``, else from Megatron's
    ``parallel_state``."""
    from megatron.core import parallel_state as ps

    pick = functools.partial(_pick, pg_collection, optional=False)

    return StepGroups(
        dp=pick("dp", lambda: ps.get_data_parallel_group(with_context_parallel=False)),
        cp=pick("cp", ps.get_context_parallel_group),
        dp_cp=pick("dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        pp=pick("pp", ps.get_pipeline_model_parallel_group),
    )


def model_parallel_groups(pg_collection: Any = None) -> ModelParallelGroups:
    """The model's shard groups, from the ``ProcessGroupCollection`` else ``parallel_state``
    (None where Megatron's model parallelism is not initialized)."""
    from megatron.core import parallel_state as ps

    pick = functools.partial(_pick, pg_collection, optional=True)

    return ModelParallelGroups(
        tp=pick("tp", ps.get_tensor_model_parallel_group),
        mp=pick("mp", ps.get_model_parallel_group),
        expert_mp=pick("tp_ep_pp", ps.get_expert_tensor_model_pipeline_parallel_group),
    )


def model_config_of(chunk: Any) -> tuple[Any, Exception | None]:
    """The model chunk's config (``get_model_config``), or None and the error reading it."""
    try:
        from megatron.core.utils import get_model_config

        return get_model_config(chunk), None
    except Exception as exc:  # noqa: BLE001 - the caller decides what a missing config means
        return None, exc


def undo_averaging(
    per_token: bool,
    num_tokens: torch.Tensor,
    num_microbatches: int,
    groups: StepGroups,
    *,
    mtp: bool = False,
) -> torch.Tensor | float:
    """What a loss's ``sum(w * l)`` is multiplied by so that Megatron's averaging leaves it
    whole (docs/design.md §3). With ``calculate_per_token_loss`` Megatron divides every
    gradient by the all-reduced token count: N. Else DDP divides the gradient by D x cp, and
    the schedule multiplies the main loss by cp/M but an MTP layer's loss (``mtp``) by 1/M:
    M x D for the main loss, M x D x cp for MTP."""
    if per_token:
        return num_tokens.to(torch.float32)
    # D x cp from DDP, over the schedule's cp/M (main loss) or 1/M (MTP).
    return float(num_microbatches * groups.dp_size * (groups.cp_size if mtp else 1))


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
            "megatron.core.distributed.DistributedDataParallel (or Megatron-FSDP)"
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


def gradient_side_paths(model_config: Any) -> list[str]:
    """The gradient's terms that Megatron adds outside the loss function's return (MoE auxiliary
    and z-losses, multi-token prediction, DSA's indexer loss), each scaled by the schedule
    itself: a scale of the whole gradient after the schedule would rescale them too."""
    paths = []
    if getattr(model_config, "num_moe_experts", None):
        coeff = getattr(model_config, "moe_aux_loss_coeff", 0.0) or 0.0
        if any(c for c in (coeff if isinstance(coeff, (list, tuple)) else [coeff])):
            paths.append("MoE auxiliary loss")
        if getattr(model_config, "moe_z_loss_coeff", None):
            paths.append("MoE z-loss")
    if getattr(model_config, "mtp_num_layers", None):
        paths.append("multi-token prediction")
    if getattr(model_config, "experimental_attention_variant", None) == "dsa" or getattr(
        model_config, "experimental_attention_variant_loss_scale_func", None
    ):
        paths.append("the attention variant's auxiliary loss")
    return paths


def slice_batch_for_cp(batch: Mapping[str, Any], cp_group: dist.ProcessGroup) -> dict:
    """This context-parallel rank's share of ``batch``, sliced as Megatron slices tokens.

    Slice every tensor that must line up token by token (weights, mask, labels) in one call:
    with ``cu_seqlens`` in the batch, 0.18+ partitions packed documents by index. Entries
    without a sequence dimension (one value per sequence, such as ``group_ids``, or not a
    tensor, such as ``num_groups``) are passed through unsliced.
    """
    if cp_group is None:
        raise ValueError(
            "slice_batch_for_cp needs the context-parallel group (pg_collection.cp or "
            "parallel_state.get_context_parallel_group()); megatron-core >= 0.18 would slice "
            "over the world group"
        )
    if dist.get_world_size(cp_group) == 1:
        return dict(batch)
    unsliced = {
        k: v
        for k, v in batch.items()
        if k not in _CP_METADATA and v is not None and not (torch.is_tensor(v) and v.dim() >= 2)
    }
    tokens = {k: v for k, v in batch.items() if k not in unsliced}
    return {**_get_batch_on_this_cp_rank()(tokens, cp_group=cp_group), **unsliced}


#: What Megatron's CP slicing reads itself (packed-sequence metadata): never held back.
_CP_METADATA = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size")


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
