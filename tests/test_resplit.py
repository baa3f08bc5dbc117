"""The self-check's re-split plans and data re-splitting (pure: no ranks, no Megatron)."""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix.step.selfcheck import resplit, resplit_plan

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "m, mbs, kwargs, want",
    [
        (2, 6, {}, ("split", 2, 4, 3)),
        (3, 1, {}, ("merge", 3, 1, 3)),
        (4, 1, {}, ("merge", 2, 2, 2)),
        (2, 3, {}, ("split", 2, 4, None)),  # uneven halves: fine without PP
        (8, 3, {"pp": 2}, ("merge", 2, 4, 6)),  # PP keeps one shape
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
        ([2, 2, 2, 2], ("merge", 2, 2, 4), [4, 4]),
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
        resplit([(torch.ones(2),)], ("merge", 2, 1, None))
    uneven = _batches([2, 2])
    uneven[1]["tag"] = "y"
    with pytest.raises(ValueError, match="'tag' differs"):
        resplit(uneven, ("merge", 2, 1, None))
    packed = _batches([2, 2])
    for b in packed:
        b["cu_seqlens"] = torch.tensor([0, 4, 8])
    with pytest.raises(ValueError, match="packed"):
        resplit(packed, ("split", 2, 4, None))
