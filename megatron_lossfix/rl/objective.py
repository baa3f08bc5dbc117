"""The RL objective (:class:`RLObjective`, :func:`rl_objective`), its Megatron ``loss_func``
(:func:`rl_loss`) and GRPO advantages. The per-token policy losses it assembles (PPO, dual-clip
PPO, GSPO, KL penalties) are in :mod:`megatron_lossfix.rl.policy_losses`, re-exported here.

Tinker semantics (docs/design.md §2): every loss here is a per-token quantity, and the step's loss
is the plain weighted sum ``sum(weights * per_token_loss)`` with the plugin's globally normalized
per-token ``weights`` -- never a mean. Regularizers (KL, entropy) use the same weights, so the whole
objective is invariant to how the mini-batch is split over micro-batches and ranks.

Statistics are returned as 0-dim tensors that are plain sums (or min / max), named by how they
reduce across ranks: ``*_sum`` and ``*_count`` sum, ``*_min`` min, ``*_max`` max, the rule that
``LossFixSchedule.step_metrics()`` applies (it leaves ``num_tokens`` out and
counts tokens itself). Nothing here calls ``.item()`` or branches on tensor values, so the hot
path never synchronizes with the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.rl.logprobs import vocab_parallel_logprobs_entropy
from megatron_lossfix.rl.masks import check_band, check_threshold, keep_mask
from megatron_lossfix.rl.policy_losses import (
    KL_KINDS,
    POLICY_LOSSES,
    at_least_fp32,
    check_eps,
    check_same_shape,
    gspo_token_loss,
    kl_penalty,
    ppo_token_loss,
    token_advantages,
)
from megatron_lossfix.runtime.mask_in_loss import kept_weights, weighted_stats

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


@dataclass(kw_only=True, slots=True)
class RLObjective:
    """The hyper-parameters of [`rl_objective`][megatron_lossfix.rl_objective]: which policy
    loss, its clipping, and the weights of the KL and entropy terms."""

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

    ratio_band: tuple[float, float] | None = None
    """Importance-ratio band per token, ``(low, high)``: a loss token whose ratio
    ``exp(logp - old)`` lies outside it is dropped (``megatron_lossfix.rl.masks``)."""

    sequence_ratio_band: tuple[float, float] | None = None
    """The same per sequence, on its geometric-mean ratio: the whole sequence is dropped."""

    offpolicy_kl_threshold: float | None = None
    """Off-policy sequence masking: a sequence with a negative advantage whose KL to the
    behaviour policy (mean over its loss tokens of ``old - logp``) exceeds this is dropped."""

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"unknown policy_loss {self.policy_loss!r}; expected one of {POLICY_LOSSES}"
            )
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"unknown KL kind {self.kl_kind!r}; expected one of {KL_KINDS}")
        if self.policy_loss != "ppo" and self.dual_clip_c is not None:
            raise ValueError("dual_clip_c is only supported with policy_loss='ppo'")
        check_eps(self.eps_low, self.eps_high)
        check_band("ratio_band", self.ratio_band)
        check_band("sequence_ratio_band", self.sequence_ratio_band)
        check_threshold("offpolicy_kl_threshold", self.offpolicy_kl_threshold)

    @property
    def mask_options(self) -> dict[str, Any]:
        """The options of ``megatron_lossfix.rl.masks.keep_mask`` this objective sets."""
        return {
            "ratio_band": self.ratio_band,
            "sequence_ratio_band": self.sequence_ratio_band,
            "offpolicy_kl_threshold": self.offpolicy_kl_threshold,
        }

    @property
    def masks(self) -> bool:
        """Whether the objective decides a mask from the current log-probs."""
        return any(value is not None for value in self.mask_options.values())


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
        logprobs: ``[b, s]`` log-probs of the current policy.
        old_logprobs: ``[b, s]`` log-probs of the policy that sampled the rollouts.
        advantages: ``[b, s]`` or ``[b]``.
        weights: ``[b, s]`` plugin weights (globally normalized, zero off the loss mask).
        loss_mask: ``[b, s]`` 0/1 (or bool) mask of loss tokens; used for counts and to keep
            garbage on masked positions (padding) out of the loss.
        objective: the policy loss and its coefficients (default: PPO, clip 0.2, no KL, no
            entropy bonus).
        ref_logprobs: ``[b, s]`` reference-policy log-probs, for the KL penalty.
        entropy: per-token entropy ``[b, s]`` (e.g. from
            [`vocab_parallel_logprobs_entropy`][megatron_lossfix.vocab_parallel_logprobs_entropy]),
            for the bonus.
        cp_group: GSPO's sequence ratio when sequences are split over context-parallel ranks.

    Returns:
        ``(weighted_sum, stats)``; every stat is a detached 0-dim fp32 tensor, a plain sum unless
        its name ends in ``_min``/``_max``: ``pg_loss_sum``, ``kl_sum``, ``entropy_sum``
        (weighted by ``weights``), ``clip_low_count``, ``clip_high_count``, ``dual_clip_count``,
        ``ratio_sum``, ``ratio_min``, ``ratio_max``, ``num_tokens`` (over the kept loss tokens,
        unweighted); with the objective's masks also their counts (``rl.masks.keep_mask``).

    The objective's masks (``ratio_band``, ``sequence_ratio_band``, ``offpolicy_kl_threshold``)
    go through [`kept_weights`][megatron_lossfix.kept_weights]: dropped tokens are zeroed, or leave
    the normalization under ``LossFixConfig(mask_in_loss=True)`` (docs/design.md §10).
    """
    obj = RLObjective() if objective is None else objective
    _check_inputs(obj, logprobs, old_logprobs, weights, loss_mask, ref_logprobs, entropy)
    mask = loss_mask.bool()
    logp_const = logprobs.detach()
    keep, keep_stats = mask, {}
    if obj.masks:
        old = torch.where(mask, old_logprobs, logp_const)
        keep, keep_stats = keep_mask(
            logprobs, old, advantages, mask, cp_group=cp_group, **obj.mask_options
        )
    w = at_least_fp32(kept_weights(weights.detach(), keep if obj.masks else None))
    weighted_stats("pg_loss_sum", "kl_sum", "entropy_sum")
    # Padding and dropped tokens may carry any old/ref log-prob (0, -inf, NaN, a ratio that
    # overflows); replacing it by the current log-prob makes the ratio 1 and the KL 0 there,
    # so 0-weight tokens cannot inject NaN via 0 * inf, in the value or the gradient.
    old = torch.where(keep, old_logprobs, logp_const)
    clip = {"eps_low": obj.eps_low, "eps_high": obj.eps_high}
    if obj.policy_loss == "ppo":
        pg, ind = ppo_token_loss(logprobs, old, advantages, dual_clip_c=obj.dual_clip_c, **clip)
    else:
        pg, ind = gspo_token_loss(logprobs, old, advantages, keep, cp_group=cp_group, **clip)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(keep, ref_logprobs, logp_const)
    total, kl_sum, entropy_sum = _regularized(pg, w, keep, obj, logprobs, ref_logprobs, entropy)
    stats = _rl_stats(pg, w, keep, ind)
    stats.update(kl_sum=kl_sum.detach().float(), entropy_sum=entropy_sum.detach().float())
    stats.update(keep_stats)
    return (w * total).sum(), stats


def _check_inputs(
    obj: RLObjective,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    weights: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> None:
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, weights=weights, loss_mask=loss_mask
    )
    if obj.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if obj.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if ref_logprobs is not None:
        check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    if entropy is not None:
        check_same_shape(logprobs=logprobs, entropy=entropy)


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
        ent = torch.where(mask, at_least_fp32(entropy), torch.zeros_like(pg))
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
    if ratio.numel():
        ratio_min = torch.where(mask, ratio, inf).amin()
        ratio_max = torch.where(mask, ratio, -inf).amax()
    else:  # neutral elements, filled on the device (a tensor built from a host value is a
        # copy to the device, which waits for the stream: a host sync per micro-batch)
        ratio_min = ratio.new_full((), float("inf"))
        ratio_max = -ratio_min
    stats = {
        "pg_loss_sum": (w * pg.detach()).sum(),
        "clip_low_count": (fmask * ind["clip_low"]).sum(),
        "clip_high_count": (fmask * ind["clip_high"]).sum(),
        "dual_clip_count": (fmask * ind["dual_clip"]).sum(),
        "ratio_sum": (fmask * ratio).sum(),
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
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

    ``batch`` holds ``labels``, ``loss_mask``, ``loss_weights`` (the plugin's weights; absent
    under ``off``, where the loss mask is the weight), ``old_logprobs`` and ``advantages``;
    optionally ``ref_logprobs`` (for a KL term) and ``has_old_logprobs`` (0 where no old
    log-prob was recorded: the current one, detached, stands in, ratio 1). Log-probs and
    entropies come from :func:`megatron_lossfix.rl.logprobs.vocab_parallel_logprobs_entropy` of
    ``logits / temperature`` (TP-correct); ``objective`` is an :class:`RLObjective` (or the keyword
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
    weights = batch.get("loss_weights", batch["loss_mask"])  # `off`: stock's weight, the mask
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
    r = at_least_fp32(rewards) if rewards.is_floating_point() else rewards.float()
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
    return token_advantages(advantages, weights) * weights
