"""``--stack roll``: the step's data and ROLL's settings, as ROLL's RLVR actor and DPO worker
hold them.

The batch: 24 sequences of 32 positions, prompts of 2-5 tokens, responses of 1-14 (uneven),
some with a masked tail and samples 0, 7 and 15 fully masked, in ROLL's padded layout
(``input_ids``, ``attention_mask``, ``response_mask`` at the response's token positions,
``old_log_probs``, ``ref_log_probs``, ``infer_logprobs`` and ``advantages`` at the log-prob
positions ``t -> t + 1``, zero outside the response, as ROLL's advantage estimators leave them).

Settings of the RLVR actor's ``loss_func`` (:data:`SETTINGS`), every ``loss_agg_mode``:

* ``plain``: PPO clip 0.2 with the ``k3`` KL loss (coefficient 0.1), entropy coefficient 0
  (ROLL's default);
* ``filter``: a token-level train-infer filter (``train_infer_correction.filters``: the ratio
  ``exp(old - infer)`` outside ``[0.8, 1.2]``), about two fifths of the loss tokens dropped;
* ``length``: ``length_loss_weight`` (per-sample weights ``1.5 - normalized length``, scaled to
  average 1).

``dpo``: ROLL's DPO worker (``roll/pipeline/dpo/actor_worker.py``), chosen and rejected rows
interleaved, beta 0.1. Batchings (:data:`BATCHINGS`): ``static`` (equal micro-batches of
``per_device_train_batch_size``), ``dynamic`` (``dynamic_batching_shard``: sorted by length,
micro-batches up to a token budget, each trimmed to its longest row) and ``packed``
(``use_sequence_packing``: each micro-batch one packed row, every sample padded to a multiple of
16 and its loss taken alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_lossfix.audit.matrix import MatrixLayout
from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.modes import StackMode

__all__ = [
    "BATCHINGS",
    "DIVISOR",
    "DROPPING",
    "MASKED_SAMPLES",
    "MODES",
    "SEQ_LENGTH",
    "SETTINGS",
    "pipeline_settings",
    "roll_batch",
    "stack_case",
]

#: The step's sequence length (ROLL's ``sequence_length``): long enough that a packed sample's
#: padded width (16) is not the static width.
SEQ_LENGTH = 32
#: The static width of the log-prob positions: ROLL's Dr. GRPO divisor without dynamic batching
#: or packing (``loss_mask.shape[-1]``), the constant the adapter keeps.
STATIC_WIDTH = SEQ_LENGTH - 1
#: ROLL's ``loss_agg_mode``s and their counterparts among the plugin's modes.
MODES: dict[str, StackMode] = {
    "token-mean": StackMode(plugin_mode="token_mean"),
    "seq-mean-token-mean": StackMode(plugin_mode="sequence_mean"),
    "seq-mean-token-sum": StackMode(plugin_mode="seq_mean_token_sum_norm", norm_constant=1.0),
    "seq-mean-token-sum-norm": StackMode(plugin_mode="sum"),
}
#: ROLL's divisor of the weights beyond the plugin mode's: Dr. GRPO divides the step's token sum
#: by the constant alone (no sequence count, unlike the plugin's ``seq_mean_token_sum_norm``).
DIVISOR: dict[str, float] = {"seq-mean-token-sum-norm": float(STATIC_WIDTH)}
#: Fully masked samples of the batch.
MASKED_SAMPLES: tuple[int, ...] = (0, 7, 15)
PG_CLIP = 0.2
KL_COEF = 0.1
DPO_BETA = 0.1
#: The train-infer filter's band of ``exp(old - infer)``.
FILTER_BAND = (0.8, 1.2)
#: The spread of the inference engine's log-probs around the trainer's.
INFER_NOISE = 0.25
#: The actor's settings: name -> the pipeline config's fields beyond ``plain``.
SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "filter": {"filter": True},
    "length": {"length_loss_weight": True},
    "dpo": {},
}
#: Settings whose loss drops tokens (the mask-in-loss row runs for them).
DROPPING: tuple[str, ...] = ("filter",)
#: ROLL's batchings: name -> (``use_dynamic_batching_in_train``, ``use_sequence_packing``).
BATCHINGS: dict[str, tuple[bool, bool]] = {
    "static": (False, False),
    "dynamic": (True, False),
    "packed": (False, True),
}
#: Dynamic batching's token budget per micro-batch and its rounding of the width.
DYNAMIC_TOKENS = 96
DYNAMIC_ROUND = 4


def stack_case(opts: Any, layout: MatrixLayout) -> OracleCase:
    """The audit's case for ``layout`` with the model ROLL's micro-batches run on here: layers
    that mix no tokens (packed rows and ROLL's context-parallel slices are then exact on
    Megatron's local attention), no position embedding (packing restarts positions), variable
    sequence lengths (dynamic batching trims each micro-batch) and ROLL's sequence length."""
    case = opts.case(layout)
    model = dict(case.model_kwargs)
    model.update(no_attention=True, position_embedding_type="none", variable_seq_lengths=True)
    model.setdefault("moe_token_dispatcher_type", "alltoall")
    return dataclasses.replace(case, model_kwargs=model, seq_length=SEQ_LENGTH)


def pipeline_settings(mode: str, setting: str) -> dict[str, Any]:
    """The RLVR pipeline config's fields the actor's ``loss_func`` reads, in ``setting``."""
    extra = SETTINGS[setting]
    return {
        "loss_agg_mode": mode,
        "use_kl_loss": True,
        "kl_loss_coef": KL_COEF,
        "entropy_loss_coef": 0.0,
        "rl_loss_coef": 1.0,
        "importance_sampling": "token",
        "use_pg_clip_range": False,
        "pg_clip": PG_CLIP,
        "dual_clip_loss": False,
        "enable_old_logprobs_recompute": False,
        "difficulty_loss_weight": False,
        "length_loss_weight": bool(extra.get("length_loss_weight")),
        "filter": bool(extra.get("filter")),
    }


def roll_batch(case: OracleCase, vocab_size: int, setting: str) -> dict[str, torch.Tensor]:
    """The step's whole batch in ROLL's padded layout (module docstring), on the CPU. ``dpo``:
    pairs of rows (chosen, rejected) sharing a prompt, with ``prompt_id_lens`` and
    ``reference_log_probs``."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.global_batch_size, SEQ_LENGTH
    ids = torch.zeros(b, s, dtype=torch.long)
    attn = torch.zeros(b, s, dtype=torch.long)
    resp = torch.zeros(b, s, dtype=torch.long)
    old, adv = torch.zeros(b, s - 1), torch.zeros(b, s - 1)
    prompt_lens = torch.zeros(b, dtype=torch.long)
    base = -torch.log(torch.tensor(float(vocab_size)))
    for i in range(b):
        p = int(torch.randint(2, 6, (1,), generator=gen))
        if setting == "dpo" and i % 2:  # the rejected answer shares the chosen one's prompt
            p = int(prompt_lens[i - 1])
            ids[i, :p] = ids[i - 1, :p]
        r = int(torch.randint(1, 15, (1,), generator=gen))
        new = torch.randint(0, vocab_size, (p + r,), generator=gen)
        start = p if setting == "dpo" and i % 2 else 0
        ids[i, start : p + r] = new[start:]
        attn[i, : p + r] = 1
        prompt_lens[i] = p
        resp[i, p : p + r] = 1
        if i % 5 == 2 and r > 2:  # a masked tail (a tool's output)
            resp[i, p + r // 2 : p + r] = 0
        if i in MASKED_SAMPLES and setting != "dpo":
            resp[i] = 0
        old[i, : p + r - 1] = base + 0.3 * torch.randn(p + r - 1, generator=gen)
        adv[i] = torch.randn((), generator=gen)
    loss_mask = resp[:, 1:].float()
    adv = adv * loss_mask
    noise = torch.Generator().manual_seed(case.seed + 1)
    infer = old + INFER_NOISE * torch.randn(b, s - 1, generator=noise)
    ref = old + 0.2 * torch.randn(b, s - 1, generator=noise)
    out = {
        "input_ids": ids,
        "attention_mask": attn,
        "response_mask": resp,
        "old_log_probs": old * attn[:, 1:],
        "ref_log_probs": ref * attn[:, 1:],
        "infer_logprobs": infer * attn[:, 1:],
        "advantages": adv,
    }
    if setting == "dpo":
        out = {k: out[k] for k in ("input_ids", "attention_mask")}
        out["prompt_id_lens"] = prompt_lens
        out["reference_log_probs"] = ref * attn[:, 1:]
    return out


def filter_keep(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The train-infer filter's kept positions (the log-prob positions, ``[b, s - 1]``): the
    ratio ``exp(old - infer)`` inside :data:`FILTER_BAND`, ROLL's token-level rule."""
    ratio = torch.exp(batch["old_log_probs"] - batch["infer_logprobs"])
    low, high = FILTER_BAND
    return (ratio >= low) & (ratio <= high)
