"""The step's agreement before Megatron's schedule, with the step's counts riding in it.

Every rank of the step agrees that it can run (:mod:`megatron_lossfix.step.agreement`); the same
all-reduce carries the loss stage's token, sequence and pair counts ``[N, S, P]`` (of the masks,
then of each MTP layer's shifted masks; P is 0 but for ``pair_mean``) and, for the modes over
global group ids, the ids' range. What it
returns is the step's global counts, each MTP layer's, and whether the weights are over group
ids; nothing is posted anywhere.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import megatron_lossfix.runtime.prompt_groups as prompt_groups
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mode_record import Ids
from megatron_lossfix.runtime.process_groups import StepGroups, same_on_every_rank
from megatron_lossfix.runtime.prompt_groups import GroupIds
from megatron_lossfix.runtime.weights import (
    StepCounts,
    any_bad_mask_value,
    bad_mask_message,
    bad_mask_values,
    local_pairs,
)
from megatron_lossfix.step.agreement import (
    REFUSAL_PREFIX,
    Agreement,
    Problem,
    StepRefused,
    StepSettings,
    agree,
)
from megatron_lossfix.step.record import StepData

__all__ = ["AgreedCounts", "agree_counts"]


@dataclasses.dataclass(frozen=True, slots=True)
class AgreedCounts:
    """What the first agreement returns."""

    counts: StepCounts | None
    """The step's global counts (loss stage; None elsewhere)."""
    mtp: list[StepCounts]
    """Each MTP layer's global counts (loss stage; empty elsewhere)."""
    grouped: bool
    """Whether the weights are over group ids, as every rank of the step agreed."""


def agree_counts(
    config: LossFixConfig,
    groups: StepGroups,
    per_token: bool,
    problem: StepRefused | None,
    data: StepData,
    mtp_masks: list[list[torch.Tensor]],
) -> AgreedCounts:
    """Count the step's tokens and agree, on every rank of the step, that it can run; raises
    on every rank of a refused step (``problem``: this rank's, found before).

    The counts ``[N, S, P]`` of the masks, then of each MTP layer's shifted masks, ride in
    the agreement, summed over DP x CP (CP ranks hold the same whole sequences: the sums
    are divided by the CP size). CP-sharded masks need their per-sequence counts summed
    over CP first, an all-reduce of a size only the ranks that could read their data know:
    they are counted after the verdict.
    """
    settings = StepSettings(config.reduction, per_token)
    mask_sets = [data.masks, *mtp_masks]
    # The last two counts are the ids' range and its square, for modes that weight by group
    # ids: every rank must bring the same (or none, a sequence mode without trajectory ids).
    # Every mode sends them (zeros where unused), so that ranks disagreeing on the mode still
    # all-reduce records of one size and hear of it in the verdict.
    kind = prompt_groups.ids_for_mode(config.reduction)
    ranged = kind is not None and Ids(kind).step_wide  # pair ids have no range to agree on
    num_counts = _PER_SET * len(mask_sets) + 2
    mine = Agreement.of_rank(settings, problem, num_counts=num_counts)
    sharded_cp = config.data_is_cp_sharded and groups.cp_size > 1
    checks: dict[str, torch.Tensor] = {}
    local: list[StepCounts] = []
    if groups.is_last_stage and problem is None:
        if config.validate:
            checks["masks"] = any_bad_mask_value(data.masks)  # which one: asked when refused
            mine.report(Problem.MASK_VALUES, checks["masks"])
        if not sharded_cp:
            local = [data.counts(masks, global_counts=False) for masks in mask_sets]
            totals = [n for c in local for n in _set_counts(c, data.group_ids)]
            mine.counts[: _PER_SET * len(mask_sets)].copy_(torch.stack(totals))
        if data.group_ids is not None:
            checks.update(_check_ids(data, local))
            mine.report(Problem.GROUP_IDS, checks["ids"].any() | checks["tails"].any())
            if ranged:  # filled on the device: no copy from the host
                count = float(data.group_ids.count)
                mine.counts[-2], mine.counts[-1] = count, count * count

    def late() -> StepRefused | None:  # asked only when the step is refused
        return _late_problem(checks, data)

    agreed = agree(mine, groups)
    sums = agreed.verdict(groups.pp_size, problem, settings, late=late)
    grouped = kind is not None and Ids(kind).needed  # else: whether trajectory ids came
    if ranged:
        _agree_on_id_range(sums[-2:], groups, data.group_ids)
        grouped = sums[-2] > 0
    if not groups.is_last_stage:
        return AgreedCounts(None, [], grouped)
    ids = data.group_ids
    if sharded_cp:
        counts = data.counts(data.masks, dp_group=groups.dp, cp_group=groups.cp, groups=ids)
        return AgreedCounts(counts, [], grouped)
    totals = agreed.counts.to(data.masks[0].device) / float(groups.cp_size)
    pairs = ids is not None and ids.ranges is not None
    per_group = _group_tokens(local, None if pairs else ids, groups)
    counts = [
        dataclasses.replace(
            c,
            num_tokens=totals[_PER_SET * j],
            num_sequences=totals[_PER_SET * j + 1],
            num_pairs=totals[_PER_SET * j + 2] if pairs else None,
            dp_size=groups.dp_size,
            group_tokens=per_group[j],
            group_ids=None if ids is None else ids.ids,
        )
        for j, c in enumerate(local)
    ]
    return AgreedCounts(counts[0], counts[1:], grouped)


#: Counts per mask set in the agreement: N, S and P (pairs; 0 in the other modes).
_PER_SET = 3


def _set_counts(counts: StepCounts, ids: GroupIds | None) -> tuple[torch.Tensor, ...]:
    """``(N, S, P)`` of one mask set on this rank (P: its pairs with a loss token, 0 without
    pair ids)."""
    if ids is None or ids.ranges is None:
        return counts.num_tokens, counts.num_sequences, torch.zeros_like(counts.num_tokens)
    return counts.num_tokens, counts.num_sequences, local_pairs(counts.seq_tokens, ids.ids)


def _check_ids(data: StepData, local: list[StepCounts]) -> dict[str, torch.Tensor]:
    """On the device, per micro-batch: ids out of range, and packed rows with loss tokens after
    their last ``cu_seqlens`` boundary (which no id covers)."""
    ids = data.group_ids
    device = ids.ids[0].device
    no = torch.zeros((), dtype=torch.bool, device=device)
    tails = [
        (local[0].seq_tokens[k][-1] > 0).to(device) if local and seg is not None else no
        for k, (seg, _) in enumerate(data.segments)
    ]
    return {"ids": prompt_groups.bad_id_values(ids), "tails": torch.stack(tails)}


def _late_problem(checks: dict[str, torch.Tensor], data: StepData) -> StepRefused | None:
    """This rank's problem found on the device, named (read only when the step is refused)."""
    if "masks" in checks and bool(checks["masks"]):
        first = int(bad_mask_values(data.masks).nonzero()[0, 0])
        return Problem.MASK_VALUES.refusal(bad_mask_message(first))
    if "ids" in checks and bool(checks["ids"].any()):
        first = int(checks["ids"].nonzero()[0, 0])
        return Problem.GROUP_IDS.refusal(prompt_groups.bad_id_message(data.group_ids, first))
    if "tails" in checks and bool(checks["tails"].any()):
        first = int(checks["tails"].nonzero()[0, 0])
        return Problem.GROUP_IDS.refusal(
            f"micro-batch {first} is packed and has loss tokens after its last cu_seqlens "
            f"boundary, which no {data.group_ids.name} covers"
        )
    return None


def _agree_on_id_range(sums: list[float], groups: StepGroups, ids: GroupIds | None) -> None:
    """Refuse the step on every rank (all read the same sums) when the loss stage's DP x CP
    ranks brought different id ranges: the per-group counts are a vector of that size."""
    total, squares = sums
    if not same_on_every_rank(total, squares, groups.dp_cp_size):
        mine = "none" if ids is None else f"{ids.name} in [0, {ids.count})"
        raise StepRefused(
            f"{REFUSAL_PREFIX}data- or context-parallel ranks disagree on the group ids' range "
            f"(num_groups or num_trajectories; this rank: {mine}); give every micro-batch of "
            "the step the same range, and every rank its ids",
            Problem.GROUP_IDS,
        )


def _group_tokens(
    local: list[StepCounts], ids: GroupIds | None, groups: StepGroups
) -> list[torch.Tensor | None]:
    """Each mask set's loss tokens per group, global: one all-reduce over DP x CP of one
    vector (the groups' range per mask set), after the verdict checked the ids."""
    if ids is None:
        return [None] * len(local)
    per_group = torch.cat([prompt_groups.group_tokens(c.seq_tokens, ids) for c in local])
    if groups.dp_cp_size > 1:
        dist.all_reduce(per_group, group=groups.dp_cp)
    # CP ranks hold the same whole sequences.
    return list(torch.split(per_group / float(groups.cp_size), ids.count))
