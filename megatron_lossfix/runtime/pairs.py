"""A pair's weight: what a loss over preference pairs (DPO, a reward model's pairs, a KTO
example) multiplies each pair's loss by under ``pair_mean`` (docs/modes.md).

The plugin's weights stay per token; under ``pair_mean`` the tokens of a pair add up to
``1 / P``. A loss that is not a sum over tokens (``-logsigmoid`` of the difference of two
sequences' log-prob sums) takes each pair's weight as that sum and returns
``sum_p pair_weight[p] * loss[p]``: every pair of the step then counts the same, whatever
micro-batch holds it and however many pairs that micro-batch holds. Under context parallelism
each rank's sum is its shard's part, and the parts add up to ``1 / P`` over the CP ranks (the
pair's log-probs are summed over CP before its loss, with autograd, as for any CP loss).

Pure torch, no Megatron.
"""

from __future__ import annotations

import torch

from megatron_lossfix.runtime.weights import segment_ids

__all__ = ["pair_weights"]


def pair_weights(
    weights: torch.Tensor, pair_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Each pair's weight in one micro-batch: entry ``j`` is the sum of ``weights`` over the
    tokens of the sequences whose pair id is ``j`` (0 for an id no sequence has).

    ``weights``: the micro-batch's ``[rows, seq]`` weights (``batch["loss_weights"]``);
    ``pair_ids``: one integer per sequence, in ``[0, sequences)``: per row, or per packed
    sequence of ``cu_seqlens`` (a ``[1, T]`` row). Returns ``[sequences]`` float32 on the
    weights' device. No device sync."""
    if cu_seqlens is None:
        if weights.dim() != 2 or pair_ids.shape != (weights.shape[0],):
            raise ValueError(
                f"pair_ids must hold one id per row: shape ({weights.shape[0]},) for weights "
                f"of shape {tuple(weights.shape)}, got {tuple(pair_ids.shape)}"
            )
        per_sequence = weights.float().sum(dim=1)
    else:
        if weights.dim() != 2 or weights.shape[0] != 1:
            raise ValueError(f"packed weights must be [1, T], got {tuple(weights.shape)}")
        seg, num = segment_ids(cu_seqlens, weights.shape[1])
        if pair_ids.shape != (num - 1,):
            raise ValueError(
                f"pair_ids must hold one id per cu_seqlens sequence ({num - 1}), got shape "
                f"{tuple(pair_ids.shape)}"
            )
        sums = torch.zeros(num, dtype=torch.float32, device=weights.device)
        per_sequence = sums.index_add_(0, seg[0], weights[0].float())[:-1]
    ids = pair_ids.to(device=weights.device, dtype=torch.long)
    out = torch.zeros(ids.numel(), dtype=torch.float32, device=weights.device)
    return out.index_add_(0, ids, per_sequence)
