"""A mini-batch of 12 responses to 4 prompts, and a hand-written reference of SkyRL's
``prompt_mean`` (SkyRL 0.4.0, ``apply_loss_reduction_to_advantages_minibatch``): token t of a
response to prompt p weighs ``1 / (num_prompts * tokens_in_prompt_p)``, ``num_prompts`` every
prompt of the mini-batch, all-masked ones included."""

from __future__ import annotations

import torch

# The global mini-batch: 12 responses of 4 prompts on 2 DP ranks x 3 micro-batches of 2 rows.
# Prompt 1 (rows 3..7) straddles both ranks and 3 micro-batches: rank 0's micro-batches 1 and 2
# and rank 1's micro-batch 0.
PROMPT_ROWS = ((0, 3), (3, 8), (8, 10), (10, 12))
LENGTHS = (3, 0, 5, 2, 6, 1, 4, 6, 2, 3, 5, 1)
SEQ = 6


def global_batch(masked_prompt: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Masks ``[12, 6]``, per-token losses and each row's prompt id; ``masked_prompt``'s
    responses get no loss token (as SkyRL's ``zero_variance_filter`` masks a prompt)."""
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()
    if masked_prompt is not None:
        start, end = PROMPT_ROWS[masked_prompt]
        mask[start:end] = 0
    loss = torch.rand(len(LENGTHS), SEQ, generator=torch.Generator().manual_seed(3)) * 3
    ids = [p for p, (start, end) in enumerate(PROMPT_ROWS) for _ in range(start, end)]
    return mask, loss.double(), ids


def skyrl_prompt_mean(loss: torch.Tensor, mask: torch.Tensor, boundaries) -> float:
    """SkyRL's ``prompt_mean`` loss by hand: each prompt's token mean, averaged over
    ``len(boundaries)`` prompts."""
    total = 0.0
    for start, end in boundaries:
        tokens = max(float(mask[start:end].sum()), 1.0)
        total += float((loss[start:end] * mask[start:end]).sum()) / (len(boundaries) * tokens)
    return total
