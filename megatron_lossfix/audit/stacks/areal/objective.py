"""``--stack areal``: the exact objective of each of AReaL's settings, written out here and
differentiated on one rank, in one forward pass (the reference of every row).

Per loss token with current log-prob ``logp``, behaviour ``old``, proximal ``prox`` and
advantage ``a`` (the sample's): the ratio ``r = exp(logp - prox)``, the policy term
``pg = max(-r a, -clip(r, 1 - 0.2, 1 + 0.2) a)``; ``decoupled`` multiplies it by the behaviour
weight ``b = exp(prox - old)`` and keeps the tokens with ``b`` inside the rejection band;
``m2po`` keeps the tokens left once the largest second moments ``(old - prox)^2`` of the whole
step are dropped, until the mean of the rest is below ``m2_threshold`` (the decision AReaL takes
over the step when it runs on one rank with one micro-batch). The loss is ``sum(w pg k)`` with
``k`` the kept mask and the token-mean weights ``w``, in one of two meanings
(docs/masks_in_loss.md):

* zeroed: ``w = 1 / N`` over the loss mask's tokens, the dropped tokens still counted;
* excluded: ``w = 1 / N_kept``, over the kept tokens alone.

AReaL means the zeroed one for rejection sampling (``ppo_actor_loss_fn`` counts before it
rejects) and the excluded one for M2PO (its loss divides by the tokens it kept): :data:`MEANING`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.areal import batch as ab

__all__ = ["MEANING", "areal_reference", "areal_references", "kept_tokens", "m2po_keep"]

#: Whether AReaL's own loss excludes the tokens it drops from the count (True) or zeroes them.
MEANING: dict[str, bool] = {"grpo": False, "decoupled": False, "m2po": True}


def m2po_keep(old: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """M2PO's kept tokens among ``mask``'s over the tensors given: drop the largest second
    moments ``(old - prox)^2`` until the mean of the rest is below the threshold (at least one
    token kept)."""
    sel = mask.bool()
    m2 = ((old - prox) ** 2)[sel]
    keep = torch.zeros_like(sel)
    if m2.numel() == 0:
        return keep
    order = torch.argsort(m2, descending=True)
    ranked = m2[order]
    suffix_mean = ranked.flip(0).cumsum(0).flip(0) / torch.arange(len(ranked), 0, -1)
    below = torch.nonzero(suffix_mean < ab.M2_THRESHOLD)
    dropped = int(below[0]) if len(below) else len(ranked) - 1
    kept = torch.ones(len(ranked), dtype=torch.bool)
    kept[order[:dropped]] = False
    keep[sel] = kept
    return keep


def _kept(batch: dict[str, torch.Tensor], setting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept mask ``k`` of ``setting`` and the behaviour weight (1 without one)."""
    mask, old, prox = batch["loss_mask"].bool(), batch["logprobs"], batch["prox_logp"]
    weight = torch.ones_like(old)
    keep = mask.clone()
    if setting == "decoupled":
        weight = torch.exp(prox - old)
        low, high = ab.RS_BAND
        keep = mask & (weight >= low) & (weight <= high)
    elif setting == "m2po":
        keep = m2po_keep(old, prox, mask)
    return keep, weight


def kept_tokens(case: OracleCase, setting: str) -> dict[str, int]:
    """The step's loss tokens and those ``setting`` keeps."""
    batch = ab.areal_batch(case, 264, setting)
    keep, _ = _kept(batch, setting)
    return {"loss_tokens": int(batch["loss_mask"].sum()), "kept_tokens": int(keep.sum())}


def areal_reference(case: OracleCase, setting: str, excluded: bool) -> dict[str, torch.Tensor]:
    """One rank, one forward pass: the gradient of the exact objective of ``setting`` in the
    ``excluded`` (or zeroed) meaning (module docstring)."""
    from megatron_lossfix.audit.tiny_gpt import gather_full_grads, one_rank_tiny_gpt

    model, config = one_rank_tiny_gpt(case)
    batch = ab.areal_batch(case, config.vocab_size, setting)
    ids = batch["input_ids"]
    # Layers that mix no tokens: each position's logits depend on its own token alone.
    logits = model(ids, None, None).float()
    logp_all = torch.log_softmax(logits, dim=-1)
    labels = torch.roll(ids, shifts=-1, dims=-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    keep, weight = _kept(batch, setting)
    ratio = torch.exp(logp - batch["prox_logp"])
    a = batch["advantages"]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - ab.EPS_CLIP, 1 + ab.EPS_CLIP)) * weight
    count = keep.sum() if excluded else batch["loss_mask"].bool().sum()
    loss = torch.where(keep, pg, 0.0).sum() / count.clamp(min=1)
    loss.backward()
    model.finish_grad_sync()
    return gather_full_grads([model])


def areal_references(
    case: OracleCase, wanted: list[tuple[str, bool]]
) -> dict[tuple[str, bool], Any]:
    """:func:`areal_reference` of each ``(setting, excluded)`` in ``wanted``, in one rank's
    process (one pool call for all)."""
    return {key: areal_reference(case, *key) for key in wanted}
