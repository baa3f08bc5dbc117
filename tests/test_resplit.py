"""The self-check's re-split plans, data re-splitting and halves of the loss tokens (pure: no
ranks, no Megatron)."""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix.step.selfcheck.microbatch_resplit import (
    loss_token_half,
    resplit,
    resplit_plan,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "m, mbs, kwargs, want",
    [
        (2, 6, {}, ("split", 2, 4, 3)),
        # One row per micro-batch: no row can move without growing one (the check then runs
        # halves of the loss tokens); micro-batches are never merged.
        (3, 1, {}, None),
        (4, 1, {}, None),
        (4, None, {}, ("shuffle", 1, 4, None)),  # size unknown: rows dealt, else halves
        (2, 3, {}, ("split", 2, 4, None)),  # uneven halves: fine without PP
        (8, 3, {"pp": 2}, ("shuffle", 1, 8, None)),  # PP keeps one shape
        (2, 3, {"pp": 2, "group": 2}, ("shuffle", 1, 2, None)),
        (4, 6, {"keep_shapes": True}, ("shuffle", 1, 4, None)),
        (1, 1, {}, None),
        (1, 3, {"pp": 2}, None),
    ],
)
def test_resplit_plan(m, mbs, kwargs, want):
    assert resplit_plan(m, mbs, **kwargs) == want


def _batches(sizes: list[int]) -> list[dict]:
    start, out = 0, []
    for n in sizes:
        rows = torch.arange(start, start + n)
        out.append(
            {
                "tokens": rows[:, None].expand(n, 4).clone(),
                "loss_mask": torch.ones(n, 4),
                "position_ids": torch.arange(4)[None, :],  # broadcast: shared, not per row
                "tag": "x",
            }
        )
        start += n
    return out


def _rows(batches: list[dict]) -> list[int]:
    return [int(r) for b in batches for r in b["tokens"][:, 0]]


@pytest.mark.parametrize(
    "sizes, plan, want_sizes",
    [
        ([4, 4], ("split", 2, 4, 2), [2, 2, 2, 2]),
        ([3, 2], ("split", 2, 4, None), [1, 2, 1, 1]),
        ([3, 3, 3], ("shuffle", 1, 3, None), [3, 3, 3]),
    ],
)
def test_resplit_keeps_every_row_once(sizes, plan, want_sizes):
    before = _batches(sizes)
    after = resplit(before, plan)
    assert [len(b["tokens"]) for b in after] == want_sizes
    assert sorted(_rows(after)) == _rows(before)
    shared = before[0]["position_ids"]
    assert all(torch.equal(b["position_ids"], shared) and b["tag"] == "x" for b in after)
    if plan[0] == "shuffle":  # every new micro-batch mixes rows of several old ones
        assert all(len({r // 3 for r in _rows([b])}) > 1 for b in after)


def test_resplit_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="1 row"):
        resplit(_batches([1, 1]), ("split", 2, 4, None))
    with pytest.raises(ValueError, match="only dict"):
        resplit([(torch.ones(2),)], ("shuffle", 1, 1, None))
    uneven = _batches([2, 2])
    uneven[1]["tag"] = "y"
    with pytest.raises(ValueError, match="'tag' differs"):
        resplit(uneven, ("shuffle", 1, 2, None))
    packed = _batches([2, 2])
    for b in packed:
        b["cu_seqlens"] = torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match="packed"):
        resplit(packed, ("split", 2, 4, None))


def _halves(batch: dict, weights: torch.Tensor, **keys) -> list[tuple[dict, torch.Tensor]]:
    """Run 0's and run 1's (micro-batch, weights) of one micro-batch."""
    out = []
    for which in (0, 1):
        batches, halved = loss_token_half(which, **keys)([batch], [weights])
        out.append((batches[0], halved[0]))
    return out


@pytest.mark.parametrize("shape", [(1, 9), (1, 1), (1, 16)])
def test_a_micro_batch_of_one_sequence_alternates_its_loss_tokens_and_doubles_its_mask(shape):
    """One row: its weights are dealt into two halves that hold every other loss token each and
    add up to the weights; its loss mask counts twice in both (a mean over the mask stays, a
    division of the weighted sum by the mask's count is halved); the input is left as it was."""
    gen = torch.Generator().manual_seed(sum(shape))
    mask = (torch.rand(shape, generator=gen) > 0.3).float()
    weights = torch.rand(shape, generator=gen) * mask
    batch = {"loss_mask": mask, "tokens": torch.zeros(shape, dtype=torch.long)}
    before = {k: v.clone() for k, v in batch.items()}
    (ba, a), (bb, b) = _halves(batch, weights)
    assert torch.equal(a + b, weights) and not ((a != 0) & (b != 0)).any()
    assert torch.equal(ba["loss_mask"], 2 * mask) and torch.equal(bb["loss_mask"], 2 * mask)
    assert all(torch.equal(batch[k], before[k]) for k in batch) and ba["tokens"] is batch["tokens"]
    count = int((weights != 0).sum())
    assert (int((a != 0).sum()), int((b != 0).sum())) == ((count + 1) // 2, count // 2)
    flat = (weights != 0).reshape(-1).nonzero().reshape(-1)  # loss tokens alternate
    assert all((a.reshape(-1)[i] != 0) == (n % 2 == 0) for n, i in enumerate(flat.tolist()))


def test_a_bool_mask_of_one_sequence_is_left_as_it_is():
    mask = torch.ones(1, 6, dtype=torch.bool)
    (ba, a), (bb, b) = _halves({"loss_mask": mask}, mask.float())
    assert ba["loss_mask"] is mask and bb["loss_mask"] is mask and torch.equal(a + b, mask.float())


@pytest.mark.parametrize("shape", [(3, 5), (2, 4), (5, 1)])
def test_rows_holding_loss_tokens_are_kept_whole_every_other_one(shape):
    """Several rows with loss tokens: each run keeps every other such row whole, weights and
    mask alike (a statistic over a row's mask is the normal run's), and the halves add up."""
    gen = torch.Generator().manual_seed(sum(shape))
    mask = (torch.rand(shape, generator=gen) > 0.3).float()
    mask[:, 0] = 1  # every row holds a loss token
    mask[1] = 0 if shape[0] > 2 else mask[1]  # and one, where there are three, none
    weights = torch.rand(shape, generator=gen) * mask
    (ba, a), (bb, b) = _halves({"loss_mask": mask}, weights)
    assert torch.equal(a + b, weights)
    assert torch.equal(ba["loss_mask"] + bb["loss_mask"], mask)
    holding = [r for r in range(shape[0]) if mask[r].any()]
    for rows, half, kept in ((holding[0::2], a, ba), (holding[1::2], b, bb)):
        for r in range(shape[0]):
            want = weights[r] if r in rows else torch.zeros_like(weights[r])
            assert torch.equal(half[r], want) and torch.equal(kept["loss_mask"][r] != 0, want != 0)


def test_packed_halves_keep_every_other_sequence_and_join_the_others_to_the_one_before():
    """A packed row with several sequences that hold loss tokens: each run keeps every other
    such sequence whole, and its boundaries change so that each dropped sequence joins the
    kept one before it (causal attention: the kept tokens see nothing new), with the
    per-sequence ids and ``max_seqlen`` following: a loss that divides by its number of
    sequences sees another count in each run."""
    cu = torch.tensor([0, 3, 5, 9, 12, 14], dtype=torch.int32)  # 14..15: padding
    mask = torch.ones(1, 16)
    mask[0, 14:] = 0
    mask[0, 5:9] = 0  # sequence 2 holds no loss token
    weights = mask * torch.arange(1.0, 17.0)
    batch = {"loss_mask": mask, "cu_seqlens": cu, "cu_seqlens_padded": cu.clone(),
             "group_ids": torch.tensor([7, 8, 9, 10, 11]), "max_seqlen": 4}  # fmt: skip
    (ba, a), (bb, b) = _halves(batch, weights, id_keys=("group_ids",))
    assert torch.equal(a + b, weights)
    # Sequences holding loss tokens: 0, 1, 3, 4; run 0 keeps 0 and 3, run 1 keeps 1 and 4.
    assert torch.equal(a != 0, (weights != 0) & ((torch.arange(16) < 3) | (torch.arange(16) >= 9)
                                                  & (torch.arange(16) < 12)))  # fmt: skip
    assert ba["cu_seqlens"].tolist() == [0, 9, 14] and ba["cu_seqlens"].dtype == torch.int32
    assert bb["cu_seqlens"].tolist() == [0, 3, 12, 14]
    assert ba["cu_seqlens_padded"].tolist() == [0, 9, 14]  # the same boundaries, any key
    assert ba["group_ids"].tolist() == [7, 10] and bb["group_ids"].tolist() == [7, 8, 11]
    assert (ba["max_seqlen"], bb["max_seqlen"]) == (9, 9)
    assert torch.equal(ba["loss_mask"] + bb["loss_mask"], mask)
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 9, 12, 14]  # the input as it was


@pytest.mark.parametrize(
    "cu", [[0, 16], [0, -1, -1], [0, 8, 4, 16]], ids=["one-sequence", "padded", "unordered"]
)
def test_packed_rows_the_halves_cannot_cut_by_sequence_alternate_tokens(cu):
    """One sequence holding loss tokens, or boundaries in another convention: every other loss
    token, the mask doubled, the boundaries left alone."""
    mask = torch.ones(1, 16)
    batch = {"loss_mask": mask, "cu_seqlens": torch.tensor(cu)}
    (ba, a), (bb, b) = _halves(batch, mask.clone())
    assert ba["cu_seqlens"] is batch["cu_seqlens"] and bb["cu_seqlens"] is batch["cu_seqlens"]
    assert a.reshape(-1).tolist() == [1.0, 0.0] * 8 and torch.equal(a + b, mask)
    assert torch.equal(ba["loss_mask"], 2 * mask)


def test_the_first_half_cuts_only_the_window_and_leaves_the_rest_whole():
    """``only``: the first run halves the window's micro-batches and hands the others whole
    (the second run goes over the window alone): the window's two halves and the rest add up
    to the step's weights."""
    masks = [torch.ones(1, 6), torch.ones(1, 4), torch.ones(1, 5)]
    batches = [{"loss_mask": m} for m in masks]
    weights = [m * (k + 1) for k, m in enumerate(masks)]
    first_batches, first = loss_token_half(0, only=range(1, 2))(batches, weights)
    second_batches, second = loss_token_half(1)(batches[1:2], weights[1:2])
    assert first_batches[0] is batches[0] and first_batches[2] is batches[2]
    assert first[0] is weights[0] and first[2] is weights[2]
    assert torch.equal(first[1] + second[0], weights[1])
    assert first[1].reshape(-1).tolist() == [2.0, 0.0, 2.0, 0.0]
    assert torch.equal(first_batches[1]["loss_mask"], 2 * masks[1])
