"""The masks ``rl_objective`` decides from the current log-probs (``rl.masks.keep_mask``): an
importance-ratio band per token and per sequence, and off-policy sequence masking, against a
plain-PyTorch reference written out row by row; and what the objective does with them."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lossfix import RLObjective, loss_weights, rl_objective
from megatron_lossfix.rl.masks import keep_mask

pytestmark = pytest.mark.unit


def _reference(logp, old, adv, mask, band, seq_band, delta):
    """Row by row, token by token: what each mask keeps."""
    b, s = mask.shape
    keep = torch.zeros(b, s, dtype=torch.bool)
    for i in range(b):
        tokens = [t for t in range(s) if mask[i, t]]
        log_ratios = [float(logp[i, t] - old[i, t]) for t in tokens]
        drop_row = False
        if tokens and seq_band is not None:
            ratio = math.exp(sum(log_ratios) / len(tokens))
            drop_row |= not (seq_band[0] <= ratio <= seq_band[1])
        if tokens and delta is not None:
            mean_adv = sum(float(adv[i, t]) for t in tokens) / len(tokens)
            kl = -sum(log_ratios) / len(tokens)
            drop_row |= mean_adv < 0 and kl > delta
        for t, lr in zip(tokens, log_ratios, strict=True):
            inside = band is None or band[0] <= math.exp(lr) <= band[1]
            keep[i, t] = inside and not drop_row
    return keep


def _data(seed, b=6, s=9):
    gen = torch.Generator().manual_seed(seed)
    logp = -2.0 + 0.3 * torch.randn(b, s, generator=gen)
    old = logp + 0.4 * torch.randn(b, s, generator=gen)
    adv = torch.randn(b, 1, generator=gen).expand(b, s).clone()
    mask = torch.rand(b, s, generator=gen) < 0.7
    mask[0] = False  # an empty sequence
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", [0, 2, 3])
@pytest.mark.parametrize(
    "band, seq_band, delta",
    [
        ((0.8, 1.25), None, None),
        (None, (0.9, 1.1), None),
        (None, None, 0.05),
        ((0.7, 1.4), (0.85, 1.15), 0.1),
        ((0.5, math.inf), None, 0.0),
    ],
    ids=["token-band", "sequence-band", "off-policy", "all", "open-band"],
)
def test_keep_mask_matches_reference(seed, band, seq_band, delta):
    logp, old, adv, mask = _data(seed)
    keep, stats = keep_mask(
        logp, old, adv, mask, ratio_band=band, sequence_ratio_band=seq_band,
        offpolicy_kl_threshold=delta,
    )  # fmt: skip
    want = _reference(logp, old, adv, mask, band, seq_band, delta)
    assert torch.equal(keep, want)
    assert stats["kept_token_count"] == want.sum()
    assert stats["loss_token_count"] == mask.sum()
    assert stats["kept_sequence_count"] == want.any(-1).sum()
    assert stats["loss_sequence_count"] == mask.any(-1).sum()
    assert 0 < want.sum() < mask.sum(), "the data must drop some tokens and keep others"


def test_keep_mask_decides_on_detached_values_and_accepts_per_sequence_advantages():
    logp, old, adv, mask = _data(7)
    logp.requires_grad_(True)
    keep, _ = keep_mask(logp, old, adv[:, 0], mask, offpolicy_kl_threshold=0.01)
    assert not keep.requires_grad
    assert torch.equal(keep, _reference(logp.detach(), old, adv, mask, None, None, 0.01))


def test_rl_objective_zeroes_or_hands_over_the_dropped_tokens():
    """Outside a plugin step the dropped tokens are zeroed: the objective equals the one with
    the kept mask as loss mask and the same weights; the masks' counts are reported."""
    logp, old, adv, mask = _data(0)
    obj = RLObjective(ratio_band=(0.8, 1.25), offpolicy_kl_threshold=0.05, kl_coef=0.1)
    ref = old + 0.1
    weights = loss_weights([mask], "token_mean")[0]
    total, stats = rl_objective(logp, old, adv, weights, mask, obj, ref_logprobs=ref)
    keep = _reference(logp, old, adv, mask, (0.8, 1.25), None, 0.05)
    plain = RLObjective(kl_coef=0.1)
    want, _ = rl_objective(logp, old, adv, weights * keep, keep, plain, ref_logprobs=ref)
    assert float(total) == pytest.approx(float(want), rel=1e-6)
    assert stats["kept_token_count"] == keep.sum()
    ratio = (logp - old).exp()
    assert stats["ratio_band_drop_count"] == (mask & ((ratio < 0.8) | (ratio > 1.25))).sum()
    band_only = _reference(logp, old, adv, mask, (0.8, 1.25), None, None)
    dropped_rows = (band_only.any(-1) & ~keep.any(-1)).sum()
    assert stats["offpolicy_drop_count"] >= dropped_rows >= 1


def test_extreme_ratios_of_dropped_tokens_leave_no_nan():
    """A dropped token whose ratio overflows (exp(200)) contributes exactly zero, value and
    gradient: its old log-prob is replaced before the ratio is taken."""
    logp, old, adv, mask = _data(9)
    old[1, :] = -300.0  # ratio exp(~298) overflows in fp32
    logp.requires_grad_(True)
    obj = RLObjective(ratio_band=(0.5, 2.0), entropy_coef=0.01)
    weights = loss_weights([mask], "sequence_mean")[0]
    total, _ = rl_objective(logp, old, adv, weights, mask, obj, entropy=torch.ones_like(logp))
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert (logp.grad[1] == 0).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ratio_band": (1.2, 0.8)}, "ratio_band"),
        ({"ratio_band": (-0.1, 2.0)}, "ratio_band"),
        ({"ratio_band": 1.5}, "ratio_band"),
        ({"sequence_ratio_band": (0.5,)}, "sequence_ratio_band"),
        ({"offpolicy_kl_threshold": -1.0}, "offpolicy_kl_threshold"),
        ({"offpolicy_kl_threshold": math.nan}, "offpolicy_kl_threshold"),
    ],
)
def test_objective_refuses_bad_masks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RLObjective(**kwargs)
