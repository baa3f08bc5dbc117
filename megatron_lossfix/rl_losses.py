"""Policy-gradient losses (PPO, dual-clip PPO, GSPO), KL penalties and GRPO advantages.

Tinker semantics (docs/design.md §2): every loss here is a per-token quantity, and the step's loss
is the plain weighted sum ``sum(weights * per_token_loss)`` with the plugin's globally normalized
per-token ``weights`` -- never a mean. Regularizers (KL, entropy) use the same weights, so the whole
objective is invariant to how the mini-batch is split over micro-batches and ranks.

Statistics are returned as 0-dim tensors that are plain sums (or min / max), named by how they
reduce across ranks: ``*_sum`` and ``*_count`` sum, ``*_min`` min, ``*_max`` max, the rule that
``step_metrics()`` applies (:mod:`megatron_lossfix.metrics`; it leaves ``num_tokens`` out and
counts tokens itself). Nothing here calls ``.item()`` or branches on tensor values, so the hot
path never synchronizes with the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.logprobs import vocab_parallel_logprobs_entropy

__all__ = [
    "KL_KINDS",
    "POLICY_LOSSES",
    "RLObjective",
    "gspo_token_loss",
    "grpo_advantages",
    "kl_penalty",
    "ppo_token_loss",
    "rl_loss",
    "rl_objective",
    "scale_advantages",
]

KL_KINDS = ("k1", "k2", "k3")
POLICY_LOSSES = ("ppo", "gspo")


def _acc(x: torch.Tensor) -> torch.Tensor:
    # Ratios and exps are computed in at least fp32 even for bf16 inputs: exp(logp - old) in bf16
    # is off by ~1% and would flip clip decisions.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence ``[b]`` advantages to ``like``'s ``[b, s]``; check shapes."""
    if advantages.shape == like.shape:
        return advantages
    if advantages.dim() == like.dim() - 1 and advantages.shape == like.shape[:-1]:
        return advantages.unsqueeze(-1)
    raise ValueError(
        f"advantages {tuple(advantages.shape)} must be per-token {tuple(like.shape)} "
        f"or per-sequence {tuple(like.shape[:-1])}"
    )


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def _check_eps(eps_low: float, eps_high: float) -> None:
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
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs)
    _check_eps(eps_low, eps_high)
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    adv = _acc(_token_advantages(advantages, logprobs).detach())
    ratio = torch.exp(_acc(logprobs) - _acc(old_logprobs).detach())
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
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, loss_mask=loss_mask)
    _check_eps(eps_low, eps_high)
    adv = _acc(_token_advantages(advantages, logprobs).detach())
    mask = loss_mask.bool()
    logp = _acc(logprobs)
    # Masked positions may hold garbage (padding); zero their log ratio before any exp so neither
    # the value nor the gradient can become NaN there.
    log_ratio = torch.where(mask, logp - _acc(old_logprobs).detach(), torch.zeros_like(logp))
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
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    diff = _acc(logprobs) - _acc(ref_logprobs).detach()
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    return torch.expm1(-diff) + diff  # exp(-d) - 1 + d, without cancellation for small d


@dataclass(kw_only=True, slots=True)
class RLObjective:
    """The hyper-parameters of :func:`rl_objective`: which policy loss, its clipping, and the
    weights of the KL and entropy terms."""

    policy_loss: str = "ppo"
    """``"ppo"`` (token ratio, optional dual clip) or ``"gspo"`` (sequence ratio)."""

    eps_low: float = 0.2
    """Lower clip: the ratio is clipped at ``1 - eps_low`` (``>= 0``)."""

    eps_high: float = 0.2
    """Upper clip: the ratio is clipped at ``1 + eps_high`` (``>= 0``; DAPO's clip-higher
    uses a larger value than ``eps_low``)."""

    dual_clip_c: float | None = None
    """Dual-clip PPO's bound on the loss of negative-advantage tokens (``> 1``); PPO only."""

    kl_coef: float = 0.0
    """Weight of the KL penalty toward the reference policy; non-zero needs ``ref_logprobs``."""

    kl_kind: str = "k3"
    """KL estimator: ``k1``, ``k2`` or ``k3`` (Schulman's)."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus; non-zero needs ``entropy``."""

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"unknown policy_loss {self.policy_loss!r}; expected one of {POLICY_LOSSES}"
            )
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"unknown KL kind {self.kl_kind!r}; expected one of {KL_KINDS}")
        if self.policy_loss != "ppo" and self.dual_clip_c is not None:
            raise ValueError("dual_clip_c is only supported with policy_loss='ppo'")
        _check_eps(self.eps_low, self.eps_high)


def rl_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    loss_mask: torch.Tensor,
    objective: RLObjective | None = None,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted RL objective ``sum(w * (pg + kl_coef * KL - entropy_coef * H))`` and its stats.

    Args:
        logprobs, old_logprobs: ``[b, s]``; ``advantages``: ``[b, s]`` or ``[b]``.
        weights: ``[b, s]`` plugin weights (globally normalized, zero off the loss mask).
        loss_mask: ``[b, s]`` 0/1 (or bool) mask of loss tokens; used for counts and to keep
            garbage on masked positions (padding) out of the loss.
        objective: the policy loss and its coefficients (default: PPO, clip 0.2, no KL, no
            entropy bonus).
        ref_logprobs: ``[b, s]`` reference-policy log-probs, for the KL penalty.
        entropy: per-token entropy ``[b, s]`` (e.g. from
            :func:`megatron_lossfix.logprobs.vocab_parallel_logprobs_entropy`), for the bonus.
        cp_group: GSPO's sequence ratio when sequences are split over context-parallel ranks.

    Returns:
        ``(weighted_sum, stats)``; every stat is a detached 0-dim fp32 tensor, a plain sum unless
        its name ends in ``_min``/``_max``: ``pg_loss_sum``, ``kl_sum``, ``entropy_sum``
        (weighted by ``weights``), ``clip_low_count``, ``clip_high_count``, ``dual_clip_count``,
        ``ratio_sum``, ``ratio_min``, ``ratio_max``, ``num_tokens`` (over loss tokens, unweighted).
    """
    obj = RLObjective() if objective is None else objective
    _check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, weights=weights, loss_mask=loss_mask
    )
    if obj.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if obj.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    mask = loss_mask.bool()
    # Padding may carry any old/ref log-prob (0, -inf, NaN); replacing it by the current log-prob
    # makes the ratio 1 and the KL 0 there, so 0-weight tokens cannot inject NaN via 0 * inf.
    logp_const = logprobs.detach()
    old = torch.where(mask, old_logprobs, logp_const)
    if obj.policy_loss == "ppo":
        pg, ind = ppo_token_loss(
            logprobs,
            old,
            advantages,
            eps_low=obj.eps_low,
            eps_high=obj.eps_high,
            dual_clip_c=obj.dual_clip_c,
        )
    else:
        pg, ind = gspo_token_loss(
            logprobs,
            old,
            advantages,
            mask,
            eps_low=obj.eps_low,
            eps_high=obj.eps_high,
            cp_group=cp_group,
        )
    w = _acc(weights).detach()
    if ref_logprobs is not None:
        _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
        ref_logprobs = torch.where(mask, ref_logprobs, logp_const)
    total, kl_sum, entropy_sum = _regularized(pg, w, mask, obj, logprobs, ref_logprobs, entropy)
    stats = _rl_stats(pg, w, mask, ind)
    stats.update(kl_sum=kl_sum.detach().float(), entropy_sum=entropy_sum.detach().float())
    return (w * total).sum(), stats


def _regularized(
    pg: torch.Tensor,
    w: torch.Tensor,
    mask: torch.Tensor,
    obj: RLObjective,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``pg + kl_coef * KL - entropy_coef * H`` (0 off the mask), and the weighted
    sums of KL and H."""
    total = pg
    zero = torch.zeros((), dtype=pg.dtype, device=pg.device)
    kl_sum = entropy_sum = zero
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, obj.kl_kind)
        total = total + obj.kl_coef * kl
        kl_sum = (w * kl.detach()).sum()
    if entropy is not None:
        _check_same_shape(logprobs=logprobs, entropy=entropy)
        ent = torch.where(mask, _acc(entropy), torch.zeros_like(pg))
        total = total - obj.entropy_coef * ent
        entropy_sum = (w * ent.detach()).sum()
    # where() rather than relying on w == 0 alone: a NaN entropy on padding would survive 0 * NaN.
    return torch.where(mask, total, torch.zeros_like(total)), kl_sum, entropy_sum


def _rl_stats(
    pg: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, ind: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The policy-loss statistics (see :func:`rl_objective`), detached fp32."""
    fmask = mask.to(pg.dtype)
    ratio = ind["ratio"]
    inf = torch.full_like(ratio, float("inf"))
    no_inf = torch.tensor(float("inf"), device=ratio.device)  # neutral elements for empty inputs
    stats = {
        "pg_loss_sum": (w * pg.detach()).sum(),
        "clip_low_count": (fmask * ind["clip_low"]).sum(),
        "clip_high_count": (fmask * ind["clip_high"]).sum(),
        "dual_clip_count": (fmask * ind["dual_clip"]).sum(),
        "ratio_sum": (fmask * ratio).sum(),
        "ratio_min": torch.where(mask, ratio, inf).amin() if ratio.numel() else no_inf,
        "ratio_max": torch.where(mask, ratio, -inf).amax() if ratio.numel() else -no_inf,
        "num_tokens": fmask.sum(),
    }
    return {k: v.detach().float() for k, v in stats.items()}


def rl_loss(
    batch: Mapping[str, torch.Tensor],
    logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    objective: RLObjective | Mapping[str, Any] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron ``loss_func`` of :func:`rl_objective` for ``GPTModel``'s vocab-parallel logits
    ``[b, s, V/TP]`` (the model called without labels). Bind all but the output first:
    ``partial(rl_loss, batch, tp_group=..., cp_group=..., objective=RLObjective(...))``.

    ``batch`` holds ``labels``, ``loss_mask``, ``loss_weights`` (the plugin's weights; stock
    Megatron code passes the loss mask), ``old_logprobs`` and ``advantages``; optionally
    ``ref_logprobs`` (for a KL term) and ``has_old_logprobs`` (0 where no old log-prob was
    recorded: the current one, detached, stands in, ratio 1). Log-probs and entropies come from
    :func:`megatron_lossfix.logprobs.vocab_parallel_logprobs_entropy` of ``logits /
    temperature`` (TP-correct); ``objective`` is an :class:`RLObjective` (or the keyword
    arguments of one, as flags give them). Returns Megatron's 3-tuple ``(sum(w * objective),
    loss tokens on this rank, stats)``; ``step_metrics()`` reduces the stats over DP x CP.
    """
    if temperature != 1.0:
        logits = logits.float() / temperature  # the policy that sampled is softmax(logits / T)
    logprobs, entropy = vocab_parallel_logprobs_entropy(logits, batch["labels"], tp_group=tp_group)
    old = batch["old_logprobs"]
    if "has_old_logprobs" in batch:
        old = torch.where(batch["has_old_logprobs"] > 0, old, logprobs.detach())
    if objective is not None and not isinstance(objective, RLObjective):
        objective = RLObjective(**objective)
    weights = batch["loss_weights"]
    loss, stats = rl_objective(
        logprobs,
        old,
        batch["advantages"],
        weights,
        batch["loss_mask"],
        objective,
        ref_logprobs=batch.get("ref_logprobs"),
        entropy=entropy,
        cp_group=cp_group,
    )
    return loss, (weights != 0).sum(dtype=torch.int), stats


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: reward minus its prompt group's mean, optionally over (std + eps).

    Give groups either as ``group_size`` (consecutive blocks of that many sequences) or as
    ``group_ids`` (``[num_seqs]`` integer labels, any order). ``scale_by_std=False`` is Dr. GRPO.
    The std is the unbiased (Bessel-corrected) sample std, as in TRL and verl; a group of one gets
    advantage 0. With ``group_ids`` the number of groups is data-dependent (one host sync); this
    runs once per rollout batch, not per micro-batch.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_seqs], got shape {tuple(rewards.shape)}")
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size or group_ids")
    r = _acc(rewards) if rewards.is_floating_point() else rewards.float()
    n = r.shape[0]
    if group_size is not None:
        if group_size < 1 or n % group_size != 0:
            raise ValueError(f"group_size {group_size} must be >= 1 and divide {n} rewards")
        ids = torch.arange(n, device=r.device) // group_size
        num_groups = n // group_size
    else:
        if group_ids.shape != r.shape or group_ids.is_floating_point():
            raise ValueError(
                f"group_ids must be an integer tensor of shape {tuple(r.shape)}, "
                f"got {group_ids.dtype} {tuple(group_ids.shape)}"
            )
        labels, ids = torch.unique(group_ids, return_inverse=True)
        num_groups = labels.numel()
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, ids, torch.ones_like(r)
    )
    mean = torch.zeros_like(count).index_add_(0, ids, r) / count
    centered = r - mean[ids]
    if not scale_by_std:
        return centered
    sq = torch.zeros_like(count).index_add_(0, ids, centered.square())
    std = (sq / (count - 1).clamp(min=1.0)).sqrt()
    return centered / (std[ids] + eps)


def scale_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Tinker-style normalized advantages ``A * w`` (per-sequence ``[b]`` A broadcast to tokens).

    ``sum(-scale_advantages(A, w) * ratio) == sum(w * -A * ratio)``: a plain sum of the result is
    the normalized loss, so the normalization can ride on the advantages instead of the loss.
    """
    return _token_advantages(advantages, weights) * weights
