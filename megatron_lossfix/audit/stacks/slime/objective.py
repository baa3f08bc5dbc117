"""``--stack slime``: the exact objective each of slime's settings means, written out here and
differentiated on one rank, in one forward pass (the reference of every row).

Per token of a sample with current log-prob ``logp``, old ``old``, reference ``ref``, rollout
``roll`` and advantage ``a`` (the sample's):

* the ratio ``r = exp(logp - old)``; ``gspo``: the sequence's ``exp(mean(logp - old))`` over its
  loss tokens, on each of them;
* the policy term ``pg = max(-r a, -clip(r, 1 - 0.2, 1 + 0.28) a)``; ``tis``: times
  ``min(exp(old - roll), tis_clip)``; the entropy ``H`` and the ``low_var_kl``
  ``kl = exp(ref - logp) - 1 - (ref - logp)``;
* the loss ``sum(w (pg k_pg - 0.05 H + 0.1 kl) k)``, with the plugin's weights ``w`` of the mode.

Tokens the loss drops: ``tis`` rejects those whose ratio old/rollout lies outside the band, in
every term (``k``); ``opsm`` drops the policy term (``k_pg``) of a sequence with a negative
advantage and a mean ``old - logp`` above ``opsm_delta``. Two meanings (docs/masks_in_loss.md):

* zeroed (slime's, and the adapter's default): ``w`` are the weights of the loss masks, the
  dropped tokens' terms zeroed;
* excluded (``--lossfix-mask-in-loss``, the ``slime+lossfix+mask-in-loss`` row): ``w`` are the
  mode's weights of the kept tokens alone (loss mask times ``k`` times ``k_pg``), which leave
  every term.

slime's default setting divides by every rollout of the step, the plugin by those with a loss
token: slime's reference is the zeroed one times :func:`slime_share`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.slime import batch as sb

__all__ = ["slime_reference", "slime_references", "slime_share"]


def _sample_terms(
    data: dict[str, Any], i: int, logp: torch.Tensor, entropy: torch.Tensor, setting: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``i``'s per-token loss ``pg k_pg - 0.05 H + 0.1 kl`` (zeroed meaning), and its
    kept masks ``k`` (every term) and ``k_pg`` (the policy term)."""
    mask, old, a = data["loss_masks"][i].float(), data["log_probs"][i], data["advantages"][i]
    keep_all, keep_pg = torch.ones_like(old), torch.ones_like(old)
    log_ratio = logp - old
    if setting == "gspo":
        seq = (log_ratio * mask).sum() / mask.sum().clamp(min=1)
        log_ratio = seq.expand_as(logp)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-ratio * a, -ratio.clamp(1 - sb.EPS_CLIP, 1 + sb.EPS_CLIP_HIGH) * a)
    if setting == "tis":
        tis = torch.exp(old - data["rollout_log_probs"][i])
        pg = pg * tis.clamp(0.0, sb.TIS_CLIP)
        keep_all = sb.tis_keep(tis).float()
    if setting == "opsm":
        seq_kl = ((old - logp.detach()) * mask).sum() / mask.sum().clamp(min=1)
        dropped = bool(a[0] < 0) and bool(seq_kl > sb.OPSM_DELTA)
        keep_pg = torch.zeros_like(old) if dropped else keep_pg
    d = data["ref_log_probs"][i] - logp
    kl = (torch.exp(d) - 1 - d).clamp(-10, 10)
    terms = (pg * keep_pg - sb.ENTROPY_COEF * entropy + sb.KL_COEF * kl) * keep_all
    return terms, keep_all, keep_pg


def slime_reference(
    case: OracleCase, mode: str, setting: str = "ppo", excluded: bool = False
) -> dict[str, torch.Tensor]:
    """One rank, one forward pass: the gradient of the exact objective of ``mode`` and
    ``setting`` (module docstring; ``excluded``: the dropped tokens leave the normalization)."""
    from megatron_lossfix.audit.tiny_gpt import gather_full_grads, one_rank_tiny_gpt
    from megatron_lossfix.runtime.losses import loss_weights

    model, config = one_rank_tiny_gpt(case)
    data = sb.slime_rollout(case, config.vocab_size, mode)
    tokens = torch.cat(data["tokens"])[None]
    logp_all = torch.log_softmax(model(tokens, None, None).float()[0], dim=-1)
    rows, width = len(data["tokens"]), max(data["response_lengths"])
    mask, terms = torch.zeros(rows, width), torch.zeros(rows, width)
    at = 0
    for i in range(rows):
        t, r = data["total_lengths"][i], data["response_lengths"][i]
        # Response token j of sample i is predicted at position at + t - r - 1 + j.
        pos = torch.arange(at + t - r - 1, at + t - 1)
        logp = logp_all[pos].gather(-1, tokens[0, pos + 1, None]).squeeze(-1)
        entropy = -(logp_all[pos].exp() * logp_all[pos]).sum(-1)
        term, keep_all, keep_pg = _sample_terms(data, i, logp, entropy, setting)
        kept = keep_all * keep_pg if excluded else torch.ones_like(keep_all)
        mask[i, :r] = data["loss_masks"][i].float() * kept
        terms = terms.index_put((torch.tensor([i]), torch.arange(r)), term)
        at += t
    plugin_mode = sb.MODES[mode].plugin_mode
    kwargs: dict[str, Any] = {"rank_local": True}
    if plugin_mode == "group_mean":
        ids = torch.tensor(data["rollout_ids"])
        kwargs.update(group_ids=[ids], num_groups=data["num_rollouts"])
    (w,) = loss_weights([mask], plugin_mode, **kwargs)
    (w * terms).sum().backward()
    model.finish_grad_sync()
    return gather_full_grads([model])


def slime_share(case: OracleCase, mode: str) -> float:
    """What slime's default setting weighs against the plugin's: rollouts with a loss token
    over all rollouts (1 for the per-token setting)."""
    if not sb.MODES[mode].divides_by_batch_size:
        return 1.0
    data = sb.slime_rollout(case, 264, mode)
    kept = {r for r, m in zip(data["rollout_ids"], data["loss_masks"], strict=True) if m.any()}
    return len(kept) / data["num_rollouts"]


def slime_references(
    case: OracleCase, wanted: list[tuple[str, str, bool]]
) -> dict[tuple[str, str, bool], dict[str, torch.Tensor]]:
    """:func:`slime_reference` of each ``(mode, setting, excluded)`` in ``wanted``, in one
    rank's process (one pool call for all)."""
    return {key: slime_reference(case, *key) for key in wanted}
