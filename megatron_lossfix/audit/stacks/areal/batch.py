"""``--stack areal``: the step's data and AReaL's settings, as AReaL's PPO actor holds them.

The batch: 24 sequences of 16 positions at most, prompts of 2-5 tokens, responses of 1-14
(uneven), some with a masked tail, and samples 0, 7 and 15 fully masked (a filtered sample:
AReaL keeps it and zeroes its loss mask). AReaL's padded layout (``train_batch``'s input):
``input_ids``, ``attention_mask``, ``loss_mask`` (position ``t`` counts when it predicts a
response token, AReaL's rolled mask), the behaviour log-probs ``logprobs`` (the inference
engine's), the recomputed ``prox_logp`` and one advantage per sample on its tokens.

Settings of AReaL's ``grpo_loss_fn`` (:data:`SETTINGS`), each with AReaL's own code:

* ``grpo``: its default (GRPO advantages, PPO clip ``eps_clip=0.2``); no decoupled loss, so the
  proximal log-probs are the behaviour ones (``prox_logp == logprobs``);
* ``decoupled``: ``use_decoupled_loss`` with stale rollouts (``prox_logp`` recomputed, off the
  behaviour ones) and rejection sampling (``action='mask'``, the token ratio
  ``pi_prox / pi_behave`` outside ``[0.7, 1.4]`` rejected): ``ppo_actor_loss_fn`` rejects the
  tokens and keeps their count (its own comment: consistent with ``loss_weight_fn``);
* ``m2po``: ``m2_threshold`` on the same stale rollouts: ``grpo_loss_fn`` masks the tokens of
  the largest second moment ``(logprobs - prox_logp)^2`` of the micro-batch before the loss,
  until the rest's mean is below the threshold; the loss then divides by the tokens it kept.

``m2po`` and ``decoupled`` drop tokens inside the loss (:data:`DROPPING`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_lossfix.audit.matrix import MatrixLayout
from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.modes import StackMode

__all__ = [
    "DROPPING",
    "MASKED_SAMPLES",
    "MODES",
    "SETTINGS",
    "areal_batch",
    "loss_kwargs",
    "rank_slice",
    "stack_case",
]

#: AReaL's one normalization (``loss_weight_fn = loss_mask.count_nonzero()``): the step's token
#: mean, the plugin's ``token_mean``.
MODES: dict[str, StackMode] = {"token_mean": StackMode(plugin_mode="token_mean")}
#: Fully masked samples of the batch.
MASKED_SAMPLES: tuple[int, ...] = (0, 7, 15)
EPS_CLIP = 0.2
#: ``m2_threshold``: about a sixth of the stale tokens go.
M2_THRESHOLD = 0.05
#: The rejection-sampling band of the token ratio ``pi_prox / pi_behave`` (``decoupled``).
RS_BAND = (0.7, 1.4)
#: The spread of the recomputed (proximal) log-probs around the behaviour ones (stale rollouts).
STALENESS = 0.3
#: AReaL's settings the stack audits: name -> ``grpo_loss_fn``'s arguments beyond the default.
SETTINGS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "decoupled": {"use_decoupled_loss": True, "rejection_sampling": "mask"},
    "m2po": {"m2_threshold": M2_THRESHOLD},
}
#: Settings whose loss drops tokens (the mask-in-loss row runs for them).
DROPPING: tuple[str, ...] = ("decoupled", "m2po")


def stack_case(opts: Any, layout: MatrixLayout) -> OracleCase:
    """The audit's case for ``layout`` with the model AReaL's packed micro-batches run on here:
    layers that mix no tokens (packed sequences and context-parallel slices are then exact on
    Megatron's local attention) and no position embedding (AReaL packs, and pads each
    micro-batch to its own length)."""
    case = opts.case(layout)
    model = dict(case.model_kwargs)
    model.update(no_attention=True, position_embedding_type="none", variable_seq_lengths=True)
    model.setdefault("moe_token_dispatcher_type", "alltoall")
    return dataclasses.replace(case, model_kwargs=model)


def loss_kwargs(setting: str) -> dict[str, Any]:
    """``grpo_loss_fn``'s keyword arguments in ``setting``, as AReaL's ``ppo_update`` passes
    them (``functools.partial(grpo_loss_fn, ...)``)."""
    from areal.api.cli_args import RejectionSamplingConfig

    kwargs: dict[str, Any] = dict(
        eps_clip=EPS_CLIP,
        eps_clip_higher=None,
        c_clip=None,
        rejection_sampling=None,
        m2_threshold=None,
        importance_sampling_level="token",
        current_version=None,
        prox_logp_method="recompute",
        use_sapo_loss=False,
        use_decoupled_loss=False,
    )
    kwargs.update(SETTINGS[setting])
    if kwargs["rejection_sampling"] == "mask":
        low, high = RS_BAND
        kwargs["rejection_sampling"] = RejectionSamplingConfig(
            level="token", action="mask", metric="ratio", upper=high, lower=low
        )
    return kwargs


def areal_batch(case: OracleCase, vocab_size: int, setting: str) -> dict[str, torch.Tensor]:
    """The step's whole batch in AReaL's padded layout (module docstring), on the CPU."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.global_batch_size, case.seq_length
    ids = torch.zeros(b, s, dtype=torch.long)
    attn = torch.zeros(b, s, dtype=torch.bool)
    mask = torch.zeros(b, s, dtype=torch.int32)
    old, adv = torch.zeros(b, s), torch.zeros(b, s)
    base = -torch.log(torch.tensor(float(vocab_size)))
    for i in range(b):
        p = int(torch.randint(2, 6, (1,), generator=gen))
        r = int(torch.randint(1, s - p + 1, (1,), generator=gen))
        ids[i, : p + r] = torch.randint(0, vocab_size, (p + r,), generator=gen)
        attn[i, : p + r] = True
        # Position t predicts token t + 1: the response's tokens p .. p + r - 1.
        mask[i, p - 1 : p + r - 1] = 1
        if i % 5 == 2 and r > 2:  # a masked tail (a tool's output)
            mask[i, p - 1 + r // 2 : p + r - 1] = 0
        if i in MASKED_SAMPLES:
            mask[i] = 0
        old[i, : p + r] = base + 0.3 * torch.randn(p + r, generator=gen)
        adv[i, : p + r] = torch.randn((), generator=gen)
    # The recomputed proximal log-probs of stale rollouts, drawn apart: the batch stays as it was.
    noise = torch.Generator().manual_seed(case.seed + 1)
    stale = old + STALENESS * torch.randn(b, s, generator=noise) * attn
    prox = old.clone() if setting == "grpo" else stale
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": mask,
        "logprobs": old,
        "prox_logp": prox,
        "advantages": adv,
    }


def rank_slice(batch: dict[str, torch.Tensor], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """DP rank ``dp_rank``'s contiguous slice of the step's batch (AReaL's controller hands each
    data-parallel rank its share of the rollouts)."""
    rows = batch["input_ids"].shape[0]
    if rows % dp_size:
        raise ValueError(f"the batch's {rows} sequences do not split over DP={dp_size}")
    per = rows // dp_size
    return {k: v[dp_rank * per : (dp_rank + 1) * per].clone() for k, v in batch.items()}
