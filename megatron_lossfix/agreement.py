"""The step's agreement: why a rank refuses a step, and how every rank of the step hears of it.

A plugin step is refused on every rank of the step, never on one alone (which would leave its
peers blocked in Megatron's point-to-point or gradient communication). Each rank puts what it
found into one small float64 vector (:func:`agreement_vector`: the step's counts, a fingerprint
of the settings, and one slot per kind of problem); the schedule all-reduces it over the loss
stage's data x context-parallel group and the pipeline group, and :func:`verdict` raises
:class:`StepRefused` on every rank when any rank reported a problem. The settings that are the
same on every rank are refused here before any collective (:func:`refuse_hybrid_cp`,
:func:`refuse_sharded_mtp`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.config import MODES, LossFixConfig
from megatron_lossfix.megatron_compat import StepGroups, group_size
from megatron_lossfix.metrics import StepState
from megatron_lossfix.reduction import (
    StepCounts,
    bad_mask_message,
    bad_mask_values,
    count_tokens,
)

__all__ = [
    "KINDS",
    "VECTOR_LEN",
    "LocalProblem",
    "ProblemOnAnotherRank",
    "StepRefused",
    "agree",
    "agree_after",
    "agreement_vector",
    "default_device",
    "refuse_hybrid_cp",
    "refuse_sharded_mtp",
    "unreduced_gradients",
    "verdict",
]


class StepRefused(ValueError):
    """Raised on every rank of a step the plugin refused (see the message for why).

    On the rank whose data caused it the message says exactly what is wrong; on its peers (the
    other data- and context-parallel ranks and the other pipeline stages) it names that rank and
    the kind of problem."""


class ProblemOnAnotherRank(StepRefused):
    """Raised on the ranks whose own data was fine when another rank of the step refused."""


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------- the step's agreement
# What a rank can report, one slot each in the agreement vector (several ranks may report).
KINDS: tuple[str, ...] = (
    "the loss stage has no data iterator",
    "the loss stage's data iterator could not be read",
    "the loss stage's data iterator ran out before num_microbatches",
    "a micro-batch is not a dict holding the loss mask",
    "a loss mask is malformed",
    "a loss mask holds values other than 0 and 1",
    "an error while preparing the step",
    "ranks disagree on the loss reduction or calculate_per_token_loss",
    "the loss function failed or returned what the plugin cannot use",
    "the multi-token prediction loss could not be normalized",
    "the model's gradients are not reduced across data-parallel ranks",
)
(
    NO_ITERATOR, UNREADABLE, RAN_OUT, NOT_DICT, MALFORMED, MASK_VALUES, OTHER, DISAGREE,
    LOSS_FUNC, MTP_PROBLEM, UNREDUCED,
) = range(len(KINDS))  # fmt: skip
# Agreement vector: [N, S, fingerprint, fingerprint**2, ranks with a problem, sum of their
# (global rank + 1), one count per kind], then N and S of each MTP layer's shifted masks.
# float64: exact for counts below 2**53.
SLOT_N, SLOT_S, SLOT_FP, SLOT_FP2, SLOT_PROBLEMS, SLOT_RANK_SUM, SLOT_KIND0 = range(7)
VECTOR_LEN = SLOT_KIND0 + len(KINDS)
REFUSAL_PREFIX = "megatron_lossfix refused this step: "


def refuse_hybrid_cp(chunk: Any) -> None:
    """Megatron 0.19's hybrid context parallelism calls forward_step once per sub-sample, so
    neither the pre-pass (one batch per micro-batch) nor the x num_microbatches compensation
    holds there. The setting is the same on every rank: each raises here, before any
    collective."""
    try:
        from megatron.core.utils import get_model_config

        config = get_model_config(chunk)
    except Exception:  # noqa: BLE001 - no config to read: not hybrid CP
        return
    if getattr(config, "hybrid_context_parallel", False):
        raise StepRefused(
            f"{REFUSAL_PREFIX}hybrid context parallelism (hybrid_context_parallel=True) runs "
            "forward_step once per sub-sample, which the plugin's modes do not cover; use "
            "--loss-reduction off with calculate_per_token_loss=True there (Megatron's own "
            "per-token mode is the exact token mean)"
        )


def unreduced_gradients(chunks: list, model_config: Any, groups: StepGroups) -> str | None:
    """Why the gradients of this step would not be reduced across data-parallel (and
    context-parallel) ranks, or None: the structural guard of every plugin step.

    With DP x CP > 1 the plugin's weights normalize over the whole mini-batch, so each rank's
    gradient is only its share: Megatron DDP (or FSDP) must hold the gradients in its buffers
    and ``config.finalize_model_grads_func`` must sum them at the end of the step (Megatron-LM
    and Megatron Bridge always set both). Without them every rank trains on its own share, the
    loss still looks right and nothing fails. Configuration only, no collective: the verdict
    rides in the step's agreement (kind ``UNREDUCED``)."""
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


def refuse_sharded_mtp(mtp_layers: int, config: LossFixConfig) -> None:
    """MTP layers read the loss mask of later positions, which CP shards from the data
    iterator do not hold; the setting is the same on every rank: each raises, before any
    collective."""
    if mtp_layers and config.data_is_cp_sharded:
        raise StepRefused(
            f"{REFUSAL_PREFIX}multi-token prediction (mtp_num_layers={mtp_layers}) needs whole "
            "sequences from the data iterator (data_is_cp_sharded=False): slice them for "
            "context parallelism in forward_step"
        )


def agreement_vector(
    problem: LocalProblem | None, rank: int, device: torch.device, mtp_layers: int = 0
) -> torch.Tensor:
    """A zero agreement vector carrying this rank's problem, if any (plus two slots for the
    counts of each MTP layer)."""
    vec = torch.zeros(VECTOR_LEN + 2 * mtp_layers, dtype=torch.float64, device=device)
    if problem is not None:
        vec[SLOT_PROBLEMS], vec[SLOT_RANK_SUM] = 1.0, rank + 1.0
        vec[SLOT_KIND0 + problem.kind] = 1.0
    return vec


class LocalProblem(Exception):
    """This rank's reason to refuse the step (raised and caught inside the plugin)."""

    def __init__(self, kind: int, message: str):
        super().__init__(message)
        self.kind = kind


def verdict(
    values: list[float],
    groups: StepGroups,
    reduction: str,
    per_token: bool,
    problem: LocalProblem | None,
    bad: torch.Tensor | None,
) -> None:
    """Raise on this rank if any rank of the step refused it (``values``: the reduced
    agreement vector, on the host)."""
    stages_differ = values[SLOT_FP] ** 2 != groups.pp_size * values[SLOT_FP2]
    if stages_differ or values[SLOT_KIND0 + DISAGREE] > 0:
        where = "pipeline stages" if stages_differ else "data- or context-parallel ranks"
        raise StepRefused(
            f"{REFUSAL_PREFIX}{where} disagree on the loss reduction or calculate_per_token_loss "
            f"(this rank: {reduction!r}, per-token={per_token}); give every "
            "rank the same --loss-reduction"
        )
    if values[SLOT_PROBLEMS] <= 0:
        return
    if problem is not None:
        raise StepRefused(f"{REFUSAL_PREFIX}{problem}") from problem.__cause__
    if bad is not None and bool(bad.any()):
        raise StepRefused(REFUSAL_PREFIX + bad_mask_message(int(bad.nonzero()[0, 0])))
    kinds = [KINDS[i] for i in range(len(KINDS)) if values[SLOT_KIND0 + i] > 0]
    count = int(values[SLOT_PROBLEMS])
    who = f"global rank {int(values[SLOT_RANK_SUM]) - 1}" if count == 1 else f"{count} ranks"
    raise ProblemOnAnotherRank(
        f"{REFUSAL_PREFIX}{'; '.join(kinds)} (reported by {who}; see its error for the details); "
        "every rank of the step stops"
    )


# ---------------------------------------------------------------------- the two agreements
def fingerprint(reduction: str, per_token: bool) -> float:
    """A small integer that differs between any two (reduction, per-token) settings."""
    return float(1 + 2 * MODES.index(reduction) + int(per_token))


def reduce_over(vec: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``vec`` summed over ``group`` in place (nothing is sent for a group of one)."""
    if group_size(group) > 1:
        dist.all_reduce(vec, group=group)
    return vec


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _count(
    masks: list[torch.Tensor], segments: list, cp_group: dist.ProcessGroup | None
) -> StepCounts:
    """This rank's counts (over its CP shards when ``cp_group`` is given), not over DP."""
    return count_tokens(
        masks,
        global_counts=False,
        cp_group=cp_group,
        segment_ids=[seg for seg, _ in segments],
        num_segments=[num for _, num in segments],
    )


def _flag_bad_masks(masks: list[torch.Tensor], vec: torch.Tensor, rank: int) -> torch.Tensor:
    """Report masks holding values other than 0 and 1 in ``vec``; the flags, per micro-batch."""
    bad = bad_mask_values(masks)
    flagged = bad.any().to(device=vec.device, dtype=torch.float64)
    vec[SLOT_PROBLEMS] += flagged
    vec[SLOT_RANK_SUM] += flagged * (rank + 1)
    vec[SLOT_KIND0 + MASK_VALUES] += flagged
    return bad


def _put_local_counts(
    state: StepState, mtp_masks: list[list[torch.Tensor]], vec: torch.Tensor
) -> tuple[StepCounts, list[StepCounts]]:
    """This rank's counts of the main masks and each MTP layer's, written into ``vec``."""
    local = _count(state.masks, state.segments, None)
    vec[SLOT_N], vec[SLOT_S] = local.num_tokens, local.num_sequences
    mtp_local = [_count(m, state.segments, None) for m in mtp_masks]
    for j, layer in enumerate(mtp_local):
        vec[VECTOR_LEN + 2 * j] = layer.num_tokens
        vec[VECTOR_LEN + 2 * j + 1] = layer.num_sequences
    return local, mtp_local


def _flag_disagreement(vec: torch.Tensor, groups: StepGroups, fp: float) -> None:
    """Disagreement inside DP x CP becomes a problem that every stage hears of; the
    fingerprint slots are reset for the pipeline's own comparison."""
    n = float(groups.dp_cp_size)
    disagree = (vec[SLOT_FP] * vec[SLOT_FP] != n * vec[SLOT_FP2]).to(vec.dtype)
    vec[SLOT_KIND0 + DISAGREE] += disagree
    vec[SLOT_PROBLEMS] += disagree
    vec[SLOT_FP], vec[SLOT_FP2] = fp, fp * fp


def _put_sharded_counts(state: StepState, vec: torch.Tensor) -> StepCounts:
    """CP-sharded data: count over the CP group, then sum over DP, into ``vec``."""
    groups = state.groups
    local = _count(state.masks, state.segments, groups.cp)
    totals = torch.stack([local.num_tokens, local.num_sequences])
    totals = reduce_over(totals.to(vec.device), groups.dp)
    vec[SLOT_N], vec[SLOT_S] = totals[0] * groups.cp_size, totals[1] * groups.cp_size
    return local


def _global_counts(vec: torch.Tensor, at: int, local: StepCounts, state: StepState) -> StepCounts:
    """The step's counts from the reduced vector (slots ``at``, ``at + 1``)."""
    # Every CP rank holds the same sequences (whole, or after the CP sum of shards).
    replicas = float(state.groups.cp_size)
    device = state.masks[0].device
    return StepCounts(
        num_tokens=(vec[at] / replicas).to(device),
        num_sequences=(vec[at + 1] / replicas).to(device),
        seq_tokens=local.seq_tokens,
        mb_tokens=local.mb_tokens,
        dp_size=state.groups.dp_size,
    )


def agree(
    config: LossFixConfig,
    state: StepState,
    problem: LocalProblem | None,
    mtp_masks: list[list[torch.Tensor]],
    mtp_layers: int,
) -> list[StepCounts]:
    """Count the step's tokens and agree, on every rank of the step, that it can run.

    The loss stage sums ``[N, S, fp, fp**2, problems...]`` over its data x context-parallel
    group (the counts' own all-reduce: CP ranks hold the same sequences, so N and S are
    divided by the CP size); with pipeline parallelism every stage then sums the verdict
    over the pipeline group. All fingerprints are equal exactly when
    ``sum(fp)**2 == n * sum(fp**2)``. One device sync, after the last collective.

    Fills ``state.counts`` on the loss stage (``state.masks`` and ``state.segments`` are this
    rank's) and returns the counts of each MTP layer's shifted masks (``mtp_masks``; empty
    elsewhere), which ride in the same all-reduce; raises on every rank when any refused.
    """
    groups = state.groups
    # On the accelerator whatever device the masks are on: NCCL reduces CUDA tensors only,
    # and every stage must bring the same kind of tensor to the pipeline all-reduce.
    fp = fingerprint(config.reduction, state.per_token)
    rank = _rank()
    vec = agreement_vector(problem, rank, default_device(), mtp_layers)
    vec[SLOT_FP], vec[SLOT_FP2] = fp, fp * fp
    local = bad = None
    mtp_local: list[StepCounts] = []
    # CP shards are counted with one more all-reduce over CP, of a size only healthy ranks
    # know: with sharded data the checks go first (one extra collective in this layout).
    sharded_cp = config.data_is_cp_sharded and groups.cp_size > 1
    if groups.is_last_stage:
        if problem is None:
            if config.validate:
                bad = _flag_bad_masks(state.masks, vec, rank)
            if not sharded_cp:
                local, mtp_local = _put_local_counts(state, mtp_masks, vec)
        vec = reduce_over(vec, groups.dp_cp)
        _flag_disagreement(vec, groups, fp)
        if sharded_cp and problem is None and vec[SLOT_PROBLEMS].item() == 0:
            local = _put_sharded_counts(state, vec)
    if groups.pp_size > 1:
        vec = reduce_over(vec, groups.pp)
    verdict(vec.tolist(), groups, config.reduction, state.per_token, problem, bad)
    if local is None:
        return []
    state.counts = _global_counts(vec, SLOT_N, local, state)
    return [_global_counts(vec, VECTOR_LEN + 2 * j, c, state) for j, c in enumerate(mtp_local)]


def agree_after(state: StepState) -> None:
    """Refuse the step on every rank if the loss stage hit an error inside the schedule.

    Such an error (a loss function that raised or returned no one-element tensor, a
    forward step that never read its micro-batch, a non-finite loss under check_finite)
    does not stop the loss stage: it hands Megatron a zero loss and lets the schedule end,
    so no peer is left in point-to-point or in DDP's all-reduce. Then this one small
    all-reduce over DP x CP (loss stage) and, with pipelining, over the pipeline group tells
    every rank; the step's gradients are not to be used. A single-rank step needs none.
    """
    groups, problem = state.groups, state.problem
    if problem is None and groups.dp_cp_size <= 1 and groups.pp_size <= 1:
        return  # nobody to tell, nothing to tell: no device sync
    vec = agreement_vector(problem, _rank(), default_device())
    if groups.is_last_stage:
        vec = reduce_over(vec, groups.dp_cp)
    vec = reduce_over(vec, groups.pp)
    values = vec.tolist()  # fingerprints stay 0: no disagreement to find here
    if values[SLOT_PROBLEMS] > 0:
        verdict(values, groups, state.reduction, bool(state.per_token), problem, None)
