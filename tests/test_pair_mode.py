"""``pair_mean`` (docs/modes.md, "Preference pairs"): every pair of the step counts the same,
whatever micro-batch holds it and however many pairs that micro-batch holds.

The reference is plain PyTorch on one micro-batch: DPO's sigmoid loss averaged over the step's
pairs, ``mean_p -logsigmoid(beta * ((c_p - c_ref_p) - (r_p - r_ref_p)))``, each term a sum of
per-token log-probs over its sequence's mask. The plugin's side splits the same pairs into
micro-batches of unequal pair counts (rows, interleaved rows, packed ``cu_seqlens`` rows) and
returns ``sum_p pair_weights[p] * l_p`` per micro-batch. The check that passes under the mode's
weights is run again with the weights replaced by the mean over each micro-batch's pairs
(what a ``loss.mean()`` per micro-batch gives), and must fail there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import megatron_lossfix.runtime.modes as modes
from megatron_lossfix import loss_weights, pair_weights
from megatron_lossfix.runtime.mode_formulas import pair_mean_weights
from megatron_lossfix.step.selfcheck.microbatch_resplit import loss_token_half

pytestmark = pytest.mark.unit

BETA, VOCAB, WIDTH = 0.5, 11, 9
#: Pairs per micro-batch of the splits: 8 pairs as one micro-batch, and uneven splits.
SPLITS = [(8,), (1, 3, 4), (5, 1, 2), (2, 2, 2, 2)]


def _pairs(seed: int, masked_pair: int | None = None) -> dict[str, torch.Tensor]:
    """Eight pairs: tokens, masks (chosen, rejected: [8, WIDTH] each) and reference log-probs;
    pair ``masked_pair`` has no loss token."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for side in ("chosen", "rejected"):
        lengths = torch.randint(1, WIDTH + 1, (8,), generator=gen)
        start = torch.randint(0, 3, (8,), generator=gen)
        pos = torch.arange(WIDTH)
        mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
        if masked_pair is not None:
            mask[masked_pair] = False
        out[side] = torch.randint(0, VOCAB, (8, WIDTH), generator=gen)
        out[side + "_mask"] = mask.float()
        out[side + "_ref"] = -2.0 + 0.3 * torch.randn(8, WIDTH, generator=gen)
    return out


def _logp(theta: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The toy policy's per-token log-probs: a log-softmax over one logit vector per position."""
    return F.log_softmax(theta, dim=-1)[torch.arange(WIDTH)[None, :], tokens]


def _dpo(theta, tokens, mask, ref, chosen_rows, rejected_rows) -> torch.Tensor:
    """One loss per pair from rows of one micro-batch."""
    seq = ((_logp(theta, tokens) - ref) * mask).sum(dim=1)
    return -F.logsigmoid(BETA * (seq[chosen_rows] - seq[rejected_rows]))


def _reference_grad(data: dict, theta0: torch.Tensor) -> torch.Tensor:
    """Mean over the pairs that have a loss token, one micro-batch."""
    theta = theta0.clone().requires_grad_()
    tokens = torch.cat([data["chosen"], data["rejected"]])
    mask = torch.cat([data["chosen_mask"], data["rejected_mask"]])
    ref = torch.cat([data["chosen_ref"], data["rejected_ref"]])
    losses = _dpo(theta, tokens, mask, ref, torch.arange(8), torch.arange(8, 16))
    held = (data["chosen_mask"].sum(1) + data["rejected_mask"].sum(1)) > 0
    (losses[held].sum() / held.sum()).backward()
    return theta.grad


def _microbatches(data: dict, split: tuple[int, ...], layout: str) -> list[dict]:
    """Each micro-batch's rows and pair ids: ``blocks`` (its chosen rows, then its rejected
    rows), ``interleaved`` (chosen, rejected, ...) or ``packed`` (one row, ``cu_seqlens``)."""
    out, first = [], 0
    for n in split:
        pick = slice(first, first + n)
        first += n
        parts = {k: data[k][pick] for k in data}
        if layout == "interleaved":
            order = torch.stack([torch.arange(n), torch.arange(n, 2 * n)], 1).reshape(-1)
        else:
            order = torch.arange(2 * n)
        rows = {
            "tokens": torch.cat([parts["chosen"], parts["rejected"]])[order],
            "mask": torch.cat([parts["chosen_mask"], parts["rejected_mask"]])[order],
            "ref": torch.cat([parts["chosen_ref"], parts["rejected_ref"]])[order],
            "pair_ids": torch.cat([torch.arange(n), torch.arange(n)])[order],
        }
        rows["chosen_rows"] = (order < n).nonzero()[:, 0]
        rows["rejected_rows"] = (order >= n).nonzero()[:, 0]
        out.append(rows)
    return out


def _plugin_grad(data: dict, theta0: torch.Tensor, split: tuple, layout: str) -> torch.Tensor:
    theta = theta0.clone().requires_grad_()
    mbs = _microbatches(data, split, layout)
    weights = loss_weights([mb["mask"] for mb in mbs], "pair_mean",
                           pair_ids=[mb["pair_ids"] for mb in mbs])  # fmt: skip
    total = 0.0
    for mb, w in zip(mbs, weights, strict=True):
        losses = _dpo(theta, mb["tokens"], mb["mask"], mb["ref"], mb["chosen_rows"],
                      mb["rejected_rows"])  # fmt: skip
        if layout == "packed":  # the rows back to back in one [1, T] row, a sequence each
            cu = torch.arange(0, w.numel() + 1, WIDTH)
            per_pair = pair_weights(w.reshape(1, -1), mb["pair_ids"], cu)
        else:
            per_pair = pair_weights(w, mb["pair_ids"])
        total = total + (per_pair[: len(losses)] * losses).sum()
    total.backward()
    return theta.grad


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _worst(seed: int, masked_pair: int | None = None) -> float:
    data = _pairs(seed, masked_pair)
    theta0 = torch.randn(WIDTH, VOCAB, generator=torch.Generator().manual_seed(seed + 100))
    want = _reference_grad(data, theta0)
    return max(
        _error(_plugin_grad(data, theta0, split, layout), want)
        for split in SPLITS
        for layout in ("blocks", "interleaved", "packed")
    )


def _per_microbatch_mean(masks, counts, c, segs):
    """The mean over each micro-batch's own pairs (a ``loss.mean()`` per micro-batch, the
    step's M micro-batches averaged): what pair_mean must not be."""
    out = []
    real = pair_mean_weights
    for k, m in enumerate(masks):
        ids = counts.group_ids[k]
        one = dataclasses.replace(
            counts, seq_tokens=[counts.seq_tokens[k]], group_ids=[ids],
            num_pairs=torch.unique(ids[counts.seq_tokens[k] > 0]).numel() * torch.ones(()),
        )  # fmt: skip
        seg = None if segs is None else [segs[k]]
        out += [w / len(masks) for w in real([m], one, c, seg)]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_pair_counts_the_same_in_any_split(seed):
    assert _worst(seed) <= 1e-6


def test_a_pair_without_a_loss_token_does_not_count():
    assert _worst(3, masked_pair=2) <= 1e-6


def test_the_per_microbatch_pair_mean_fails_the_same_check(monkeypatch):
    """The check above, with the record's weights replaced by the per-micro-batch mean."""
    record = dataclasses.replace(modes.mode_of("pair_mean"), group_weights=_per_microbatch_mean)
    monkeypatch.setitem(modes._BY_NAME, "pair_mean", record)
    assert min(_worst(seed) for seed in (0, 1, 2)) > 0.02


def test_each_pairs_weight_is_one_over_p():
    masks = [torch.ones(2, 3), torch.ones(6, 3), torch.zeros(2, 3)]
    ids = [torch.tensor([0, 0]), torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([0, 0])]
    weights = loss_weights(masks, "pair_mean", pair_ids=ids)
    per_pair = [pair_weights(w, i) for w, i in zip(weights, ids, strict=True)]
    assert torch.allclose(per_pair[0], torch.tensor([0.25, 0.0]))
    assert torch.allclose(per_pair[1], torch.tensor([0.25, 0.25, 0.25, 0, 0, 0]))
    assert torch.equal(per_pair[2], torch.zeros(2))  # no loss token: no weight, not counted


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "needs each sequence's pair: put 'pair_ids'"),
        ({"pair_ids": [torch.tensor([0, 2])]}, r"must lie in \[0, 2\)"),
        ({"pair_ids": [torch.tensor([0])]}, "one id per sequence"),
        ({"pair_ids": [torch.tensor([0.0, 1.0])]}, "must hold integers"),
    ],
)
def test_bad_pair_ids_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        loss_weights([torch.ones(2, 3)], "pair_mean", **kwargs)
    assert "\n" not in str(err.value)


def test_pair_ids_under_another_mode_are_refused():
    with pytest.raises(ValueError, match="pair_ids apply only to pair_mean"):
        loss_weights([torch.ones(2, 3)], "token_mean", pair_ids=[torch.tensor([0, 0])])


def test_the_selfchecks_halves_keep_pairs_whole():
    """Several pairs: every other pair kept whole (both its sequences), the mask with it; one
    pair: its weights alone are halved (the mask, which the pair's log-probs read, kept)."""
    mask = torch.ones(4, 2)
    batch = {"loss_mask": mask, "pair_ids": torch.tensor([0, 1, 0, 1])}
    halves = [loss_token_half(w, unit_key="pair_ids") for w in (0, 1)]
    runs = [h([batch], [mask / 8])[0] for h in halves], [h([batch], [mask / 8])[1] for h in halves]
    (first, second), (w0, w1) = runs[0], runs[1]
    assert first[0]["loss_mask"][:, 0].tolist() == [1, 0, 1, 0]
    assert second[0]["loss_mask"][:, 0].tolist() == [0, 1, 0, 1]
    assert torch.equal(w0[0] + w1[0], mask / 8)
    one = {"loss_mask": torch.ones(2, 2), "pair_ids": torch.tensor([0, 0])}
    b0, ws0 = halves[0]([one], [torch.ones(2, 2) / 4])
    assert b0[0]["loss_mask"] is one["loss_mask"] and float(ws0[0].sum()) == 0.5
