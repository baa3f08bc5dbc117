"""The masks an RL loss decides from the current log-probs: an importance-ratio band (per token
or per sequence) and off-policy sequence masking (docs/design.md §10).

:func:`keep_mask` returns which loss tokens :func:`~megatron_lossfix.rl.objective.rl_objective`
keeps; the objective hands it to :func:`~megatron_lossfix.runtime.mask_in_loss.kept_weights`, so
that with ``LossFixConfig(mask_in_loss=True)`` the dropped tokens leave the normalization and
otherwise their loss is zeroed. Decisions use detached values: a mask carries no gradient. A
sequence is a row (as in GSPO); with context parallelism its statistics are summed over the CP
group, one all-reduce per micro-batch and only where a sequence-level mask is asked for.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_lossfix.rl.policy_losses import at_least_fp32, token_advantages
from megatron_lossfix.runtime.process_groups import group_size

__all__ = ["check_band", "check_threshold", "keep_mask"]


def check_band(name: str, band: object) -> None:
    """Raise ``ValueError`` unless ``band`` is ``None`` or ``(low, high)`` with
    ``0 <= low < high`` (``high`` may be infinite)."""
    if band is None:
        return
    ok = isinstance(band, (tuple, list)) and len(band) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in band)
    if not ok or not (math.isfinite(band[0]) and 0 <= band[0] < band[1]):
        raise ValueError(f"{name} must be (low, high) with 0 <= low < high, got {band!r}")


def check_threshold(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None`` or a finite number >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def keep_mask(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    ratio_band: tuple[float, float] | None = None,
    sequence_ratio_band: tuple[float, float] | None = None,
    offpolicy_kl_threshold: float | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss tokens kept, ``[b, s]`` bool, and the masks' counts (detached fp32 sums).

    * ``ratio_band=(low, high)``: a token whose ratio ``exp(logp - old)`` lies outside
      ``[low, high]`` is dropped;
    * ``sequence_ratio_band=(low, high)``: a sequence whose geometric-mean ratio ``exp(mean over
      its loss tokens of (logp - old))`` lies outside ``[low, high]`` is dropped;
    * ``offpolicy_kl_threshold=delta``: a sequence with a negative advantage (its mean over
      its loss tokens) whose KL to the behaviour policy, ``mean over its loss tokens of
      (old - logp)``, exceeds ``delta`` is dropped (DeepSeek-V3.2's off-policy sequence masking).

    Stats: ``ratio_band_drop_count`` (tokens), ``sequence_band_drop_count`` and
    ``offpolicy_drop_count`` (sequences), ``loss_token_count``, ``kept_token_count``, and where
    sequences are known whole (no CP, or a sequence-level mask) ``loss_sequence_count`` and
    ``kept_sequence_count``; sequences are counted on CP rank 0 only.
    """
    mask = loss_mask.bool()
    logp = at_least_fp32(logprobs.detach())
    log_ratio = torch.where(mask, logp - at_least_fp32(old_logprobs.detach()), 0.0)
    keep = mask
    stats = {"loss_token_count": mask.sum()}
    if ratio_band is not None:
        ratio = torch.exp(log_ratio)
        inside = (ratio >= ratio_band[0]) & (ratio <= ratio_band[1])
        stats["ratio_band_drop_count"] = (mask & ~inside).sum()
        keep = keep & inside
    sequence_masks = sequence_ratio_band is not None or offpolicy_kl_threshold is not None
    cp = group_size(cp_group)
    if sequence_masks or cp == 1:
        adv = token_advantages(advantages, logp).detach().to(log_ratio.dtype)
        per_seq = torch.stack(
            [
                log_ratio.sum(-1),
                mask.sum(-1).to(log_ratio.dtype),
                torch.where(mask, adv, 0.0).sum(-1),
                keep.sum(-1).to(log_ratio.dtype),
            ]
        )
        if sequence_masks and cp > 1:
            dist.all_reduce(per_seq, group=cp_group)
        log_ratio_sum, tokens, adv_sum, kept_tokens = per_seq
        has_tokens = tokens > 0
        mean_log_ratio = log_ratio_sum / tokens.clamp(min=1)
        dropped = torch.zeros_like(has_tokens)
        if sequence_ratio_band is not None:
            seq_ratio = torch.exp(mean_log_ratio)
            outside = (seq_ratio < sequence_ratio_band[0]) | (seq_ratio > sequence_ratio_band[1])
            stats["sequence_band_drop_count"] = (has_tokens & outside).sum()
            dropped = dropped | outside
        if offpolicy_kl_threshold is not None:
            negative = adv_sum / tokens.clamp(min=1) < 0
            off_policy = negative & (-mean_log_ratio > offpolicy_kl_threshold)
            stats["offpolicy_drop_count"] = (has_tokens & off_policy).sum()
            dropped = dropped | off_policy
        keep = keep & ~dropped[:, None]
        stats["loss_sequence_count"] = has_tokens.sum()
        stats["kept_sequence_count"] = ((kept_tokens > 0) & ~dropped).sum()
        if cp > 1 and dist.get_rank(cp_group) != 0:  # a sequence lives on every CP rank
            for key in ("sequence_band_drop_count", "offpolicy_drop_count"):
                if key in stats:
                    stats[key] = stats[key] * 0
            stats["loss_sequence_count"] = stats["loss_sequence_count"] * 0
            stats["kept_sequence_count"] = stats["kept_sequence_count"] * 0
    stats["kept_token_count"] = keep.sum()
    return keep, {k: v.detach().float() for k, v in stats.items()}
