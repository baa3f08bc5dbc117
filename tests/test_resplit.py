"""The self-check's re-split plans, data re-splitting and halves of the loss tokens (pure: no
ranks, no Megatron)."""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix.step.microbatch_resplit import loss_token_half
from megatron_lossfix.step.selfcheck import resplit, resplit_plan

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


@pytest.mark.parametrize("shape", [(1, 9), (3, 5), (1, 1), (2, 4)])
def test_halves_of_the_loss_tokens_add_up_to_the_weights(shape):
    """Each micro-batch's weights, packed rows ([1, T]) or not, are dealt into two halves that
    hold every other loss token each and add up to the weights; the input is left as it was."""
    gen = torch.Generator().manual_seed(sum(shape))
    weights = torch.rand(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.3)
    before = weights.clone()
    a, b = (loss_token_half(which)(0, weights) for which in (0, 1))
    assert torch.equal(a + b, weights) and torch.equal(weights, before)
    assert not ((a != 0) & (b != 0)).any()
    count = int((weights != 0).sum())
    assert (int((a != 0).sum()), int((b != 0).sum())) == ((count + 1) // 2, count // 2)
    flat = (weights != 0).reshape(-1).nonzero().reshape(-1)  # loss tokens alternate
    assert all((a.reshape(-1)[i] != 0) == (n % 2 == 0) for n, i in enumerate(flat.tolist()))
