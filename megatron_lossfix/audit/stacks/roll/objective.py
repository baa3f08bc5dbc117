"""``--stack roll``: the exact objective of each of ROLL's settings, written out here and
differentiated on one rank, in one forward pass (the reference of every row).

Per loss token with current log-prob ``logp``, old ``old``, reference ``ref`` and advantage ``a``:
the ratio ``r = exp(logp - old)``, the policy term ``pg = -min(r a, clip(r, 0.8, 1.2) a)`` times
the sample's weight ``v`` (1, or ROLL's length weight computed over the whole step), and the
``k3`` KL term ``k = exp(ref - logp) - (ref - logp) - 1`` (clamped to [-10, 10], coefficient
0.1). The loss is ``sum(w (v pg + 0.1 k) keep)``: ``w`` the plugin's weights of the mode's
counterpart (``batch.MODES``; Dr. GRPO: the ``sum`` weights over the static width, ROLL's
divisor without dynamic batching or packing), ``keep`` the filter's kept
tokens, in one of two meanings (docs/masks_in_loss.md):

* zeroed: ``w`` over the response's loss tokens, the filtered ones still counted;
* excluded: ``w`` over the kept tokens alone.

DPO: ``l_p = -log sigmoid(beta ((c_p - r_p) - (c_p' - r_p')))`` over each pair's response
log-prob sums (current and reference), and the loss ``sum_p l_p / P`` over the step's ``P``
pairs (the plugin's ``pair_mean``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.roll import batch as rb

__all__ = ["kept_tokens", "length_weights", "roll_reference", "roll_references"]


def length_weights(lengths: torch.Tensor) -> torch.Tensor:
    """ROLL's ``length_loss_weight`` over the rows given (``compute_sample_weights``): ``1.5 -``
    the length normalized to [0, 1], scaled to average 1 over the rows."""
    lengths = lengths.float()
    norm = (lengths - lengths.min()) / (lengths.max() - lengths.min() + 1e-8)
    weights = 1.5 - norm
    return weights * (len(weights) / (weights.sum() + 1e-8))


def kept_tokens(case: OracleCase, setting: str) -> dict[str, int]:
    """The step's loss tokens and those ``setting`` keeps."""
    batch = rb.roll_batch(case, 264, setting)
    if setting == "dpo":
        return {"pairs": case.global_batch_size // 2}
    mask = batch["response_mask"][:, 1:].bool()
    keep = mask & rb.filter_keep(batch) if setting in rb.DROPPING else mask
    return {"loss_tokens": int(mask.sum()), "kept_tokens": int(keep.sum())}


def _log_probs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Each position's log-prob of the next token (``[b, s - 1]``); the layers mix no tokens."""
    logits = model(ids, None, None).float()
    logp_all = torch.log_softmax(logits, dim=-1)
    return logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def _dpo_loss(logp: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean DPO loss over the step's pairs (module docstring)."""
    positions = torch.arange(rb.SEQ_LENGTH)[None, :]
    mask = batch["attention_mask"].bool() & (positions >= batch["prompt_id_lens"][:, None])
    mask = mask[:, 1:].float()
    sums = (logp * mask).sum(-1)
    refs = (batch["reference_log_probs"] * mask).sum(-1)
    logits = (sums[0::2] - sums[1::2]) - (refs[0::2] - refs[1::2])
    return -torch.nn.functional.logsigmoid(rb.DPO_BETA * logits).mean()


def roll_reference(
    case: OracleCase, mode: str, setting: str, excluded: bool
) -> dict[str, torch.Tensor]:
    """One rank, one forward pass: the gradient of the exact objective of ``mode`` in
    ``setting``, in the ``excluded`` (or zeroed) meaning (module docstring)."""
    from megatron_lossfix.audit.tiny_gpt import gather_full_grads, one_rank_tiny_gpt
    from megatron_lossfix.runtime.losses import loss_weights

    model, config = one_rank_tiny_gpt(case)
    batch = rb.roll_batch(case, config.vocab_size, setting)
    logp = _log_probs(model, batch["input_ids"])
    if setting == "dpo":
        _dpo_loss(logp, batch).backward()
        model.finish_grad_sync()
        return gather_full_grads([model])
    mask = batch["response_mask"][:, 1:].float()
    keep = mask * rb.filter_keep(batch) if setting in rb.DROPPING else mask
    stack_mode = rb.MODES[mode]
    (w,) = loss_weights(
        [keep if excluded else mask],
        stack_mode.plugin_mode,
        norm_constant=stack_mode.norm_constant,
    )
    w = w / rb.DIVISOR.get(mode, 1.0)
    v = torch.ones(mask.shape[0])
    if rb.SETTINGS[setting].get("length_loss_weight"):
        v = length_weights(keep.sum(-1))
    a = batch["advantages"]
    ratio = torch.exp(logp - batch["old_log_probs"])
    pg = -torch.minimum(ratio * a, ratio.clamp(1 - rb.PG_CLIP, 1 + rb.PG_CLIP) * a)
    diff = batch["ref_log_probs"] - logp
    kl = (torch.exp(diff) - diff - 1).clamp(-10, 10)
    loss = (w * keep * (v[:, None] * pg + rb.KL_COEF * kl)).sum()
    loss.backward()
    model.finish_grad_sync()
    return gather_full_grads([model])


def roll_references(
    case: OracleCase, wanted: list[tuple[str, str, bool]]
) -> dict[tuple[str, str, bool], Any]:
    """:func:`roll_reference` of each ``(mode, setting, excluded)`` in ``wanted``, in one
    rank's process (one pool call for all)."""
    return {key: roll_reference(case, *key) for key in wanted}
