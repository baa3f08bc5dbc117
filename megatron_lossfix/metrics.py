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

from megatron_lossfix.config import LossFixConfig
from megatron_lossfix.megatron_compat import StepGroups, resolve_groups
from megatron_lossfix.mtp import MTPStep
from megatron_lossfix.reduction import StepCounts, count_tokens

__all__ = ["StepState", "reduce_step_metrics", "scalar_stats", "stock_contributions"]


@dataclass(slots=True)
class StepState:
    """What one step recorded on this rank, for metrics (tensors stay on device).

    The schedule fills it in while the step runs; :func:`reduce_step_metrics` reads it."""

    reduction: str
    per_token: bool | None
    """``None`` with ``off`` until the metrics need it (stock reads the flag only for 3-tuples)."""
    passthrough: bool
    """The loss tuples went to Megatron unchanged (``off``, per-token ``token_mean``)."""
    groups: StepGroups | None
    """``None`` with ``off`` until the metrics need them (``off`` resolves nothing per step)."""
    num_microbatches: int = 0
    model: Any = None
    pg_collection: Any = None
    counts: StepCounts | None = None
    masks: list[torch.Tensor] = field(default_factory=list)
    segments: list[tuple[torch.Tensor | None, int | None]] = field(default_factory=list)
    contributions: list[torch.Tensor] = field(default_factory=list)
    local_tokens: list[torch.Tensor] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)
    raw: list[tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    """``off``: each loss tuple's (loss, num_tokens), ``None`` where it was not a tensor."""
    unmasked: int = 0
    """``off``: micro-batches read without a usable loss mask."""
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


def stock_contributions(state: StepState, sizes: tuple[int, int, int]) -> list:
    """``off``: each micro-batch's share of the loss stock Megatron optimizes (None: unknown)."""
    m, d, cp = sizes
    out = []
    for loss, num_tokens in state.raw:
        if loss is None or state.per_token:
            out.append(loss)  # per-token mode: the plain sum, divided by N below
        elif num_tokens is None:  # stock 2-tuple: loss * cp / M, grads / (D * cp)
            out.append(loss / (m * d))
        else:
            out.append(loss / torch.clamp(num_tokens, min=1) / (m * d * cp))
    return out


def _shares(state: StepState, device: torch.device) -> tuple[list, list, list[float], Any]:
    """This rank's loss shares, 3-tuple token counts, what it could not see (``off``), and
    the device the sums go on."""
    if state.reduction != "off":
        return state.contributions, [], [0.0, 0.0, 0.0], device
    groups = state.groups
    shares = stock_contributions(state, (state.num_microbatches, groups.dp_size, groups.cp_size))
    known = [c.double() for c in shares if c is not None]
    tuple_tokens = [n for _, n in state.raw if n is not None]
    # What this rank could not see; summed over DP x CP so that every rank decides alike.
    unseen = [
        float(len(known) < len(shares)),
        float(len(tuple_tokens) < len(state.raw)),
        float(state.unmasked > 0 or not state.masks),
    ]
    return known, tuple_tokens, unseen, known[0].device if known else device


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


def _step_counts(state: StepState, config: LossFixConfig) -> StepCounts | None:
    """The step's counts; ``off`` counted nothing before the step (it communicates nothing),
    so it counts now."""
    if state.counts is not None:
        return state.counts
    groups = state.groups
    return count_tokens(
        state.masks,
        dp_group=groups.dp,
        cp_group=groups.cp if config.data_is_cp_sharded else None,
        segment_ids=[seg for seg, _ in state.segments],
        num_segments=[num for _, num in state.segments],
    )


def _local_metrics(state: StepState, config: LossFixConfig) -> dict:
    groups = state.groups
    stats = scalar_stats(state.reports)
    sums = sorted(k for k in stats if k.endswith(("_sum", "_count")))
    device = state.masks[0].device if state.masks else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    known, tuple_tokens, unseen, device = _shares(state, device)
    loss = torch.stack(known).double().sum() if known else zero.to(device)
    tokens = (
        torch.stack([n.double().sum().to(device) for n in tuple_tokens]).sum()
        if tuple_tokens
        else zero.to(device)
    )
    # Each MTP layer's share of the loss, sum(w_j * l_j) (plugin modes, loss stage).
    mtp = state.mtp.contributions if state.mtp is not None else []
    sum_vec = torch.stack(
        [
            loss,
            tokens,
            *(torch.tensor(u, dtype=torch.float64, device=device) for u in unseen),
            *(torch.stack(stats[k]).sum().to(device) for k in sums),
            *(torch.stack(c).double().sum().to(device) if c else zero.to(device) for c in mtp),
        ]
    )
    if dist.is_initialized() and groups.dp_cp is not None:
        dist.all_reduce(sum_vec, group=groups.dp_cp)
    no_loss, no_tuple_tokens, no_masks = (bool(v > 0) for v in sum_vec[2:5].tolist())
    out: dict[str, Any] = {k: sum_vec[5 + i] for i, k in enumerate(sums)}
    out.update({f"mtp_loss_{j + 1}": sum_vec[5 + len(sums) + j] for j in range(len(mtp))})
    counts = None if state.counts is None and no_masks else _step_counts(state, config)
    num_tokens = None
    if counts is not None:
        num_tokens = counts.num_tokens
        out["num_sequences"] = counts.num_sequences
    elif not no_tuple_tokens and state.raw:
        num_tokens = sum_vec[1]  # each CP rank's 3-tuple counts its own shard
    if num_tokens is not None:
        out["num_tokens"] = num_tokens
    if not no_loss:
        out["loss"] = sum_vec[0]
        if state.passthrough and state.per_token:
            # Megatron's per-token mode divides the summed loss by the global token count.
            if num_tokens is None:
                del out["loss"]
            else:
                out["loss"] = sum_vec[0] / num_tokens.clamp(min=1)
    _reduce_extremes(stats, groups, out)
    return {k: float(v) for k, v in out.items()}


def reduce_step_metrics(state: StepState | None, config: LossFixConfig) -> dict[str, float]:
    """Global metrics of the last step, returned on every rank of the pipeline group."""
    if state is None:
        raise ValueError("no step has run yet: call the schedule before asking for its metrics")
    if state.groups is None:
        # ``off`` resolved nothing during the step (stock needs nothing of the plugin).
        state.groups = resolve_groups(state.pg_collection)
    if state.per_token is None:
        from megatron.core.utils import get_model_config

        chunks = state.model if isinstance(state.model, list) else [state.model]
        config_of_model = get_model_config(chunks[0])
        state.per_token = bool(getattr(config_of_model, "calculate_per_token_loss", False))
    groups = state.groups
    metrics = _local_metrics(state, config) if groups.is_last_stage else None
    if groups.pp is not None and dist.get_world_size(groups.pp) > 1:
        box = [metrics]
        last = dist.get_global_rank(groups.pp, dist.get_world_size(groups.pp) - 1)
        dist.broadcast_object_list(box, src=last, group=groups.pp)
        metrics = box[0]
    return metrics
