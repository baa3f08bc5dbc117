"""Masks decided inside the loss, on one process: ``kept_weights`` in each phase of a step
against a plain-PyTorch reference (the mode's weights of the kept masks, ``loss_weights``),
and the checks of a kept mask (docs/design.md §10)."""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix import LossFixConfig, loss_weights, weighted_loss
from megatron_lossfix.runtime.losses import weighted_sum
from megatron_lossfix.runtime.mask_in_loss import (
    KeptCounts,
    KeptStep,
    Phase,
    deferred_scale,
    kept_weights,
    phase_for,
    weighted_stats,
)
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.prompt_groups import GroupIds
from megatron_lossfix.runtime.weights import REDUCTIONS, float_masks

pytestmark = pytest.mark.unit

NORM = 5.0


def _norm(mode):
    return NORM if mode_of(mode).uses_constant else None


def _data(seed, shapes=((3, 7), (1, 7), (4, 7))):
    """Per micro-batch: loss masks with empty rows, kept masks inside them, per-token losses."""
    gen = torch.Generator().manual_seed(seed)
    masks = [(torch.rand(s, generator=gen) < 0.6).float() for s in shapes]
    masks[0][1] = 0  # an empty sequence
    keeps = [(torch.rand(m.shape, generator=gen) < 0.7) & m.bool() for m in masks]
    keeps[0][0] = False  # a sequence whose every token is dropped
    losses = [torch.randn(s, generator=gen) for s in shapes]
    return masks, keeps, losses


#: Ids of ``_data``'s sequences (rows 3, 1, 4), global over the step: group 1 straddles two
#: micro-batches; ``_grouped_data`` drops group 3 whole.
IDS = [torch.tensor([0, 0, 1]), torch.tensor([1]), torch.tensor([2, 2, 3, 3])]
#: The cases whose weights are over ids: ``group_mean``'s prompt groups, and the sequence modes
#: over trajectories. (case id, mode, loss_weights' keyword arguments)
GROUPED = [
    ("group_mean", "group_mean", {"group_ids": IDS, "num_groups": 4}),
    ("sequence_mean-trajectories", "sequence_mean", {"trajectory_ids": IDS, "num_trajectories": 4}),
    (
        "seq_mean_token_sum_norm-trajectories",
        "seq_mean_token_sum_norm",
        {"trajectory_ids": IDS, "num_trajectories": 4},
    ),
]
#: Pair ids of ``_data``'s sequences, each micro-batch's own (``pair_mean``): a pair of rows,
#: a lone row, two pairs.
PAIR_IDS = [torch.tensor([0, 1, 0]), torch.tensor([0]), torch.tensor([0, 1, 1, 0])]
GROUPED.append(("pair_mean", "pair_mean", {"pair_ids": PAIR_IDS}))
UNGROUPED = [(mode, mode, {}) for mode in REDUCTIONS if not mode_of(mode).ids.needed]


def _ids(kwargs: dict, masks: list) -> GroupIds | None:
    """The ``GroupIds`` a step holds for ``loss_weights``' keyword arguments."""
    if "pair_ids" in kwargs:
        rows = tuple(m.shape[0] for m in masks)
        return GroupIds(ids=kwargs["pair_ids"], count=max(rows), name="pair_ids", ranges=rows)
    ids = kwargs.get("group_ids", kwargs.get("trajectory_ids"))
    return None if ids is None else GroupIds(ids=ids, count=4)


def _step(mode, phase, masks, segment_ids=None, ids=None):
    return KeptStep(
        mode=mode,
        phase=phase,
        rows=[m.shape[0] for m in masks],
        device=torch.device("cpu"),
        dp_size=1,
        cp_group=None,
        norm_constant=_norm(mode),
        segment_ids=segment_ids,
        group_ids=ids,
    )


def _loss_in_step(step, weights, keeps, losses):
    """What the step computes: each micro-batch's sum(kept_weights * l) inside the loss."""
    total = 0.0
    for k, (w, keep, loss) in enumerate(zip(weights, keeps, losses, strict=True)):
        with step.active(k):
            total += float(weighted_sum(loss, kept_weights(w, keep)))
        step.finish(k)
    return total


def _agreed(step):
    step.whole_counts()  # one rank: nothing to sum over CP
    counts, flags = step.local(torch.device("cpu"))
    calls, tokens, seqs = counts.tolist()
    return KeptCounts(calls=calls, num_tokens=tokens, num_sequences=seqs), flags


def _grouped_data(seed):
    """``_data`` with group 3 (the last two rows) dropped whole by the kept masks: it leaves G
    (as group 0 does, one row dropped and one empty)."""
    masks, keeps, losses = _data(seed)
    masks[2][2:, :2] = 1  # group 3 has loss tokens ...
    keeps[2][2:] = False  # ... and keeps none
    return masks, keeps, losses


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "mode, kwargs", [c[1:] for c in UNGROUPED + GROUPED], ids=[c[0] for c in UNGROUPED + GROUPED]
)
def test_excluded_tokens_leave_the_counts(mode, kwargs, seed):
    """mask_in_loss: the step's loss is the mode's normalization of the kept tokens alone,
    whether the weights are final in the loss (LOCAL), wait for their global factor
    (DEFERRED) or come from a counting pass (COUNT, then REPLAY). Weights over group ids
    always count first, and a group whose every token is dropped leaves G."""
    masks, keeps, losses = _grouped_data(seed)
    norm = _norm(mode)
    kept_masks = [m * k for m, k in zip(masks, keeps, strict=True)]
    kept_weights_ = loss_weights(kept_masks, mode, norm_constant=norm, **kwargs)
    want = sum(float((w * x).sum()) for w, x in zip(kept_weights_, losses, strict=True))
    weights = loss_weights(masks, mode, norm_constant=norm, **kwargs)  # what the step hands over
    grouped = bool(kwargs)
    ids = _ids(kwargs, masks)
    # Zeroed and still counted gives another loss (sum has no count): the check can fail.
    zeroed = sum(float((w * k * x).sum()) for w, k, x in zip(weights, keeps, losses, strict=True))
    assert (zeroed == pytest.approx(want, rel=1e-3)) == (mode == "sum")
    for counting in (False, True):
        phase = phase_for(mode, True, counting, False, grouped)
        assert phase is Phase.COUNT or not grouped
        step = _step(mode, phase, masks, ids=ids if grouped else None)
        got = _loss_in_step(step, weights, keeps, losses)
        counts, flags = _agreed(step)
        assert counts.num_tokens == sum(float(m.sum()) for m in kept_masks)
        assert counts.num_sequences == sum(int((m.sum(1) > 0).sum()) for m in kept_masks)
        assert not flags.any()
        if phase is Phase.DEFERRED:
            got *= deferred_scale(mode, False, counts)[1]
        if phase is Phase.COUNT:
            step.counted(step.counts_of_pass(torch.tensor(counts.num_tokens).double(),
                                             torch.tensor(float(counts.num_sequences)).double()),
                         mode, norm)  # fmt: skip
            assert step.phase is Phase.REPLAY
            got = _loss_in_step(step, weights, keeps, losses)
            if grouped and "pair_ids" not in kwargs:  # kept groups: 0 (dropped, empty), 3 gone
                assert (step.group_counts > 0).tolist() == [False, True, True, False]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), (mode, phase)


@pytest.mark.parametrize(
    "mode, kwargs", [c[1:] for c in UNGROUPED + GROUPED], ids=[c[0] for c in UNGROUPED + GROUPED]
)
def test_zeroed_tokens_still_count(mode, kwargs):
    """Default semantics: the step's weights times the kept mask (dropped tokens still count),
    the same as outside a plugin step."""
    masks, keeps, losses = _data(3)
    weights = loss_weights(masks, mode, norm_constant=_norm(mode), **kwargs)
    triples = list(zip(weights, keeps, losses, strict=True))
    want = sum(float((w * k * x).sum()) for w, k, x in triples)
    step = _step(mode, phase_for(mode, False, False, False), masks)
    assert step.phase is Phase.ZERO
    assert _loss_in_step(step, weights, keeps, losses) == pytest.approx(want, rel=1e-6)
    outside = sum(float(weighted_sum(x, kept_weights(w, k))) for w, k, x in triples)
    assert outside == pytest.approx(want, rel=1e-6)
    counts, _ = _agreed(step)
    assert counts.num_tokens == sum(float(k.sum()) for k in keeps)


def test_packed_sequences_are_counted_by_segment():
    """A packed [1, T] micro-batch: n_s per packed sequence, as loss_weights of the rows."""
    rows = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    keep = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    loss = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    want = float((loss_weights([rows * keep], "sequence_mean")[0] * loss).sum())
    seg = torch.arange(3).repeat_interleave(4)[None, :]
    packed = [rows.reshape(1, -1)]
    step = _step("sequence_mean", Phase.DEFERRED, packed, segment_ids=[seg])
    step.rows = [3]
    weights = loss_weights(packed, "sequence_mean")
    got = _loss_in_step(step, weights, [keep.reshape(1, -1)], [loss.reshape(1, -1)])
    counts, _ = _agreed(step)
    assert counts.num_sequences == 2
    assert got * deferred_scale("sequence_mean", False, counts)[1] == pytest.approx(want)


@pytest.mark.parametrize(
    "keep, which",
    [
        (lambda m: m * 0.5, "values other than 0 and 1"),
        (lambda m: m.masked_fill(m.isnan(), 0) * float("nan"), "values other than 0 and 1"),
    ],
    ids=["fraction", "nan"],
)
def test_malformed_kept_masks_are_flagged(keep, which):
    masks, _, losses = _data(4)
    weights = loss_weights(masks, "token_mean")
    step = _step("token_mean", Phase.DEFERRED, masks)
    _loss_in_step(step, weights, [keep(m) for m in masks], losses)
    _, flags = _agreed(step)
    assert flags.any()
    assert which in step.flag_message()


def test_what_a_kept_mask_keeps_outside_the_loss_mask_is_ignored():
    masks, keeps, losses = _data(7)
    weights = loss_weights(masks, "sequence_mean")
    everywhere = [
        k | (torch.rand(k.shape) < 0.5) & (m == 0) for k, m in zip(keeps, masks, strict=True)
    ]
    results = []
    for given in (keeps, everywhere):
        step = _step("sequence_mean", Phase.DEFERRED, masks)
        results.append((_loss_in_step(step, weights, given, losses), _agreed(step)))
    (loss, (counts, flags)), (loss2, (counts2, flags2)) = results
    assert loss == loss2 and counts == counts2 and not flags.any() and not flags2.any()


def test_two_calls_with_different_masks_in_one_microbatch_are_flagged():
    masks, keeps, _ = _data(5)
    step = _step("token_mean", Phase.DEFERRED, masks)
    with step.active(0):
        kept_weights(masks[0], keeps[0])
        kept_weights(masks[0], keeps[0])
    assert not _agreed(step)[1].any()
    with step.active(1):
        kept_weights(masks[1], keeps[1])
        kept_weights(masks[1], masks[1])  # keeps everything the second time
    assert _agreed(step)[1].any()
    assert "different kept masks" in step.flag_message()


def test_shape_mismatch_raises_in_the_loss():
    step = _step("token_mean", Phase.DEFERRED, [torch.ones(2, 3)])
    with step.active(0), pytest.raises(ValueError, match="kept mask has shape"):
        kept_weights(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="kept mask has shape"):
        kept_weights(torch.ones(2, 3), torch.ones(3))


def test_nothing_kept_gives_zero_and_no_nan():
    masks, _, losses = _data(6)
    for _, mode, kwargs in UNGROUPED + GROUPED:
        weights = loss_weights(masks, mode, norm_constant=_norm(mode), **kwargs)
        step = _step(
            mode, phase_for(mode, True, False, False, bool(kwargs)), masks, ids=_ids(kwargs, masks)
        )
        zero = [torch.zeros_like(m, dtype=torch.bool) for m in masks]
        got = _loss_in_step(step, weights, zero, losses)
        counts, _ = _agreed(step)
        assert (counts.num_tokens, counts.num_sequences) == (0, 0)
        if step.phase is Phase.DEFERRED:
            assert deferred_scale(mode, False, counts) == (1.0, 1.0)
            assert deferred_scale(mode, True, counts) == (1.0, 1.0)
        if step.phase is Phase.COUNT:  # the real pass's weights: zero, not NaN
            zero_count = torch.zeros((), dtype=torch.float64)
            step.counted(step.counts_of_pass(zero_count, zero_count), mode, _norm(mode))
            got = _loss_in_step(step, weights, zero, losses)
            assert all(bool(torch.isfinite(w).all()) for w in step.replay)
        assert got == 0.0


def test_deferred_scale_on_megatrons_per_token_path():
    """Megatron divided by the kept tokens it was handed; the gradient scale undoes that."""
    counts = KeptCounts(calls=2, num_tokens=40.0, num_sequences=5.0)
    assert deferred_scale("token_mean", True, counts) == (1.0, 1 / 40)
    assert deferred_scale("sequence_mean", True, counts) == (8.0, 1 / 5)
    assert deferred_scale("seq_mean_token_sum_norm", False, counts) == (1 / 5, 1 / 5)


def test_weighted_loss_keep_is_a_mask_or_a_function_of_the_loss():
    weights = loss_weights([torch.ones(2, 4)], "sum")[0]
    loss = torch.tensor([[1.0, 9.0, 2.0, 3.0], [8.0, 1.0, 1.0, 1.0]])
    assert float(weighted_loss(weights, loss, keep=lambda per_token: per_token < 5)[0]) == 9.0
    assert float(weighted_loss(weights, loss, keep=loss < 5)[0]) == 9.0
    # The count is the loss mask's: Megatron's per-token path must divide by N, not the kept N.
    assert int(weighted_loss(weights, loss, keep=loss < 5)[1]) == 8


def test_weighted_stats_are_recorded_only_inside_a_step():
    weighted_stats("x_sum")  # a no-op outside a step
    step = _step("token_mean", Phase.DEFERRED, [torch.ones(1, 2)])
    with step.active(0):
        weighted_stats("pg_loss_sum", "kl_sum")
    assert step.weighted_names == {"pg_loss_sum", "kl_sum"}


def test_float_masks_accept_what_the_loss_gives():
    assert float_masks([torch.ones(1, 2, dtype=torch.bool)])[0].dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reduction": "off", "mask_in_loss": True}, "needs a plugin mode"),
        ({"reduction": "token_mean", "counting_pass": True}, "applies only with mask_in_loss"),
        ({"reduction": "token_mean", "mask_in_loss": 1}, "True or False"),
    ],
)
def test_config_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossFixConfig(**kwargs)


@pytest.mark.parametrize("mode", REDUCTIONS)
def test_which_path_each_step_takes(mode):
    """Zeroed: no count waits. Excluded: a counting pass where asked; else the modes with a
    global kept count wait for the end of the schedule, unless gradient terms outside the loss
    would be rescaled by that (then they count first); sum and token_mean_legacy need no
    global count."""
    assert phase_for(mode, False, True, True) is Phase.ZERO
    assert phase_for(mode, True, True, False) is Phase.COUNT
    local = mode in ("sum", "token_mean_legacy")
    waits = Phase.COUNT if mode_of(mode).kept is None else Phase.DEFERRED
    assert phase_for(mode, True, False, False) is (Phase.LOCAL if local else waits)
    assert phase_for(mode, True, False, True) is (Phase.LOCAL if local else Phase.COUNT)
    # Weights over group ids (group_mean, trajectories): a factor per group, counted first.
    assert phase_for(mode, True, False, False, True) is Phase.COUNT
    assert phase_for(mode, False, False, False, True) is Phase.ZERO
