"""Per-token policy-gradient losses: PPO (with asymmetric and dual clipping), GSPO's sequence
ratio, and the k1/k2/k3 KL penalties -- the pieces
:func:`megatron_lossfix.rl.objective.rl_objective` assembles.

Each returns a per-token ``[b, s]`` quantity (Tinker semantics, docs/design.md §2): the step's
loss is its plain weighted sum with the plugin's per-token weights, never a mean. Ratios and
exponentials are computed in at least fp32; nothing here synchronizes with the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "KL_KINDS",
    "POLICY_LOSSES",
    "at_least_fp32",
    "check_eps",
    "check_same_shape",
    "gspo_token_loss",
    "kl_penalty",
    "ppo_token_loss",
    "token_advantages",
]

KL_KINDS = ("k1", "k2", "k3")
POLICY_LOSSES = ("ppo", "gspo")


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    # Ratios and exps are computed in at least fp32 even for bf16 inputs: exp(logp - old) in bf16
    # is off by ~1% and would flip clip decisions.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence ``[b]`` advantages to ``like``'s ``[b, s]``; check shapes."""
    if advantages.shape == like.shape:
        return advantages
    if advantages.dim() == like.dim() - 1 and advantages.shape == like.shape[:-1]:
        return advantages.unsqueeze(-1)
    raise ValueError(
        f"advantages {tuple(advantages.shape)} must be per-token {tuple(like.shape)} "
        f"or per-sequence {tuple(like.shape[:-1])}"
    )


def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def check_eps(eps_low: float, eps_high: float) -> None:
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip epsilons must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")


def _clipped_pg(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's pessimistic clipped surrogate for a given (differentiable) ratio.

    A branch is "active" where it is the one selected by the max/min, strictly: on ties both
    branches have the same value and the same gradient, so the unclipped one is reported.
    """
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    # clipped > unclipped happens only for A > 0, ratio > 1 + eps_high (clip high) or
    # A < 0, ratio < 1 - eps_low (clip low); there the loss is constant in ratio.
    clip_active = clipped > unclipped
    pg = torch.where(clip_active, clipped, unclipped)
    r = ratio.detach()
    clip_low = clip_active & (r < 1.0)
    clip_high = clip_active & (r > 1.0)
    if dual_clip_c is None:
        dual = torch.zeros_like(clip_active)
    else:
        # Dual clip bounds the loss of negative-advantage tokens whose ratio exploded: pg <= -A*c.
        lower = -adv * dual_clip_c
        dual = (adv < 0) & (pg > lower)
        pg = torch.where(dual, lower.expand_as(pg), pg)
    indicators = {
        "clip_low": clip_low.to(r.dtype),
        "clip_high": clip_high.to(r.dtype),
        "dual_clip": dual.to(r.dtype),
        "ratio": r,
    }
    return pg, indicators


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token (dual-clip) PPO loss ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``.

    With ``dual_clip_c`` (> 1), negative-advantage tokens are further bounded: ``min(pg, -A c)``.

    Args:
        logprobs: ``[b, s]`` current log-probs (differentiable).
        old_logprobs: ``[b, s]`` behaviour-policy log-probs (treated as constants).
        advantages: ``[b, s]`` per token or ``[b]`` per sequence (broadcast over tokens).

    Returns:
        ``(per_token_loss, indicators)``: the loss ``[b, s]`` (fp32, or fp64 for fp64 inputs) and
        detached ``[b, s]`` float tensors ``clip_low`` (A < 0 and r < 1-eps_low: clipped branch
        active), ``clip_high`` (A > 0 and r > 1+eps_high), ``dual_clip`` (A < 0 and -A r > -A c,
        i.e. r > c) and ``ratio``.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs)
    check_eps(eps_low, eps_high)
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    adv = at_least_fp32(token_advantages(advantages, logprobs).detach())
    ratio = torch.exp(at_least_fp32(logprobs) - at_least_fp32(old_logprobs).detach())
    return _clipped_pg(ratio, adv, eps_low, eps_high, dual_clip_c)


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO with a sequence-level ratio, in the GSPO-token form.

    ``s_i = exp(mean over loss tokens of sequence i of (logp - old))``; each token uses
    ``s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])``, whose value is ``s_i`` and whose gradient
    is ``s_i * d logp_t``. The clipped objective ``max(-A s_i,t, -A clip(s_i,t))`` is broadcast to
    every token, so with ``sequence_mean`` weights ``m / (S n_s)`` the weighted sum is the GSPO
    paper's ``(1/S) sum_i max(-A_i s_i, -A_i clip(s_i))``, value and gradient.

    With context parallelism the sequence is split over ``cp_group``: the per-sequence sum of log
    ratios and token count are all-reduced there. Because ``s_i`` enters only through a stop-grad,
    no gradient crosses CP ranks, so a plain all-reduce of detached values gives exact gradients
    (an autograd-aware all-reduce would add a backward collective that only carries zeros).

    Off-mask tokens get loss 0 and zero gradient; sequences with no loss tokens get ``s_i = 1``.

    Returns:
        ``(per_token_loss, indicators)`` as :func:`ppo_token_loss`, with ``ratio`` the sequence
        ratio broadcast to tokens.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, loss_mask=loss_mask)
    check_eps(eps_low, eps_high)
    adv = at_least_fp32(token_advantages(advantages, logprobs).detach())
    mask = loss_mask.bool()
    logp = at_least_fp32(logprobs)
    # Masked positions may hold garbage (padding); zero their log ratio before any exp so neither
    # the value nor the gradient can become NaN there.
    old = at_least_fp32(old_logprobs).detach()
    log_ratio = torch.where(mask, logp - old, torch.zeros_like(logp))
    seq_stats = torch.stack([log_ratio.detach().sum(-1), mask.to(logp.dtype).sum(-1)])
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(seq_stats, op=dist.ReduceOp.SUM, group=cp_group)
    seq_log_ratio = seq_stats[0] / seq_stats[1].clamp(min=1.0)
    token_log_ratio = seq_log_ratio.unsqueeze(-1) + (log_ratio - log_ratio.detach())
    pg, indicators = _clipped_pg(torch.exp(token_log_ratio), adv, eps_low, eps_high, None)
    # Off-mask tokens (and so zero-token sequences) contribute exactly 0, whatever the weights.
    return torch.where(mask, pg, torch.zeros_like(pg)), indicators


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimator from Schulman's "Approximating KL divergence".

    ``k1 = logp - ref``; ``k2 = (logp - ref)^2 / 2``; ``k3 = exp(ref - logp) - (ref - logp) - 1``
    (unbiased and non-negative). ``ref_logprobs`` is treated as a constant.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    diff = at_least_fp32(logprobs) - at_least_fp32(ref_logprobs).detach()
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    return torch.expm1(-diff) + diff  # exp(-d) - 1 + d, without cancellation for small d
