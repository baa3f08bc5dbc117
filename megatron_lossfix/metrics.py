"""The step's reported numbers as global values: identical whatever the parallel layout.

Per micro-batch the schedule records its share of the loss and the loss function's report; here
they are reduced over the data x context-parallel group of the loss stage and shared with the
other pipeline stages. Report entries are reduced by their name: ``*_sum`` and ``*_count``
summed, ``*_max`` maxed, ``*_min`` minimized; other entries are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_lossfix.reduction import count_tokens

if TYPE_CHECKING:
    from megatron_lossfix.config import LossFixConfig
    from megatron_lossfix.schedule import _StepState

__all__ = ["reduce_step_metrics"]

_SUFFIXES = ("_sum", "_count", "_max", "_min")


def _scalar_stats(reports: list[Any]) -> dict[str, list[torch.Tensor]]:
    stats: dict[str, list[torch.Tensor]] = {}
    for report in reports:
        if not isinstance(report, Mapping):
            continue
        for key, value in report.items():
            if key.endswith(_SUFFIXES) and isinstance(value, torch.Tensor) and value.numel() == 1:
                stats.setdefault(key, []).append(value.detach().reshape(()).double())
    return stats


def _local_metrics(state: _StepState, config: LossFixConfig) -> dict:
    groups = state.groups
    counts = state.counts
    if counts is None:  # streaming modes counted nothing before the step
        counts = count_tokens(
            state.masks,
            dp_group=groups.dp,
            cp_group=groups.cp if config.data_is_cp_sharded else None,
            segment_ids=[seg for seg, _ in state.segments],
            num_segments=[num for _, num in state.segments],
        )
    stats = _scalar_stats(state.reports)
    sums = sorted(k for k in stats if k.endswith(("_sum", "_count")))
    maxes = sorted(k for k in stats if k.endswith("_max"))
    mins = sorted(k for k in stats if k.endswith("_min"))
    device = counts.num_tokens.device
    loss = torch.stack(state.contributions).double().sum() if state.contributions else (
        torch.zeros((), dtype=torch.float64, device=device)
    )
    sum_vec = torch.stack([loss, *(torch.stack(stats[k]).sum() for k in sums)])
    if dist.is_initialized() and groups.dp_cp is not None:
        dist.all_reduce(sum_vec, group=groups.dp_cp)
    out = {
        "loss": sum_vec[0],
        "num_tokens": counts.num_tokens,
        "num_sequences": counts.num_sequences,
        **{k: sum_vec[1 + i] for i, k in enumerate(sums)},
    }
    if state.streaming and state.per_token:
        # Megatron's per-token mode divides the summed loss by the global token count.
        out["loss"] = out["loss"] / counts.num_tokens.clamp(min=1)
    if maxes or mins:
        max_vec = torch.stack(
            [torch.stack(stats[k]).max() for k in maxes]
            + [-torch.stack(stats[k]).min() for k in mins]
        )
        if dist.is_initialized() and groups.dp_cp is not None:
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX, group=groups.dp_cp)
        out.update({k: max_vec[i] for i, k in enumerate(maxes)})
        out.update({k: -max_vec[len(maxes) + i] for i, k in enumerate(mins)})
    return {k: float(v) for k, v in out.items()}


def reduce_step_metrics(state: _StepState | None, config: LossFixConfig) -> dict[str, float]:
    """Global metrics of the last step, returned on every rank of the pipeline group."""
    if state is None:
        raise ValueError("no step has run yet: call the schedule before asking for its metrics")
    groups = state.groups
    metrics = _local_metrics(state, config) if groups.is_last_stage else None
    if groups.pp is not None and dist.get_world_size(groups.pp) > 1:
        box = [metrics]
        last = dist.get_global_rank(groups.pp, dist.get_world_size(groups.pp) - 1)
        dist.broadcast_object_list(box, src=last, group=groups.pp)
        metrics = box[0]
    return metrics
