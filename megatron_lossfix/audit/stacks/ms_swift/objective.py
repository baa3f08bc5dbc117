"""``--stack ms-swift``: the exact objective of each setting, written out here and differentiated
on one rank in one forward pass (the reference of the ``ms-swift`` and ``ms-swift+lossfix``
rows).

Per sequence ``s``: ``logp_s`` = the sum of its response tokens' log-probs under the policy
(``ref_s`` under the reference model, no gradient), ``n_s`` its response tokens.

* ``sft``: the step's token mean of the cross entropy.
* ``dpo`` (loss type ``t``, ``beta``): per pair ``p`` (chosen ``c``, rejected ``r``),
  ``z_p = (logp_c - logp_r) - (ref_c - ref_r)`` and ``l_p`` = ``-log sigmoid(beta z_p)``
  (sigmoid), ``relu(1 - beta z_p)`` (hinge) or ``(z_p - 1 / (2 beta))^2`` (IPO, on per-token
  mean log-probs, as Swift's own ``DPOTrainer`` computes it); the loss is the mean of ``l_p``
  over the step's pairs, plus ``rpo_alpha`` times the chosen responses' token mean of the cross
  entropy over the step (what ms-swift computes on one rank with one micro-batch).
* ``rm`` (a value head in place of the output layer): per pair, ``-log sigmoid(r_c - r_r)``
  with ``r`` the head's output at the sequence's last token, plus ``center_rewards_coefficient``
  times ``(r_c + r_r)^2``; the mean over the step's pairs.
* ``kto``: TRL's KTO loss per example, the mean over the step's examples; with the KL baseline,
  ``kl = max(0, mean over the step's KL completions of (logp - ref))``, no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.ms_swift import batch as sb

__all__ = ["swift_reference", "swift_references"]


def _token_logps(model: Any, seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
    """Per-sequence sums of the response tokens' log-probs and their counts, and the summed
    cross entropy over them (a forward of unpacked rows)."""
    rows = sb.micro_batches([{"seqs": [s]} for s in seqs], "sft", False, 0, 1, 1)[0]
    ids, labels = rows["input_ids"], torch.roll(rows["labels"], -1, dims=-1)
    logits = model(ids, None, None).float()  # layers that mix no tokens: no positions needed
    mask = labels != -100
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1), reduction="none"
    ).view_as(labels)
    ce = ce * mask
    return -ce.sum(-1), mask.sum(-1), ce


def _dpo_losses(z: torch.Tensor, loss_type: str, beta: float) -> torch.Tensor:
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * z)
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"no reference for loss_type {loss_type!r}")


def swift_reference(case: OracleCase, name: str) -> dict[str, torch.Tensor]:
    """One rank, one forward pass: the gradient of setting ``name``'s exact objective."""
    from megatron_lossfix.audit.stacks.ms_swift.ranks import REF_SEED_OFFSET, swift_args
    from megatron_lossfix.audit.tiny_gpt import (
        gather_full_grads,
        one_rank_tiny_gpt,
        set_deterministic_params,
    )

    setting = sb.SETTINGS[name]
    if setting.kind == "rm":
        from megatron_lossfix.audit.stacks.ms_swift.ranks import reward_model_hook

        model, config = one_rank_tiny_gpt(case, model_hook=reward_model_hook)
        units = sb.step_units(case, config.vocab_size, "rm")
        seqs = [u["seqs"][0] for u in units] + [u["seqs"][1] for u in units]
        rows = sb.micro_batches([{"seqs": [s]} for s in seqs], "sft", False, 0, 1, 1)[0]
        values = model(rows["input_ids"], None, None).float()[..., 0]  # [sequences, positions]
        last = torch.tensor([len(ids) - 1 for ids, _ in seqs])
        rewards = values[torch.arange(len(seqs)), last]
        k = len(units)
        args = swift_args(setting, type("L", (), {"cp": 1, "pp": 1, "dp": 1})(), 1, 1)
        losses = -F.logsigmoid(rewards[:k] - rewards[k:])
        if args.center_rewards_coefficient is not None:
            losses = losses + args.center_rewards_coefficient * (rewards[:k] + rewards[k:]) ** 2
        losses.mean().backward()
        model.finish_grad_sync()
        return gather_full_grads([model])
    model, config = one_rank_tiny_gpt(case)
    ref, _ = one_rank_tiny_gpt(case)
    set_deterministic_params([ref], case.seed + REF_SEED_OFFSET)
    args = swift_args(setting, type("L", (), {"cp": 1, "pp": 1, "dp": 1})(), 1, 1)
    units = sb.step_units(case, config.vocab_size, setting.kind)
    if setting.kind == "sft":
        _, n, ce = _token_logps(model, [u["seqs"][0] for u in units])
        loss = ce.sum() / n.sum()
    elif setting.kind == "dpo":
        seqs = [u["seqs"][0] for u in units] + [u["seqs"][1] for u in units]
        logp, n, ce = _token_logps(model, seqs)
        with torch.no_grad():
            ref_logp, _, _ = _token_logps(ref, seqs)
        if args.loss_type == "ipo":
            logp, ref_logp = logp / n, ref_logp / n
        k = len(units)
        z = (logp[:k] - logp[k:]) - (ref_logp[:k] - ref_logp[k:])
        loss = _dpo_losses(z, args.loss_type, args.beta).mean()
        if args.rpo_alpha:
            loss = loss + args.rpo_alpha * ce[:k].sum() / n[:k].sum()
    else:
        logp, _, _ = _token_logps(model, [u["seqs"][0] for u in units])
        with torch.no_grad():
            ref_logp, _, _ = _token_logps(ref, [u["seqs"][0] for u in units])
            kl = torch.zeros(())
            if args.calculate_KL:
                kl_seqs = [u["kl"] for u in units]
                kl = (_token_logps(model, kl_seqs)[0] - _token_logps(ref, kl_seqs)[0]).mean()
                kl = kl.clamp(min=0)
        label = torch.tensor([u["label"] for u in units])
        ratio = logp - ref_logp
        losses = torch.where(
            label,
            args.desirable_weight * (1 - torch.sigmoid(args.beta * (ratio - kl))),
            args.undesirable_weight * (1 - torch.sigmoid(args.beta * (kl - ratio))),
        )
        loss = losses.mean()
    loss.backward()
    model.finish_grad_sync()
    return gather_full_grads([model])


def swift_references(case: OracleCase, names: list[str]) -> dict[str, Any]:
    """:func:`swift_reference` of each setting in ``names`` (packed and unpacked share one), in
    one rank's process (one pool call for all)."""
    out: dict[str, Any] = {}
    for name in names:
        base = name.removesuffix("-packed")
        if base not in out:
            out[base] = swift_reference(case, base)
        out[name] = out[base]
    return out
