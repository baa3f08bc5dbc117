"""Losses with Tinker semantics: plain weighted sums of per-token losses, and their weights.

Megatron's pipeline schedule calls ``loss_func(output_tensor)``; bind the micro-batch's weights
first: ``partial(weighted_loss, batch.get("loss_weights", batch["loss_mask"]))`` (under ``off``
no weights come in, and the mask is stock's weight). The weights already hold the step's
normalization, so every function here returns ``sum(w * l)``, never a mean. A loop that does
not use ``LossFixSchedule`` builds the weights itself with :func:`loss_weights`. A loss that
decides after the forward pass which tokens count says so with ``keep=`` (docs/design.md §10).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.kept import kept_weights
from megatron_lossfix.reduction import (
    REDUCTIONS,
    bad_mask_message,
    bad_mask_values,
    check_mode,
    count_tokens,
    float_masks,
    weights_from_counts,
)

__all__ = ["loss_weights", "weighted_loss", "weighted_sum"]


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
    weights: torch.Tensor,
    output_tensor: torch.Tensor,
    *,
    keep: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron ``loss_func`` for a per-token loss tensor (what ``GPTModel`` returns when given
    ``labels``: vocab-parallel cross entropy, ``[batch, seq]``, TP-correct).

    ``keep``: the tokens the loss keeps, a ``[batch, seq]`` mask or a function of the detached
    per-token loss that returns one (e.g. ``lambda l: l < 8``, decided after the forward pass);
    dropped tokens are zeroed, or leave the normalization under
    ``LossFixConfig(mask_in_loss=True)`` (:func:`~megatron_lossfix.kept.kept_weights`).

    Returns Megatron's 3-tuple ``(sum(w * l), num_tokens, report)``; ``num_tokens`` counts the
    loss tokens of this micro-batch on this rank (after any context-parallel slicing).
    """
    if callable(keep):
        keep = keep(output_tensor.detach())
    loss = weighted_sum(output_tensor, kept_weights(weights, keep))
    num_tokens = (weights != 0).sum(dtype=torch.int)
    return loss, num_tokens, {}


def loss_weights(
    loss_masks: Sequence[torch.Tensor],
    reduction: str,
    *,
    norm_constant: float | None = None,
    dp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """Per-token weights ``w`` for this rank's micro-batches: ``sum(w * loss)`` over the whole
    mini-batch is the step's loss under ``reduction`` (one of :data:`REDUCTIONS`).

    ``loss_masks``: this rank's ``[batch, seq]`` masks (bool or 0/1), CP shards with
    ``cp_group``; ``dp_group``: data-parallel group without CP. Returns float32 tensors of the
    masks' shapes; with both groups None nothing is communicated. Raises ``ValueError`` for an
    unknown mode, a missing or bad ``norm_constant``, or a malformed mask.
    """
    check_mode(reduction, norm_constant, REDUCTIONS)
    masks = float_masks(loss_masks)
    bad = bad_mask_values(masks)
    if bool(bad.any()):
        raise ValueError(bad_mask_message(int(bad.nonzero()[0, 0])))
    global_counts = reduction in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")
    counts = count_tokens(masks, global_counts=global_counts, dp_group=dp_group, cp_group=cp_group)
    return weights_from_counts(masks, counts, reduction, norm_constant=norm_constant)
