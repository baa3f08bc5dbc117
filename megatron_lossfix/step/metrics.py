"""The step's metrics: a :class:`~megatron_lossfix.step.driver.StepRecord` reduced to global
numbers.

``loss`` is L (docs/design.md §2), ``num_tokens`` N, ``num_sequences`` S, ``num_groups`` G
(modes over group ids), ``mtp_loss_<j>`` each MTP layer's; the reports' 0-dim entries named
``*_sum``/``*_count`` are summed, ``*_max`` maxed and ``*_min`` minimized over DP x CP. Where
the loss said which tokens it kept (``kept_weights``, docs/design.md §10):
``kept_token_fraction`` and ``kept_sequence_fraction`` (of the loss mask's tokens and
sequences), and under ``mask_in_loss`` N, S and G are the kept ones (0 when nothing was kept:
the step trained nothing). The loss stage computes them in a few kernels, whatever the number
of micro-batches, with one collective over DP x CP (an all-reduce; an all-gather where the
reports hold extremes, which carries the sums and the maxima at once), reads them to the host
once, and broadcasts them to the other pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import megatron_lossfix.step.megatron_compat as megatron_compat
from megatron_lossfix.runtime.process_groups import StepGroups, group_size

if TYPE_CHECKING:
    from megatron_lossfix.step.driver import StepRecord


def scalar_stats(reports: list[Any]) -> dict[str, list[torch.Tensor]]:
    """The reports' 0-dim entries named ``*_sum``, ``*_count``, ``*_max``, ``*_min``, by name
    (float64)."""
    return {k: [v.double() for v in vs] for k, vs in _scalar_entries(reports).items()}


def _scalar_entries(reports: list[Any]) -> dict[str, list[torch.Tensor]]:
    """:func:`scalar_stats` as the reports hold them (detached 0-dim views: no kernel)."""
    stats: dict[str, list[torch.Tensor]] = {}
    for report in reports:
        for key, value in report.items() if isinstance(report, Mapping) else ():
            if key.endswith(("_sum", "_count", "_max", "_min")) and (
                isinstance(value, torch.Tensor) and value.numel() == 1
            ):
                stats.setdefault(key, []).append(value.detach().reshape(()))
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


def _flat(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-dim tensors as one float64 vector on ``device``: one stack where they share a dtype
    and a device (each value converted exactly, as one by one)."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    first = values[0]
    if all(v.dtype == first.dtype and v.device == first.device for v in values):
        return torch.stack(values).to(device=device, dtype=torch.float64)
    return torch.stack([v.to(device=device, dtype=torch.float64) for v in values])


def _per_group(
    groups: list[list[torch.Tensor]], device: torch.device, op: Callable = torch.sum
) -> torch.Tensor:
    """Each group's ``op`` (``torch.sum``, an empty group giving 0; ``torch.amax``,
    ``torch.amin`` of groups never empty) in float64, one vector: a few kernels whatever the
    number of values."""
    if not groups:
        return torch.zeros(0, dtype=torch.float64, device=device)
    flat, lengths = _flat([v for g in groups for v in g], device), [len(g) for g in groups]
    if len(set(lengths)) == 1:
        return op(flat.view(len(groups), lengths[0]), dim=1)
    return torch.stack([op(part) for part in torch.split(flat, lengths)])


def _local_metrics(record: StepRecord, groups: StepGroups) -> dict[str, float]:
    """The loss stage's metrics: one all-reduce over DP x CP (an all-gather where the reports
    hold extremes: their maxima and sums in one collective), and one read by the host."""
    stats = _scalar_entries(record.reports)
    sums = sorted(k for k in stats if k.endswith(("_sum", "_count")))
    maxima = sorted(k for k in stats if k.endswith("_max"))
    minima = sorted(k for k in stats if k.endswith("_min"))
    if record.counts is not None:  # a plugin mode: the counts' device
        device = record.counts.num_tokens.device
    else:  # ``off``: the reports' device
        device = next((v[0].device for v in stats.values()), torch.device("cpu"))
    mtp = record.mtp.contributions if record.mtp is not None else []
    sum_vec = _per_group([record.contributions, *(stats[k] for k in sums), *mtp], device)
    # The maxima of x and of -x: one MAX gives the minima too.
    max_vec = None
    if maxima or minima:
        max_vec = torch.cat(
            [_per_group([stats[k] for k in maxima], device, torch.amax),
             -_per_group([stats[k] for k in minima], device, torch.amin)]
        )  # fmt: skip
    if dist.is_initialized() and group_size(groups.dp_cp) > 1:
        sum_vec, max_vec = _reduce(sum_vec, max_vec, groups.dp_cp)
    out: dict[str, Any] = {k: sum_vec[1 + i] for i, k in enumerate(sums)}
    if record.kept is not None:  # sums weighted by kept weights that waited for their factor
        for name in record.kept.weighted_names & set(out):
            out[name] = out[name] * record.loss_scale
    out.update({f"mtp_loss_{j + 1}": sum_vec[1 + len(sums) + j] for j in range(len(mtp))})
    out.update({k: max_vec[i] for i, k in enumerate(maxima)})
    out.update({k: -max_vec[len(maxima) + i] for i, k in enumerate(minima)})
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
    return _to_host(out, device)


def _reduce(
    sum_vec: torch.Tensor, max_vec: torch.Tensor | None, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sum_vec`` summed and ``max_vec`` maxed over ``group``, in one collective."""
    if max_vec is None:
        dist.all_reduce(sum_vec, group=group)
        return sum_vec, max_vec
    both = torch.cat([sum_vec, max_vec])
    ranks = dist.get_world_size(group)
    gathered = both.new_empty(ranks * both.numel())
    dist.all_gather_into_tensor(gathered, both, group=group)
    gathered = gathered.view(ranks, both.numel())
    return gathered[:, : sum_vec.numel()].sum(dim=0), gathered[:, sum_vec.numel() :].amax(dim=0)


def _to_host(out: dict[str, Any], device: torch.device) -> dict[str, float]:
    """The metrics as floats, every tensor among them read in one copy to the host."""
    tensors = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
    values = _flat([out[k] for k in tensors], device).tolist() if tensors else []
    host = {k: float(v) for k, v in out.items() if not isinstance(v, torch.Tensor)}
    host.update(zip(tensors, values, strict=True))
    return {k: host[k] for k in out}


def _kept_metrics(record: StepRecord) -> dict[str, Any]:
    """The kept fractions, and under ``mask_in_loss`` the kept N and S (docs/design.md §10)."""
    kept = record.kept_counts
    if kept is None:
        return {}
    tokens, sequences = record.counts.num_tokens, record.counts.num_sequences  # on the device
    out: dict[str, Any] = {"kept_token_fraction": kept.num_tokens / tokens.clamp(min=1.0)}
    if kept.num_sequences is not None:
        out["kept_sequence_fraction"] = kept.num_sequences / sequences.clamp(min=1.0)
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
