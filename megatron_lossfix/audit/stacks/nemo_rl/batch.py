"""``--stack nemo-rl``: the step's data and NeMo-RL's settings (its loss functions and config).

One optimizer step of 12 sequences (rows of width :data:`WIDTH`): prompts of 2 to 4 tokens,
responses of 1 to 8; two sequences hold no loss token: row 4 is dropped by its ``sample_mask``
(as NeMo-RL drops a filtered sample), row 9 keeps ``sample_mask = 1`` with an all-zero
``token_mask`` (a response that was cut to nothing). Rewards: 1 for rows whose index is
divisible by 3 (the VAPO NLL term's correct samples), else 0. Rows pair up (0, 1), (2, 3), ...
as DPO's (chosen, rejected) pairs.

Settings (:data:`SETTINGS`), each one of NeMo-RL's loss functions built from its own config:

* ``pg``: ``ClippedPGLossFn`` at token level (PPO clip 0.2/0.28, k3 KL 0.05);
* ``gspo``: the same at sequence level with sequence-level importance ratios (GSPO);
* ``vapo``: ``pg`` with the VAPO positive-example NLL term (``positive_example_nll_weight``
  0.5, the step's ``rewards`` handed to the loss);
* ``nll``: ``NLLLossFn`` (SFT);
* ``dpo``: ``DPOLossFn`` (beta 0.1, SFT term weight 0.2 on the chosen responses);
* ``distillation``: ``DistillationLossFn`` (forward KL on the teacher's top-k logits).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "LENGTHS",
    "SETTINGS",
    "WIDTH",
    "loss_fn",
    "policy_cfg",
    "step_batch",
]

WIDTH = 12
#: (prompt tokens, response tokens) of each row.
LENGTHS: tuple[tuple[int, int], ...] = (
    (2, 6), (3, 8), (4, 3), (2, 1), (3, 5), (4, 7),
    (2, 4), (3, 2), (4, 8), (2, 5), (3, 6), (4, 1),
)  # fmt: skip
DROPPED_SAMPLE, EMPTY_RESPONSE = 4, 9
TOPK = 4
SETTINGS: tuple[str, ...] = ("pg", "gspo", "vapo", "nll", "dpo", "distillation")


def loss_fn(setting: str) -> Any:
    """NeMo-RL's loss function of ``setting``, built from its own config class."""
    from nemo_rl.algorithms.loss import loss_functions as lf

    pg = dict(ratio_clip_min=0.2, ratio_clip_max=0.28, reference_policy_kl_penalty=0.05)
    if setting == "pg":
        return lf.ClippedPGLossFn(lf.ClippedPGLossConfig(**pg))
    if setting == "gspo":
        return lf.ClippedPGLossFn(
            lf.ClippedPGLossConfig(
                **pg, token_level_loss=False, sequence_level_importance_ratios=True
            )
        )
    if setting == "vapo":
        return lf.ClippedPGLossFn(lf.ClippedPGLossConfig(**pg, positive_example_nll_weight=0.5))
    if setting == "nll":
        return lf.NLLLossFn()
    if setting == "dpo":
        return lf.DPOLossFn(lf.DPOLossConfig(reference_policy_kl_penalty=0.1, sft_loss_weight=0.2))
    if setting == "distillation":
        return lf.DistillationLossFn(
            lf.DistillationLossConfig(kl_type="forward", zero_outside_topk=False)
        )
    raise ValueError(f"unknown NeMo-RL setting {setting!r}; choose from {', '.join(SETTINGS)}")


def policy_cfg(mbs: int, gbs: int, packed: bool = False, sizes: tuple = (1, 1, 1)) -> dict:
    """The slice of NeMo-RL's ``PolicyConfig`` its Megatron ``train()`` reads; ``packed``:
    sequence packing on (``sizes``: TP, PP, CP, for its padding rule)."""
    tp, pp, cp = sizes
    return {
        "train_global_batch_size": gbs,
        "train_micro_batch_size": mbs,
        "sequence_packing": {"enabled": packed},
        "dynamic_batching": {"enabled": False},
        "make_sequence_length_divisible_by": 2 * cp if cp > 1 else 1,
        "logprob_chunk_size": None,
        "max_total_sequence_length": WIDTH,
        "megatron_cfg": {
            "empty_unused_memory_level": 0,
            "use_fused_linear_logprobs": False,
            "moe_per_layer_logging": False,
            "distributed_data_parallel_config": {"overlap_grad_reduce": False},
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "context_parallel_size": cp,
            "sequence_parallel": False,
        },
    }


def step_batch(setting: str, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The step's 12 rows as NeMo-RL's batch keys (CPU tensors; the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    input_ids = torch.randint(0, vocab, (rows, WIDTH), generator=gen)
    token_mask = torch.zeros(rows, WIDTH)
    lengths = torch.zeros(rows, dtype=torch.long)
    for r, (prompt, response) in enumerate(LENGTHS):
        lengths[r] = prompt + response
        if r != EMPTY_RESPONSE:
            token_mask[r, prompt : prompt + response] = 1.0
        input_ids[r, prompt + response :] = 0
    sample_mask = torch.ones(rows)
    sample_mask[DROPPED_SAMPLE] = 0.0
    old = -2.0 - torch.rand(rows, WIDTH, generator=gen)
    batch = {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": torch.randn(rows, 1, generator=gen).expand(rows, WIDTH).contiguous(),
        "prev_logprobs": old,
        "generation_logprobs": old + 0.05 * torch.randn(rows, WIDTH, generator=gen),
        "reference_policy_logprobs": old + 0.1 * torch.randn(rows, WIDTH, generator=gen),
    }
    if setting == "vapo":
        batch["rewards"] = (torch.arange(rows) % 3 == 0).float()
    if setting == "distillation":
        batch["teacher_topk_logits"] = torch.randn(rows, WIDTH, TOPK, generator=gen)
        batch["teacher_topk_indices"] = torch.randint(0, vocab, (rows, WIDTH, TOPK), generator=gen)
    return batch
