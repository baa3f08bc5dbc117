"""The step's metrics: a :class:`~megatron_lossfix.step.driver.StepRecord` reduced to global
numbers.

``loss`` is L (docs/design.md §2), ``num_tokens`` N, ``num_sequences`` S, ``num_groups`` G
(modes over group ids), ``mtp_loss_<j>`` each MTP layer's; the reports' 0-dim entries named
``*_sum``/``*_count`` are summed, ``*_max`` maxed and ``*_min`` minimized over DP x CP. Where
the loss said which tokens it kept (``kept_weights``, docs/design.md §10):
``kept_token_fraction`` and ``kept_sequence_fraction`` (of the loss mask's tokens and
sequences), and under ``mask_in_loss`` N, S and G are the kept ones (0 when nothing was kept:
the step trained nothing). The loss stage computes them (one SUM and one MAX all-reduce over
DP x CP) and broadcasts them to the other pipeline stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import megatron_lossfix.step.megatron_compat as megatron_compat
from megatron_lossfix.runtime.process_groups import StepGroups, group_size

if TYPE_CHECKING:
    from megatron_lossfix.step.driver import StepRecord


def scalar_stats(reports: list[Any]) -> dict[str, list[torch.Tensor]]:
    """The reports' 0-dim entries named ``*_sum``, ``*_count``, ``*_max``, ``*_min``, by name."""
    stats: dict[str, list[torch.Tensor]] = {}
    for report in reports:
        for key, value in report.items() if isinstance(report, Mapping) else ():
            if key.endswith(("_sum", "_count", "_max", "_min")) and (
                isinstance(value, torch.Tensor) and value.numel() == 1
            ):
                stats.setdefault(key, []).append(value.detach().reshape(()).double())
    return stats


def reduce_step_metrics(record: StepRecord | None) -> dict[str, float]:
    """Global metrics of the step ``record`` holds, returned on every rank of the pipeline
    group (collectives over DP x CP and PP)."""
    if record is None:
        raise ValueError("no step has run yet: call the schedule before asking for its metrics")
    groups = record.groups
    if groups is None:  # ``off`` resolved nothing during the step
        groups = megatron_compat.resolve_groups(record.pg_collection)
    metrics = _local_metrics(record, groups) if groups.is_last_stage else None
    if group_size(groups.pp) > 1:
        box = [metrics]
        last = dist.get_global_rank(groups.pp, dist.get_world_size(groups.pp) - 1)
        dist.broadcast_object_list(box, src=last, group=groups.pp)
        metrics = box[0]
    return metrics


def _local_metrics(record: StepRecord, groups: StepGroups) -> dict[str, float]:
    """The loss stage's metrics: one SUM all-reduce over DP x CP, one MAX for the extremes."""
    stats = scalar_stats(record.reports)
    sums = sorted(k for k in stats if k.endswith(("_sum", "_count")))
    extremes = sorted(k for k in stats if k.endswith(("_max", "_min")))
    if record.counts is not None:  # a plugin mode: the counts' device
        device = record.counts.num_tokens.device
    else:  # ``off``: the reports' device
        device = next((v[0].device for v in stats.values()), torch.device("cpu"))

    def total(values: list[torch.Tensor]) -> torch.Tensor:
        if not values:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(values).double().sum().to(device)

    mtp = record.mtp.contributions if record.mtp is not None else []
    sum_vec = torch.stack(
        [total(record.contributions), *(total(stats[k]) for k in sums), *map(total, mtp)]
    )
    # The maxima of x and of -x: one MAX all-reduce gives the minima too.
    sign = {k: 1.0 if k.endswith("_max") else -1.0 for k in extremes}
    maxima = [(torch.stack(stats[k]) * sign[k]).max() for k in extremes]
    max_vec = torch.stack(maxima) if maxima else None
    if dist.is_initialized() and groups.dp_cp is not None:
        dist.all_reduce(sum_vec, group=groups.dp_cp)
        if max_vec is not None:
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX, group=groups.dp_cp)
    out: dict[str, Any] = {k: sum_vec[1 + i] for i, k in enumerate(sums)}
    if record.kept is not None:  # sums weighted by kept weights that waited for their factor
        for name in record.kept.weighted_names & set(out):
            out[name] = out[name] * record.loss_scale
    out.update({f"mtp_loss_{j + 1}": sum_vec[1 + len(sums) + j] for j in range(len(mtp))})
    out.update({k: max_vec[i] * sign[k] for i, k in enumerate(extremes)})
    if record.counts is not None:  # a plugin mode
        out["num_tokens"] = record.counts.num_tokens
        out["num_sequences"] = record.counts.num_sequences
        if record.counts.group_tokens is not None:  # groups (trajectories) with a loss token
            out["num_groups"] = (record.counts.group_tokens > 0).sum()
        out["loss"] = sum_vec[0] * record.loss_scale
        if record.passthrough and record.per_token:
            # Megatron's per-token mode divides the summed loss by the global token count.
            out["loss"] = sum_vec[0] / record.counts.num_tokens.clamp(min=1)
        out.update(_kept_metrics(record))
    return {k: float(v) for k, v in out.items()}


def _kept_metrics(record: StepRecord) -> dict[str, Any]:
    """The kept fractions, and under ``mask_in_loss`` the kept N and S (docs/design.md §10)."""
    kept = record.kept_counts
    if kept is None:
        return {}
    tokens, sequences = float(record.counts.num_tokens), float(record.counts.num_sequences)
    out: dict[str, Any] = {"kept_token_fraction": kept.num_tokens / max(tokens, 1.0)}
    if kept.num_sequences is not None:
        out["kept_sequence_fraction"] = kept.num_sequences / max(sequences, 1.0)
    kept_groups = None if record.kept is None else record.kept.group_counts
    if kept_groups is not None and record.counts.group_tokens is not None:
        kept_groups = (kept_groups > 0).sum()
        groups = (record.counts.group_tokens > 0).sum().clamp(min=1)
        out["kept_group_fraction"] = kept_groups / groups
    if record.config.mask_in_loss:
        out["num_tokens"] = kept.num_tokens
        if kept.num_sequences is not None:
            out["num_sequences"] = kept.num_sequences
        if kept_groups is not None:
            out["num_groups"] = kept_groups
    return out
