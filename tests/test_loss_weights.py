"""Unit tests of ``loss_weights`` against hand-computed values (single process, no groups)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lossfix import REDUCTIONS, loss_weights
from megatron_lossfix.runtime.mode_record import Ids
from megatron_lossfix.runtime.modes import mode_of

pytestmark = pytest.mark.unit


def _loss(weights, losses):
    return sum(float((w * x).sum()) for w, x in zip(weights, losses, strict=True))


# Two micro-batches, four sequences with 2, 0, 1 and 3 loss tokens: N = 6, S = 3.
MB0 = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.float32)
MB1 = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.float32)


def test_reductions_are_the_contract():
    assert REDUCTIONS == (
        "token_mean",
        "sequence_mean",
        "seq_mean_token_sum_norm",
        "sum",
        "token_mean_legacy",
        "group_mean",
        "pair_mean",
    )


def _kwargs(mode: str, masks: list, norm_constant: float = 3.0) -> dict:
    """What ``mode`` needs beside the masks: the constant, group ids (row r of every
    micro-batch in group r % 2) or pair ids (rows 2i and 2i + 1 of a micro-batch a pair)."""
    if mode_of(mode).uses_constant:
        return {"norm_constant": norm_constant}
    ids = mode_of(mode).ids
    if ids is Ids.PROMPT_GROUPS:
        ids = [torch.arange(m.shape[0]) % 2 for m in masks]
        return {"group_ids": ids, "num_groups": 2}
    if ids is Ids.PAIRS:
        return {"pair_ids": [torch.arange(m.shape[0]) // 2 for m in masks]}
    return {}


@pytest.mark.parametrize(
    "mode, kwargs, expected0, expected1",
    [
        ("token_mean", {}, [[1 / 6, 1 / 6, 0], [0, 0, 0]], [[1 / 6, 0, 0], [1 / 6] * 3]),
        ("sequence_mean", {}, [[1 / 6, 1 / 6, 0], [0, 0, 0]], [[1 / 3, 0, 0], [1 / 9] * 3]),
        (
            "seq_mean_token_sum_norm",
            {"norm_constant": 4.0},
            [[1 / 12, 1 / 12, 0], [0, 0, 0]],
            [[1 / 12, 0, 0], [1 / 12] * 3],
        ),
        ("sum", {}, [[1, 1, 0], [0, 0, 0]], [[1, 0, 0], [1, 1, 1]]),
        # n_0 = 2, n_1 = 4, M = 2, D = 1.
        ("token_mean_legacy", {}, [[1 / 4, 1 / 4, 0], [0, 0, 0]], [[1 / 8, 0, 0], [1 / 8] * 3]),
    ],
)
def test_hand_computed_weights(mode, kwargs, expected0, expected1):
    w0, w1 = loss_weights([MB0, MB1], mode, **kwargs)
    for got, want in ((w0, expected0), (w1, expected1)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-7, atol=0)


def test_skyrl_925_example_token_mean_vs_legacy():
    """100 tokens with mean loss 0.5 and 900 with mean loss 0.3 (docs/design.md §2)."""
    masks = [torch.ones(1, 100), torch.ones(1, 900)]
    losses = [torch.full((1, 100), 0.5), torch.full((1, 900), 0.3)]
    assert _loss(loss_weights(masks, "token_mean"), losses) == pytest.approx(0.32, rel=1e-6)
    assert _loss(loss_weights(masks, "token_mean_legacy"), losses) == pytest.approx(0.4, rel=1e-6)


@pytest.mark.parametrize("mode", REDUCTIONS)
def test_bool_int_and_float_masks_agree(mode):
    kwargs = _kwargs(mode, [MB0, MB1])
    ref = loss_weights([MB0, MB1], mode, **kwargs)
    for dtype in (torch.bool, torch.int64, torch.float64, torch.bfloat16):
        got = loss_weights([MB0.to(dtype), MB1.to(dtype)], mode, **kwargs)
        for g, r in zip(got, ref, strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("mode", REDUCTIONS)
def test_zero_token_microbatch_contributes_nothing(mode):
    empty = torch.zeros(2, 3)
    w_with = loss_weights([MB0, empty, MB1], mode, **_kwargs(mode, [MB0, empty, MB1], 2.0))
    assert torch.equal(w_with[1], torch.zeros(2, 3))
    assert all(torch.isfinite(w).all() for w in w_with)
    if mode == "token_mean_legacy":
        # The empty micro-batch still counts in M: 1 / (n_k * 3 * 1).
        torch.testing.assert_close(w_with[0][0, 0], torch.tensor(1 / 6))
        torch.testing.assert_close(w_with[2][1, 0], torch.tensor(1 / 12))
    else:
        w_without = loss_weights([MB0, MB1], mode, **_kwargs(mode, [MB0, MB1], 2.0))
        torch.testing.assert_close(w_with[0], w_without[0], rtol=0, atol=0)
        torch.testing.assert_close(w_with[2], w_without[1], rtol=0, atol=0)


@pytest.mark.parametrize("mode", REDUCTIONS)
def test_all_zero_minibatch_gives_zero_weights_and_no_nan(mode):
    masks = [torch.zeros(2, 5), torch.zeros(1, 5, dtype=torch.bool)]
    weights = loss_weights(masks, mode, **_kwargs(mode, masks, 2.0))
    for w in weights:
        assert torch.equal(w, torch.zeros_like(w))


def test_zero_token_sequences_are_not_counted():
    """S counts sequences with a loss token; an empty one changes no weight."""
    a = torch.tensor([[1.0, 1.0, 0.0]])
    with_empty = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    for mode in ("sequence_mean", "seq_mean_token_sum_norm"):
        kw = {"norm_constant": 5.0} if mode == "seq_mean_token_sum_norm" else {}
        w1 = loss_weights([a], mode, **kw)[0]
        w2 = loss_weights([with_empty], mode, **kw)[0]
        torch.testing.assert_close(w2[0], w1[0], rtol=0, atol=0)


def test_unequal_microbatch_sizes():
    """Micro-batches of different batch sizes and sequence lengths."""
    mb_a = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.float32)  # n = 4
    mb_b = torch.tensor([[1, 0], [1, 1], [0, 0]], dtype=torch.float32)  # n = 1, 2, 0
    w = loss_weights([mb_a, mb_b], "sequence_mean")
    assert w[0].shape == (1, 5) and w[1].shape == (3, 2)
    torch.testing.assert_close(w[0][0, 0], torch.tensor(1 / 12))  # S = 3, n = 4
    torch.testing.assert_close(w[1][0, 0], torch.tensor(1 / 3))
    torch.testing.assert_close(w[1][1, 1], torch.tensor(1 / 6))
    w = loss_weights([mb_a, mb_b], "token_mean_legacy")
    torch.testing.assert_close(w[0][0, 0], torch.tensor(1 / 8))  # n_k = 4, M = 2
    torch.testing.assert_close(w[1][0, 0], torch.tensor(1 / 6))  # n_k = 3, M = 2


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm", "sum"])
def test_loss_does_not_depend_on_microbatch_split(mode):
    """The same sequences split 1, 2 or 5 ways give the same L (legacy, by design, does not)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 3, 17, 1, 9, 30, 2, 0, 12, 5])
    masks = (torch.arange(32)[None, :] < lengths[:, None]).float()
    losses = torch.rand(10, 32, generator=gen) * 4
    kwargs = {"norm_constant": 32.0} if mode == "seq_mean_token_sum_norm" else {}
    ref = _loss(loss_weights([masks], mode, **kwargs), [losses])
    for splits in ([5, 5], [1, 2, 3, 1, 3], [9, 1]):
        parts_m = list(torch.split(masks, splits))
        parts_l = list(torch.split(losses, splits))
        got = _loss(loss_weights(parts_m, mode, **kwargs), parts_l)
        assert got == pytest.approx(ref, rel=1e-6), f"{mode} split {splits}: {got} vs {ref}"


def test_legacy_depends_on_split_as_the_old_mean_of_means():
    masks = [torch.ones(1, 1), torch.ones(1, 3)]
    losses = [torch.full((1, 1), 1.0), torch.full((1, 3), 2.0)]
    # mean of (1.0, 2.0) = 1.5, while the token mean is 7/4.
    assert _loss(loss_weights(masks, "token_mean_legacy"), losses) == pytest.approx(1.5)
    assert _loss(loss_weights(masks, "token_mean"), losses) == pytest.approx(1.75)


# ---------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "masks, mode, kwargs, match",
    [
        ([MB0], "mean", {}, "unknown loss reduction"),
        ([MB0], "off", {}, "unknown loss reduction"),
        ([MB0], "seq_mean_token_sum_norm", {}, "needs norm_constant"),
        ([MB0], "seq_mean_token_sum_norm", {"norm_constant": 0.0}, "must be > 0"),
        ([MB0], "seq_mean_token_sum_norm", {"norm_constant": -3}, "must be > 0"),
        ([MB0], "seq_mean_token_sum_norm", {"norm_constant": math.nan}, "must be > 0"),
        ([], "token_mean", {}, "empty"),
        (MB0, "token_mean", {}, "list of per-micro-batch"),
        ([MB0.numpy()], "token_mean", {}, "not a Tensor"),
        ([torch.ones(4)], "token_mean", {}, r"\[batch, seq\]"),
        ([torch.ones(1, 2, 3)], "token_mean", {}, r"\[batch, seq\]"),
        ([MB0, torch.tensor([[0.5, 1.0]])], "token_mean", {}, "micro-batch 1 must hold only 0"),
        ([torch.tensor([[-1.0, 1.0]])], "sum", {}, "only 0 and 1"),
        ([torch.tensor([[2, 1]])], "sum", {}, "only 0 and 1"),
        ([torch.tensor([[math.nan, 1.0]])], "sum", {}, "only 0 and 1"),
        ([torch.ones(1, 2, dtype=torch.complex64)], "sum", {}, "unsupported dtype"),
    ],
)
def test_value_errors(masks, mode, kwargs, match):
    with pytest.raises(ValueError, match=match):
        loss_weights(masks, mode, **kwargs)


def test_segment_ids_follow_cu_seqlens_and_pad_into_one_extra_segment():
    from megatron_lossfix.runtime.weights import segment_ids

    segments, num = segment_ids(torch.tensor([0, 3, 5]), 7)
    assert segments.tolist() == [[0, 0, 0, 1, 1, 2, 2]]  # positions 5, 6: padding
    assert num == 3
    segments, num = segment_ids(torch.tensor([0, 2, 4]), 4)
    assert segments.tolist() == [[0, 0, 1, 1]]
    with pytest.raises(ValueError, match="1-D"):
        segment_ids(torch.tensor([[0, 2]]), 2)
    with pytest.raises(ValueError, match="1-D"):
        segment_ids(torch.tensor([0]), 2)
