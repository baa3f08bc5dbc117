"""The step's agreements after a pass over the micro-batches, and what a ``DEFERRED`` step does
once its kept counts are known.

After Megatron's schedule (and after a counting pass) every rank learns whether the loss stage
hit an error inside the schedule or a malformed kept mask, and the step is refused on every
rank at once; the same all-reduce carries the counts of the masks the loss decided
(:mod:`megatron_lossfix.runtime.mask_in_loss`), by which a ``DEFERRED`` step scales its gradients
once. Each function takes this rank's problem as an argument and returns what it learned.
"""

from __future__ import annotations

import megatron_lossfix.step.megatron_compat as megatron_compat
import megatron_lossfix.step.wrappers as wrappers
from megatron_lossfix.runtime.mask_in_loss import NUM_COUNTS as KEPT_COUNTS
from megatron_lossfix.runtime.mask_in_loss import KeptCounts, Phase, deferred_scale
from megatron_lossfix.step.agreement import REFUSAL_PREFIX, Agreement, Problem, StepRefused, agree
from megatron_lossfix.step.record import StepRecord

__all__ = ["after_schedule", "agree_kept"]


def after_schedule(
    record: StepRecord, chunks: list, forward_only: bool, problem: StepRefused | None
) -> tuple[KeptCounts | None, float]:
    """Refuse the step on every rank if the loss stage hit an error inside the schedule
    (``problem``) or a malformed kept mask; learn the kept counts and, in a ``DEFERRED`` step,
    scale the gradients by the mode's global factor (not in a forward-only call: it made
    none): one small agreement over DP x CP (loss stage) and the pipeline group; none on a
    single rank without an error or a kept mask. Returns the kept counts (None: none agreed
    here) and the loss scale (``StepRecord.loss_scale``)."""
    groups, kept = record.groups, record.kept
    used = kept is not None and any(kept.called)
    if problem is None and not used and groups.dp_cp_size <= 1 and groups.pp_size <= 1:
        return None, record.loss_scale
    counts = agree_kept(record, problem, counted=False)
    loss_scale = record.loss_scale
    if record.phase is Phase.DEFERRED and counts is not None:
        grad_scale, loss_scale = deferred_scale(record.config.reduction, record.per_token, counts)
        if grad_scale != 1.0 and not forward_only:
            _scale_gradients(record, chunks, grad_scale)
    return counts, loss_scale


def _scale_gradients(record: StepRecord, chunks: list, factor: float) -> None:
    """The deferred scale, through the wrappers' ``scale_gradients``; until every rank has seen
    it change the gradient, each checks a sample and the worst verdict is every rank's."""
    check = wrappers.unseen(chunks)
    verdict = wrappers.scale_gradients(chunks, factor)
    if not check:
        return
    tp = megatron_compat.model_parallel_groups(record.pg_collection).tp
    groups = [record.groups.dp_cp, record.groups.pp, tp]
    problem = wrappers.agree_scale_seen(chunks, verdict, groups)
    if problem is not None:
        raise StepRefused(f"{REFUSAL_PREFIX}{problem}", Problem.WRAPPER)


def agree_kept(
    record: StepRecord, problem: StepRefused | None, *, counted: bool
) -> KeptCounts | None:
    """The agreement after a pass over the micro-batches: this rank's ``problem``, its kept
    masks' flags and counts (loss stage) summed over DP x CP and the pipeline group; raises
    on every rank of a refused step. Returns the kept counts (None when no loss said what it
    kept). ``counted``: after the counting pass, which also hands the real pass its weights."""
    groups, kept = record.groups, record.kept
    mine = Agreement.of_rank(None, problem, num_counts=KEPT_COUNTS)
    if kept is not None:
        # Sequences split over CP ranks are counted whole where the normalization needs S.
        kept.whole_counts(communicate=record.config.mask_in_loss)
        counts, flags = kept.local(mine.counts.device)
        mine.counts.copy_(counts)
        mine.report(Problem.KEPT_MASK, (flags.amax() > 0).double())

    def late() -> StepRefused | None:  # asked only when the step is refused
        if kept is None or not any(f is not None and bool(f.amax() > 0) for f in kept.flags):
            return None
        return Problem.KEPT_MASK.refusal(kept.flag_message())

    agreed = agree(mine, groups)
    calls, tokens, seqs = agreed.verdict(groups.pp_size, problem, late=late)
    if calls <= 0:
        return None
    whole = seqs >= 0
    kept_counts = KeptCounts(
        calls=calls, num_tokens=tokens, num_sequences=seqs / groups.cp_size if whole else None
    )
    if counted and kept is not None:
        num_tokens = agreed.counts[1].to(kept.device)
        num_sequences = (agreed.counts[2] / groups.cp_size).to(kept.device)
        step_counts = kept.counts_of_pass(num_tokens, num_sequences)
        kept.counted(step_counts, record.config.reduction, record.config.norm_constant)
    return kept_counts
