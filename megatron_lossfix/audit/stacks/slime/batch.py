"""``--stack slime``: the step's data and slime's settings, as slime's actor holds them.

The batch: 24 samples, prompts of 2-5 tokens, responses of 1-12 (uneven), some responses with a
masked tail, and samples 0, 7, 14, 15, 16, 17 and 21 fully masked (a filtered or removed
sample: slime keeps its response and zeroes its loss mask); old, reference and rollout
(inference engine) log-probs and one advantage per sample. Modes (:data:`MODES`):

* ``per_sample``: slime's default setting, one sample per rollout;
* ``per_rollout``: the default setting with rollouts of several samples (compact or subagent
  rollouts: :data:`~megatron_lossfix.audit.oracle_case.PROMPT_GROUP_SIZES`, rollout 3 fully
  masked), whose samples straddle DP ranks and micro-batches;
* ``per_token``: ``--calculate-per-token-loss``.

Settings of slime's policy loss (:data:`SETTINGS`), each with slime's own code:

* ``ppo``: PPO clip (GRPO advantages), the default;
* ``tis``: ``--use-tis`` with a rejection-sampling TIS function (slime's
  ``--custom-tis-function-path`` hook, :func:`truncate_and_reject`): the policy term weighted by
  the truncated ratio old/rollout, and the tokens whose ratio lies outside a band rejected
  through the masks it returns (slime's ``modified_response_masks``);
* ``opsm``: ``--use-opsm``: slime drops the policy term of a sequence with a negative advantage
  whose mean ``old - current`` log-prob exceeds ``--opsm-delta``;
* ``gspo``: ``--advantage-estimator gspo``: the sequence-level importance ratio.

``tis`` and ``opsm`` drop tokens inside the loss (:data:`DROPPING`).
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from collections.abc import Sequence
from typing import Any

import torch

from megatron_lossfix.audit.matrix import MatrixLayout
from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.oracle_case import prompt_groups
from megatron_lossfix.audit.stacks.modes import StackMode

__all__ = [
    "DROPPING",
    "MODES",
    "SETTINGS",
    "local_rollout",
    "phantom_tokens",
    "slime_args",
    "slime_rollout",
    "stack_case",
    "truncate_and_reject",
]

#: slime's settings -> the plugin's mode; the default setting divides by every rollout.
MODES: dict[str, StackMode] = {
    "per_sample": StackMode(plugin_mode="sequence_mean", divides_by_batch_size=True),
    "per_rollout": StackMode(plugin_mode="group_mean", divides_by_batch_size=True),
    "per_token": StackMode(plugin_mode="token_mean"),
}
#: Fully masked samples of the batch (rows 15-17: rollout 3 of ``per_rollout``).
MASKED_SAMPLES: tuple[int, ...] = (0, 7, 14, 15, 16, 17, 21)
KL_COEF = 0.1
ENTROPY_COEF = 0.05
EPS_CLIP, EPS_CLIP_HIGH = 0.2, 0.28
#: ``--tis-clip``: the truncation of the importance weight old/rollout.
TIS_CLIP = 1.5
#: The band of the ratio old/rollout outside which :func:`truncate_and_reject` rejects a token.
TIS_BAND = (0.6, 1.6)
#: The spread of the rollout log-probs around the old ones (about a quarter outside the band).
ROLLOUT_NOISE = 0.5
#: ``--opsm-delta``.
OPSM_DELTA = 0.05
#: slime's get_batch pads each packed row to a multiple of TP x this.
PAD_MULTIPLIER = 4
#: The path slime loads the rejection TIS function from (``--custom-tis-function-path``).
TIS_FUNCTION = f"{__name__}.truncate_and_reject"
#: slime's policy-loss settings the stack audits: name -> the arguments it sets.
SETTINGS: dict[str, dict[str, Any]] = {
    "ppo": {},
    "tis": {"use_tis": True, "custom_tis_function_path": TIS_FUNCTION},
    "opsm": {"use_opsm": True},
    "gspo": {"advantage_estimator": "gspo"},
}
#: Settings whose loss drops tokens (the mask-in-loss row runs for them).
DROPPING: tuple[str, ...] = ("tis", "opsm")
#: What slime's forward_step asks get_batch for (train_one_step).
BATCH_KEYS: tuple[str, ...] = (
    "tokens",
    "multimodal_train_inputs",
    "packed_seq_params",
    "total_lengths",
    "response_lengths",
    "loss_masks",
    "log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "rollout_log_probs",
    "teacher_log_probs",
    "rollout_mask_sums",
)


def stack_case(opts: Any, layout: MatrixLayout) -> OracleCase:
    """The audit's case for ``layout`` with the model slime's packed batches run on here."""
    case = opts.case(layout)
    model = dict(case.model_kwargs)
    model.update(no_attention=True, position_embedding_type="none", variable_seq_lengths=True)
    # Megatron refuses variable lengths with its default (allgather) token dispatcher.
    model.setdefault("moe_token_dispatcher_type", "alltoall")
    return dataclasses.replace(case, model_kwargs=model)


def slime_args(mode: str, allgather_cp: bool = False, setting: str = "ppo") -> Namespace:
    """slime's parsed arguments, as far as its loss path reads them: GRPO-style PPO with an
    entropy bonus and a ``low_var_kl`` KL loss, and ``setting``'s (:data:`SETTINGS`)."""
    args = Namespace(
        loss_type="policy_loss",
        calculate_per_token_loss=mode == "per_token",
        allgather_cp=allgather_cp,
        recompute_loss_function=False,
        advantage_estimator="grpo",
        use_rollout_logprobs=False,
        eps_clip=EPS_CLIP,
        eps_clip_high=EPS_CLIP_HIGH,
        eps_clip_c=None,
        use_opsm=False,
        opsm_delta=OPSM_DELTA,
        get_mismatch_metrics=False,
        use_tis=False,
        tis_clip=TIS_CLIP,
        tis_clip_low=0.0,
        custom_tis_function_path=None,
        custom_pg_loss_reducer_function_path=None,
        entropy_coef=ENTROPY_COEF,
        use_kl_loss=True,
        kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl",
        use_unbiased_kl=False,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        log_probs_chunk_size=-1,
        data_pad_size_multiplier=PAD_MULTIPLIER,
        save_debug_train_data=None,
    )
    for key, value in SETTINGS[setting].items():
        setattr(args, key, value)
    return args


def slime_rollout(case: OracleCase, vocab_size: int, mode: str) -> dict[str, Any]:
    """The step's whole rollout data, every sample's fields full length (on the CPU)."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.global_batch_size, case.seq_length
    prompts = torch.randint(2, 6, (b,), generator=gen)
    tokens, masks, old, ref, adv = [], [], [], [], []
    base = -torch.log(torch.tensor(float(vocab_size)))
    for i in range(b):
        p = int(prompts[i])
        r = int(torch.randint(1, s - p + 1, (1,), generator=gen))
        tokens.append(torch.randint(0, vocab_size, (p + r,), generator=gen))
        mask = torch.ones(r, dtype=torch.int)
        if i % 5 == 2 and r > 2:  # a masked tail (e.g. a tool call's output)
            mask[r // 2 :] = 0
        if i in MASKED_SAMPLES:
            mask.zero_()
        masks.append(mask)
        old.append(base + 0.3 * torch.randn(r, generator=gen))
        ref.append(base + 0.3 * torch.randn(r, generator=gen))
        adv.append(torch.randn((), generator=gen).expand(r).clone())
    # The inference engine's log-probs (TIS), drawn apart: the batch above stays as it was.
    noise = torch.Generator().manual_seed(case.seed + 1)
    rollout = [o + ROLLOUT_NOISE * torch.randn(len(o), generator=noise) for o in old]
    rollout_ids = prompt_groups(b)[0].tolist() if mode == "per_rollout" else list(range(b))
    # slime's rollout manager (_convert_samples_to_train_data): per-rollout mask totals.
    totals: dict[int, int] = {}
    for rid, m in zip(rollout_ids, masks, strict=True):
        totals[rid] = totals.get(rid, 0) + int(m.sum())
    return {
        "tokens": tokens,
        "total_lengths": [len(t) for t in tokens],
        "response_lengths": [len(m) for m in masks],
        "loss_masks": masks,
        "log_probs": old,
        "ref_log_probs": ref,
        "rollout_log_probs": rollout,
        "advantages": adv,
        "rollout_ids": rollout_ids,
        "rollout_mask_sums": torch.tensor([float(totals[r]) for r in rollout_ids]),
        "num_rollouts": len(totals),
    }


def phantom_tokens(case: OracleCase) -> dict[str, float]:
    """The batch's loss tokens and the phantom tokens slime's per-token count adds (one per
    fully masked sample), and the factor by which that shrinks its gradient."""
    data = slime_rollout(case, 264, "per_token")
    real = sum(int(m.sum()) for m in data["loss_masks"])
    slime = sum(max(int(m.sum()), 1) for m in data["loss_masks"])
    return {
        "loss_tokens": real,
        "slime_num_tokens": slime,
        "phantom_tokens": slime - real,
        "gradient_scale": real / slime,
    }


def local_rollout(data: dict[str, Any], indices: Sequence[int], device: Any) -> dict[str, Any]:
    """This DP rank's rollout data as slime's actor holds it: tensors on the device, the
    per-token fields sliced for this CP rank (slime's ``slice_log_prob_with_cp``)."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    out: dict[str, Any] = {}
    lengths = [(data["total_lengths"][i], data["response_lengths"][i]) for i in indices]
    for key in ("log_probs", "ref_log_probs", "rollout_log_probs", "advantages"):
        out[key] = [
            slice_log_prob_with_cp(data[key][i], t, r).to(device)
            for i, (t, r) in zip(indices, lengths, strict=True)
        ]
    out["tokens"] = [data["tokens"][i].to(device) for i in indices]
    out["loss_masks"] = [data["loss_masks"][i].to(device) for i in indices]
    out["total_lengths"] = [t for t, _ in lengths]
    out["response_lengths"] = [r for _, r in lengths]
    out["rollout_ids"] = [data["rollout_ids"][i] for i in indices]
    out["rollout_mask_sums"] = data["rollout_mask_sums"][list(indices)].to(device)
    return out


def tis_keep(ratio: torch.Tensor) -> torch.Tensor:
    """The tokens :func:`truncate_and_reject` keeps: ratio old/rollout inside :data:`TIS_BAND`."""
    low, high = TIS_BAND
    return (ratio >= low) & (ratio <= high)


def truncate_and_reject(
    args: Namespace,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """A TIS function for slime's ``--custom-tis-function-path`` (its contract: this CP rank's
    ``pg_loss`` and log-probs, whole-sequence ``loss_masks``): the policy term weighted by the
    ratio old/rollout truncated at ``--tis-clip``, and the tokens whose ratio lies outside
    :data:`TIS_BAND` rejected in the masks it returns (whole sequences, gathered over CP)."""
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp

    weights, masks = [], []
    for old, rollout, mask, t, r in zip(
        train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
        strict=True,
    ):  # fmt: skip
        ratio = torch.exp(old - rollout).detach()
        weights.append(ratio.clamp(args.tis_clip_low, args.tis_clip))
        whole = all_gather_with_cp(ratio, t, r).detach()
        masks.append(mask * tis_keep(whole).to(mask.dtype))
    weight = torch.cat(weights)
    return pg_loss * weight, masks, {"tis": weight}
