"""The step's reported numbers as global values: identical whatever the parallel layout.

Per micro-batch the schedule records its share of the loss and the loss function's report; here
they are reduced over the data x context-parallel group of the loss stage and shared with the
other pipeline stages. Report entries are reduced by their name: ``*_sum`` and ``*_count``
summed, ``*_max`` maxed, ``*_min`` minimized; other entries are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.megatron_compat import StepGroups, resolve_groups
from megatron_lossfix.mtp import MTPStep
from megatron_lossfix.reduction import StepCounts

__all__ = ["StepState", "reduce_step_metrics", "scalar_stats"]


@dataclass(slots=True)
class StepState:
    """What one step recorded on this rank, for metrics (tensors stay on device).

    The schedule fills it in while the step runs; :func:`reduce_step_metrics` reads it."""

    reduction: str
    per_token: bool | None
    """``None`` with ``off`` (the plugin does not look at the model's config there)."""
    passthrough: bool
    """The loss tuples went to Megatron unchanged (``off``, per-token ``token_mean``)."""
    groups: StepGroups | None
    """``None`` with ``off`` until the metrics need them (``off`` resolves nothing per step)."""
    num_microbatches: int = 0
    pg_collection: Any = None
    counts: StepCounts | None = None
    masks: list[torch.Tensor] = field(default_factory=list)
    segments: list[tuple[torch.Tensor | None, int | None]] = field(default_factory=list)
    contributions: list[torch.Tensor] = field(default_factory=list)
    local_tokens: list[torch.Tensor] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)
    """The loss functions' reports (``off``: the list Megatron's schedule returned)."""
    problem: Exception | None = None
    """The first error of the loss stage inside Megatron's schedule (a plugin mode): the step
    ran on with a zero loss there, and every rank of the step refuses it afterwards."""
    mtp: MTPStep | None = None
    """The MTP layers' weights and recorded losses (a plugin mode, loss stage, MTP models)."""


_SUFFIXES = ("_sum", "_count", "_max", "_min")


def scalar_stats(reports: list[Any]) -> dict[str, list[torch.Tensor]]:
    stats: dict[str, list[torch.Tensor]] = {}
    for report in reports:
        if not isinstance(report, Mapping):
            continue
        for key, value in report.items():
            if key.endswith(_SUFFIXES) and isinstance(value, torch.Tensor) and value.numel() == 1:
                stats.setdefault(key, []).append(value.detach().reshape(()).double())
    return stats


def _reduce_extremes(
    stats: dict[str, list[torch.Tensor]], groups: StepGroups, out: dict[str, Any]
) -> None:
    """``*_max`` and ``*_min`` report entries, over DP x CP, into ``out`` (one all-reduce)."""
    maxes = sorted(k for k in stats if k.endswith("_max"))
    mins = sorted(k for k in stats if k.endswith("_min"))
    if not (maxes or mins):
        return
    max_vec = torch.stack(
        [torch.stack(stats[k]).max() for k in maxes] + [-torch.stack(stats[k]).min() for k in mins]
    )
    if dist.is_initialized() and groups.dp_cp is not None:
        dist.all_reduce(max_vec, op=dist.ReduceOp.MAX, group=groups.dp_cp)
    out.update({k: max_vec[i] for i, k in enumerate(maxes)})
    out.update({k: -max_vec[len(maxes) + i] for i, k in enumerate(mins)})


def _local_metrics(state: StepState) -> dict:
    groups = state.groups
    stats = scalar_stats(state.reports)
    sums = sorted(k for k in stats if k.endswith(("_sum", "_count")))
    if state.masks:
        device = state.masks[0].device
    else:  # ``off``: the reports' device
        device = next((v[0].device for v in stats.values()), torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float64, device=device)
    contributions = state.contributions
    loss = torch.stack(contributions).double().sum().to(device) if contributions else zero
    # Each MTP layer's share of the loss, sum(w_j * l_j) (plugin modes, loss stage).
    mtp = state.mtp.contributions if state.mtp is not None else []
    sum_vec = torch.stack(
        [
            loss,
            *(torch.stack(stats[k]).sum().to(device) for k in sums),
            *(torch.stack(c).double().sum().to(device) if c else zero for c in mtp),
        ]
    )
    if dist.is_initialized() and groups.dp_cp is not None:
        dist.all_reduce(sum_vec, group=groups.dp_cp)
    out: dict[str, Any] = {k: sum_vec[1 + i] for i, k in enumerate(sums)}
    out.update({f"mtp_loss_{j + 1}": sum_vec[1 + len(sums) + j] for j in range(len(mtp))})
    if state.counts is not None:  # a plugin mode
        num_tokens = state.counts.num_tokens
        out["num_tokens"] = num_tokens
        out["num_sequences"] = state.counts.num_sequences
        out["loss"] = sum_vec[0]
        if state.passthrough and state.per_token:
            # Megatron's per-token mode divides the summed loss by the global token count.
            out["loss"] = sum_vec[0] / num_tokens.clamp(min=1)
    _reduce_extremes(stats, groups, out)
    return {k: float(v) for k, v in out.items()}


def reduce_step_metrics(state: StepState | None) -> dict[str, float]:
    """Global metrics of the last step, returned on every rank of the pipeline group."""
    if state is None:
        raise ValueError("no step has run yet: call the schedule before asking for its metrics")
    if state.groups is None:
        # ``off`` resolved nothing during the step (stock needs nothing of the plugin).
        state.groups = resolve_groups(state.pg_collection)
    groups = state.groups
    metrics = _local_metrics(state) if groups.is_last_stage else None
    if groups.pp is not None and dist.get_world_size(groups.pp) > 1:
        box = [metrics]
        last = dist.get_global_rank(groups.pp, dist.get_world_size(groups.pp) - 1)
        dist.broadcast_object_list(box, src=last, group=groups.pp)
        metrics = box[0]
    return metrics
