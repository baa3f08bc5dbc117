"""Loss functions with Tinker semantics: plain weighted sums of per-token losses.

Megatron's pipeline schedule calls ``loss_func(output_tensor)``; bind the micro-batch's weights
first: ``partial(weighted_loss, batch.get("loss_weights", batch["loss_mask"]))`` (under ``off``
no weights come in, and the mask is stock's weight). The weights already hold the step's
normalization, so every function here returns ``sum(w * l)``, never a mean.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["weighted_loss", "weighted_sum"]


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(weights * per_token)`` in fp32, where zero-weight tokens add exactly 0.

    Padding positions may hold garbage (NaN, Inf) in ``per_token``; ``where`` keeps it out of
    the value and the gradient, so a zero-token micro-batch contributes 0, never NaN.
    """
    if per_token.shape != weights.shape:
        raise ValueError(
            f"per-token loss has shape {tuple(per_token.shape)} but the weights have "
            f"{tuple(weights.shape)}; both must be [batch, seq] of the same micro-batch"
        )
    product = per_token.float() * weights
    return torch.where(weights != 0, product, torch.zeros_like(product)).sum()


def weighted_loss(
    weights: torch.Tensor, output_tensor: torch.Tensor, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron ``loss_func`` for a per-token loss tensor (what ``GPTModel`` returns when given
    ``labels``: vocab-parallel cross entropy, ``[batch, seq]``, TP-correct).

    Returns Megatron's 3-tuple ``(sum(w * l), num_tokens, report)``; ``num_tokens`` counts the
    loss tokens of this micro-batch on this rank (after any context-parallel slicing).
    """
    loss = weighted_sum(output_tensor, weights)
    num_tokens = (weights != 0).sum(dtype=torch.int)
    return loss, num_tokens, {}
