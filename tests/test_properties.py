"""Property tests of the reduction math (docs/design.md §2) over random masks, lengths and splits.

Single process: a data-parallel split is simulated by counting each simulated rank's masks with
``count_tokens(masks_r, global_counts=False)``, summing N and S over the ranks by hand (what the
DP all-reduce does) and handing each rank its ``StepCounts`` with the global N, S and D filled in
(``dataclasses.replace``) to ``weights_from_counts``. A "step" is a list of variable-length
sequences; a "split" cuts it into contiguous DP slices and each slice into contiguous
micro-batches (Megatron's layout, docs/design.md §5), padding every micro-batch to its longest
sequence (plus some extra padding, which must get weight 0).

Checked: the weights sum to each mode's definition, the reduced loss ``sum(w * l)`` over all
simulated ranks does not depend on the split for the invariant modes, ``token_mean_legacy``
equals its mean-of-micro-batch-means formula, and the public ``loss_weights`` agrees with the
simulated path. Every sequence also carries a key (``Step.keys``: its prompt group, or its
trajectory for the sequence modes), whose per-key counts are summed over the simulated ranks
like N and S; keys without a loss token (absent, or all masked) must not count.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_lossfix import REDUCTIONS, loss_weights
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.prompt_groups import GroupIds, ids_for_mode
from megatron_lossfix.runtime.weights import count_tokens, weights_from_counts

pytestmark = pytest.mark.unit

INVARIANT_MODES = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "sum", "group_mean")
#: The modes that weight by key, and (for the sequence modes) whether keys are given.
KEYED = (("group_mean", True), ("sequence_mean", True), ("seq_mean_token_sum_norm", True))
NORM_CONSTANT = 7.0
# float32 weights, float64 sums: splits differ only in rounding of the float32 weights.
RTOL = 1e-6

# CI-friendly: ~100 random steps per property, no per-example deadline (first calls warm up
# torch's dispatcher and would trip the default 200 ms).
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step's sequences: each a 0/1 loss mask row and per-token losses."""

    masks: tuple[tuple[int, ...], ...]
    losses: tuple[tuple[float, ...], ...]
    keys: tuple[int, ...] = ()
    """Each sequence's key (prompt group or trajectory), in ``[0, num_keys)``, any order."""
    num_keys: int = 1


Split = tuple[tuple[int, ...], ...]
"""Sequences per micro-batch, per simulated DP rank: ``split[r][k]``."""


@st.composite
def steps(draw: st.DrawFn) -> Step:
    num_seqs = draw(st.integers(1, 10))
    # Some keys get no sequence, some only empty ones: neither may count.
    num_keys = draw(st.integers(1, 5))
    keys = tuple(draw(st.lists(st.integers(0, num_keys - 1), min_size=num_seqs, max_size=num_seqs)))
    masks, losses = [], []
    for _ in range(num_seqs):
        length = draw(st.integers(1, 8))
        # Bias toward empty and full sequences: the corner cases of S and n_s.
        kind = draw(st.sampled_from(["random", "random", "empty", "full"]))
        if kind == "empty":
            row = (0,) * length
        elif kind == "full":
            row = (1,) * length
        else:
            row = tuple(draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)))
        masks.append(row)
        losses.append(
            tuple(
                draw(
                    st.lists(
                        st.floats(-4.0, 4.0, allow_nan=False, width=32),
                        min_size=length,
                        max_size=length,
                    )
                )
            )
        )
    return Step(tuple(masks), tuple(losses), keys, num_keys)


def _cuts(draw: st.DrawFn, total: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``parts`` contiguous non-empty pieces of ``total`` items."""
    inner = (
        sorted(draw(st.sets(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1)))
        if parts > 1
        else []
    )
    bounds = [0, *inner, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


@st.composite
def splits(draw: st.DrawFn, num_seqs: int) -> Split:
    """Contiguous DP slices (1..4 ranks, uneven allowed), each cut into 1..4 micro-batches."""
    dp = draw(st.integers(1, min(4, num_seqs)))
    out = []
    for size in _cuts(draw, num_seqs, dp):
        out.append(_cuts(draw, size, draw(st.integers(1, min(4, size)))))
    return tuple(out)


@st.composite
def step_and_splits(draw: st.DrawFn, count: int = 2) -> tuple[Step, list[Split], list[int]]:
    step = draw(steps())
    chosen = [draw(splits(len(step.masks))) for _ in range(count)]
    pads = [draw(st.integers(0, 2)) for _ in range(count)]
    return step, chosen, pads


def _microbatch(step: Step, first: int, size: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and losses ``[size, width]`` for sequences ``first..first+size-1``; padding holds
    loss 1e6 so that any weight leaking onto it shows in the reduced loss."""
    rows = range(first, first + size)
    width = max(len(step.masks[i]) for i in rows) + pad
    mask = torch.zeros(size, width, dtype=torch.float32)
    loss = torch.full((size, width), 1e6, dtype=torch.float64)
    for j, i in enumerate(rows):
        n = len(step.masks[i])
        mask[j, :n] = torch.tensor(step.masks[i], dtype=torch.float32)
        loss[j, :n] = torch.tensor(step.losses[i], dtype=torch.float64)
    return mask, loss


def _layout(step: Step, split: Split, pad: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per simulated rank, its micro-batches as (mask, loss) pairs, in global order."""
    ranks, first = [], 0
    for sizes in split:
        mbs = []
        for size in sizes:
            mbs.append(_microbatch(step, first, size, pad))
            first += size
        ranks.append(mbs)
    assert first == len(step.masks)
    return ranks


def _key_layout(step: Step, split: Split) -> list[list[torch.Tensor]]:
    """Per simulated rank, each micro-batch's sequence keys, like :func:`_layout`."""
    keys = torch.tensor(step.keys, dtype=torch.long)
    out, first = [], 0
    for sizes in split:
        bounds = [first + sum(sizes[:k]) for k in range(len(sizes) + 1)]
        out.append([keys[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
        first += sum(sizes)
    return out


def _simulated_weights(
    ranks: list[list[tuple[torch.Tensor, torch.Tensor]]],
    mode: str,
    keys: tuple[list[list[torch.Tensor]], int] | None = None,
) -> list[list[torch.Tensor]]:
    """Weights per rank and micro-batch, with N and S (and, with ``keys`` = (per-rank ids, their
    range), each key's tokens) summed over the simulated DP ranks."""
    rank_keys = [None] * len(ranks)
    if keys is not None and ids_for_mode(mode) is not None:
        rank_keys = [GroupIds(ids=ids, count=keys[1]) for ids in keys[0]]
    counts = [
        count_tokens([m for m, _ in mbs], global_counts=False, groups=k)
        for mbs, k in zip(ranks, rank_keys, strict=True)
    ]
    num_tokens = sum(c.num_tokens for c in counts)
    num_sequences = sum(c.num_sequences for c in counts)
    per_key = None if rank_keys[0] is None else sum(c.group_tokens for c in counts)
    out = []
    for mbs, c in zip(ranks, counts, strict=True):
        c = dataclasses.replace(
            c,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            dp_size=len(ranks),
            group_tokens=per_key,
        )
        out.append(weights_from_counts([m for m, _ in mbs], c, mode, norm_constant=NORM_CONSTANT))
    return out


def _reduced_loss(ranks: list, weights: list[list[torch.Tensor]]) -> float:
    """``sum(w * l)`` over every simulated rank and micro-batch, in float64."""
    return sum(
        float((w.double() * loss).sum())
        for mbs, ws in zip(ranks, weights, strict=True)
        for (_, loss), w in zip(mbs, ws, strict=True)
    )


def _magnitude(ranks: list, weights: list[list[torch.Tensor]]) -> float:
    """``sum(|w * l|)``: the scale of the rounding error of ``sum(w * l)`` (float32 weights)."""
    return sum(
        float((w.double() * loss).abs().sum())
        for mbs, ws in zip(ranks, weights, strict=True)
        for (_, loss), w in zip(mbs, ws, strict=True)
    )


def _totals(step: Step) -> tuple[int, int]:
    n = sum(sum(m) for m in step.masks)
    s = sum(1 for m in step.masks if any(m))
    return n, s


#: The modes these properties draw: those whose ids the random keys can be (pair ids are each
#: micro-batch's own: tests/test_pair_mode.py).
DRAWN = tuple(m for m in REDUCTIONS if mode_of(m).ids.step_wide or not mode_of(m).ids.needed)


@PROPERTY
@given(step_and_splits(count=1), st.sampled_from(DRAWN))
def test_weights_sum_to_the_modes_definition(case: tuple, mode: str) -> None:
    step, (split,), (pad,) = case
    ranks = _layout(step, split, pad)
    # Rows are the sequences here: keys only where the mode needs them.
    keys = (_key_layout(step, split), step.num_keys) if mode == "group_mean" else None
    weights = _simulated_weights(ranks, mode, keys)
    n, s = _totals(step)
    d = len(ranks)
    total = 0.0
    for mbs, ws in zip(ranks, weights, strict=True):
        m_r = len(mbs)
        for (mask, _), w in zip(mbs, ws, strict=True):
            assert w.dtype == torch.float32 and w.shape == mask.shape
            assert torch.isfinite(w).all()
            assert torch.equal(w[mask == 0], torch.zeros_like(w[mask == 0]))
            per_seq = w.double().sum(dim=1)
            nonempty = mask.sum(dim=1) > 0
            if mode == "sequence_mean":
                # Every non-empty sequence weighs 1/S in total, whatever its length.
                expected = torch.where(nonempty, 1.0 / max(s, 1), 0.0).double()
                torch.testing.assert_close(per_seq, expected, rtol=1e-6, atol=0)
            if mode == "token_mean_legacy":
                # Every non-empty micro-batch weighs 1/(M_r * D); an empty one 0.
                want = 1.0 / (m_r * d) if bool(nonempty.any()) else 0.0
                assert math.isclose(float(per_seq.sum()), want, rel_tol=1e-6)
            total += float(per_seq.sum())
    expected_total = {
        "token_mean": 1.0 if n else 0.0,
        "sequence_mean": 1.0 if s else 0.0,
        "seq_mean_token_sum_norm": n / (max(s, 1) * NORM_CONSTANT),
        "sum": float(n),
        "group_mean": 1.0 if n else 0.0,
    }
    if mode in expected_total:
        assert math.isclose(total, expected_total[mode], rel_tol=1e-6, abs_tol=0.0)


def _key_totals(step: Step) -> tuple[dict[int, int], int]:
    """Loss tokens per key, and the number of keys that have any."""
    n_key: dict[int, int] = {}
    for mask, key in zip(step.masks, step.keys, strict=True):
        n_key[key] = n_key.get(key, 0) + sum(mask)
    return n_key, sum(1 for v in n_key.values() if v)


@PROPERTY
@given(step_and_splits(count=1), st.sampled_from(KEYED))
def test_every_key_with_a_loss_token_weighs_the_same(case: tuple, keyed: tuple) -> None:
    """group_mean (and the sequence modes over trajectories): the weights of each key's tokens,
    over every simulated rank and micro-batch, sum to 1/K (K: keys with a loss token) under
    group_mean and sequence_mean, and to n_g/(K*C) under seq_mean_token_sum_norm."""
    mode, _ = keyed
    step, (split,), (pad,) = case
    ranks, ids = _layout(step, split, pad), _key_layout(step, split)
    weights = _simulated_weights(ranks, mode, (ids, step.num_keys))
    per_key: dict[int, float] = {}
    for ws, rank_ids in zip(weights, ids, strict=True):
        for w, key_ids in zip(ws, rank_ids, strict=True):
            for row, key in zip(w.double().sum(dim=1).tolist(), key_ids.tolist(), strict=True):
                per_key[key] = per_key.get(key, 0.0) + row
    n_key, num = _key_totals(step)
    for key, total in per_key.items():
        if mode == "seq_mean_token_sum_norm":
            want = n_key[key] / (max(num, 1) * NORM_CONSTANT)
        else:
            want = 1.0 / num if n_key[key] else 0.0
        assert math.isclose(total, want, rel_tol=1e-6, abs_tol=1e-12), (key, total, want)


@PROPERTY
@given(step_and_splits(count=2), st.sampled_from(INVARIANT_MODES + ("trajectory_mean",)))
def test_reduced_loss_is_invariant_to_the_split(case: tuple, mode: str) -> None:
    step, (split_a, split_b), (pad_a, pad_b) = case
    # "trajectory_mean": sequence_mean with the keys as trajectory ids.
    plugin_mode = "sequence_mean" if mode == "trajectory_mean" else mode
    results, tol = [], 1e-12
    for split, pad in ((split_a, pad_a), (split_b, pad_b)):
        ranks = _layout(step, split, pad)
        keys = (_key_layout(step, split), step.num_keys)
        keyed = mode in ("group_mean", "trajectory_mean")
        weights = _simulated_weights(ranks, plugin_mode, keys if keyed else None)
        results.append(_reduced_loss(ranks, weights))
        tol = max(tol, RTOL * _magnitude(ranks, weights))
    # And the definition itself, straight from the sequences (docs/design.md §2 table).
    n, s = _totals(step)
    n_key, num_keys = _key_totals(step)
    direct = 0.0
    for mask, losses, key in zip(step.masks, step.losses, step.keys, strict=True):
        n_s = sum(mask)
        seq_sum = sum(x for b, x in zip(mask, losses, strict=True) if b)
        group = seq_sum / (max(num_keys, 1) * max(n_key[key], 1))
        direct += {
            "token_mean": seq_sum / max(n, 1),
            "sequence_mean": seq_sum / (max(s, 1) * max(n_s, 1)),
            "seq_mean_token_sum_norm": seq_sum / (max(s, 1) * NORM_CONSTANT),
            "sum": seq_sum,
            "group_mean": group,
            "trajectory_mean": group,
        }[mode]
    for got in results:
        assert abs(got - direct) <= tol, (got, direct, results)


@PROPERTY
@given(step_and_splits(count=1))
def test_token_mean_legacy_is_the_mean_of_microbatch_means(case: tuple) -> None:
    step, (split,), (pad,) = case
    ranks = _layout(step, split, pad)
    weights = _simulated_weights(ranks, "token_mean_legacy")
    got = _reduced_loss(ranks, weights)
    # Mean over ranks of the mean over that rank's micro-batches of their token means; a
    # zero-token micro-batch contributes 0 but still counts in M_r.
    rank_means = []
    for mbs in ranks:
        means = []
        for mask, loss in mbs:
            n_k = float(mask.sum())
            means.append(float((mask.double() * loss).sum()) / n_k if n_k else 0.0)
        rank_means.append(sum(means) / len(means))
    want = sum(rank_means) / len(rank_means)
    assert abs(got - want) <= RTOL * _magnitude(ranks, weights) + 1e-12, (got, want)


@PROPERTY
@given(step_and_splits(count=1), st.sampled_from(DRAWN), st.booleans())
def test_public_loss_weights_matches_the_simulation(case: tuple, mode: str, as_bool: bool) -> None:
    """``loss_weights`` without groups treats its list as the whole mini-batch: with all of one
    split's micro-batches on one rank it equals the simulated D=1 path exactly, and for the
    invariant modes it gives the same reduced loss as the simulated D-rank split."""
    step, (split,), (pad,) = case
    ranks = _layout(step, split, pad)
    flat = [mb for mbs in ranks for mb in mbs]
    kwargs = {"norm_constant": NORM_CONSTANT} if mode_of(mode).uses_constant else {}
    rank_ids = _key_layout(step, split)
    flat_ids = [ids for mbs in rank_ids for ids in mbs]
    keys = None
    if mode == "group_mean":
        kwargs.update(group_ids=flat_ids, num_groups=step.num_keys)
        keys = (rank_ids, step.num_keys)
    masks = [m.bool() if as_bool else m for m, _ in flat]
    public = loss_weights(masks, mode, **kwargs)
    one_rank = _simulated_weights([flat], mode, None if keys is None else ([flat_ids], keys[1]))[0]
    for got, want in zip(public, one_rank, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if mode in INVARIANT_MODES:
        split_weights = _simulated_weights(ranks, mode, keys)
        split_loss = _reduced_loss(ranks, split_weights)
        public_loss = _reduced_loss([flat], [public])
        tol = RTOL * _magnitude(ranks, split_weights) + 1e-12
        assert abs(split_loss - public_loss) <= tol, (split_loss, public_loss)
