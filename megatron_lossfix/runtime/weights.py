"""Masks -> counts -> weights (pure torch, docs/design.md §2); each mode's own rule is its record
in :mod:`megatron_lossfix.runtime.modes`.

A step's loss is ``L = sum_{s,t} w[s,t] * l[s,t]`` over the whole mini-batch. The weights ``w``
come from the step's loss masks: loss tokens are counted per sequence and per micro-batch, the
per-sequence counts summed over the context-parallel group (a sequence is split over CP ranks),
N and S over the data-parallel group (a sequence lives on one DP rank); never over TP or the
world. Counts stay on the device, in float64 (float32 is exact only up to 2**24 tokens).

Group counts (:class:`~megatron_lossfix.runtime.prompt_groups.GroupIds`): where sequences carry a
group id global over the step (a prompt group for ``group_mean``, a trajectory for the sequence
modes), loss tokens are also counted per group, over every micro-batch and every DP and CP rank.
Where they carry a pair id, each micro-batch's own (``pair_mean``), the pairs with a loss token
are counted beside N and S (P).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

# LossFixConfig and the mode names lived here before: importing them from here keeps working.
from megatron_lossfix.runtime.config import LossFixConfig, check_mode
from megatron_lossfix.runtime.mode_formulas import pair_tokens
from megatron_lossfix.runtime.mode_record import Ids
from megatron_lossfix.runtime.modes import (
    ALIASES,
    MODES,
    REDUCTIONS,
    canonical_mode,
    mode_of,
)
from megatron_lossfix.runtime.process_groups import group_size
from megatron_lossfix.runtime.prompt_groups import (
    GroupIds,
    group_tokens,
    missing_group_ids_message,
    missing_pair_ids_message,
)

__all__ = [
    "ALIASES",
    "MODES",
    "REDUCTIONS",
    "LossFixConfig",
    "StepCounts",
    "any_bad_mask_value",
    "bad_mask_message",
    "bad_mask_values",
    "canonical_mode",
    "check_mode",
    "count_tokens",
    "float_masks",
    "local_pairs",
    "segment_ids",
    "shifted_masks",
    "weights_from_counts",
]

_COUNT_DTYPE = torch.float64


@dataclass(frozen=True, slots=True)
class StepCounts:
    """Loss-token counts of one step as one rank sees them (on the masks' device)."""

    num_tokens: torch.Tensor
    """N: loss tokens of the whole mini-batch (0-dim; global once reduced over DP)."""
    num_sequences: torch.Tensor
    """S: sequences with at least one loss token in the whole mini-batch (0-dim)."""
    seq_tokens: list[torch.Tensor]
    """n_s of each local sequence (all CP shards), one vector per micro-batch."""
    mb_tokens: torch.Tensor
    """n_k: loss tokens of each local micro-batch (all CP shards), ``[M]``."""
    dp_size: int
    """D: data-parallel size (without CP)."""
    group_tokens: torch.Tensor | None = None
    """With group ids: the loss tokens of each group (prompt or trajectory), ``[count]``
    (global once reduced over DP x CP, like N)."""
    group_ids: list[torch.Tensor] | None = None
    """With group ids: the group of each local sequence, one vector per micro-batch (pair ids:
    its pair in the micro-batch)."""
    num_pairs: torch.Tensor | None = None
    """With pair ids: P, the pairs with a loss token in the whole mini-batch (0-dim; global
    once reduced over DP, like N)."""


def float_masks(loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Check the masks' structure (no device sync) and return them as float32."""
    if isinstance(loss_masks, torch.Tensor) or not isinstance(loss_masks, Sequence):
        raise ValueError(
            "loss_masks must be a list of per-micro-batch [batch, seq] tensors, got "
            f"{type(loss_masks).__name__}"
        )
    if len(loss_masks) == 0:
        raise ValueError("loss_masks is empty: a step needs at least one micro-batch")
    for k, mask in enumerate(loss_masks):
        if not isinstance(mask, torch.Tensor):
            raise ValueError(
                f"loss mask of micro-batch {k} is a {type(mask).__name__}, not a Tensor"
            )
        if mask.dim() != 2:
            raise ValueError(
                f"loss mask of micro-batch {k} must be [batch, seq], got shape {tuple(mask.shape)}"
            )
        if mask.is_complex():
            raise ValueError(f"loss mask of micro-batch {k} has unsupported dtype {mask.dtype}")
        if mask.device != loss_masks[0].device:
            raise ValueError(
                f"loss masks live on different devices ({loss_masks[0].device} and "
                f"{mask.device}, micro-batch {k})"
            )
    return [mask.to(torch.float32) for mask in loss_masks]


def bad_mask_values(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per micro-batch, on the device: does the mask hold anything but 0 and 1 (which would
    silently reweight tokens)?"""
    return torch.stack([((m != 0) & (m != 1)).any() for m in masks])


def any_bad_mask_value(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether any mask holds anything but 0 and 1, a 0-dim bool on the device, in a few
    kernels whatever the number of masks (:func:`bad_mask_values` says which)."""
    flat = torch.cat([m.reshape(-1) for m in masks])
    return ((flat != 0) & (flat != 1)).any()


def bad_mask_message(k: int) -> str:
    return (
        f"loss mask of micro-batch {k} must hold only 0 and 1 (bool or 0/1 float); "
        "found other values (negative, fractional, NaN or > 1)"
    )


def count_tokens(
    masks: Sequence[torch.Tensor],
    *,
    global_counts: bool = True,
    dp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    segment_ids: Sequence[torch.Tensor | None] | None = None,
    num_segments: Sequence[int | None] | None = None,
    groups: GroupIds | None = None,
) -> StepCounts:
    """Count the float32 ``masks``' loss tokens per sequence, micro-batch and step.

    Sequences are rows, unless ``segment_ids[k]`` assigns each token to one of
    ``num_segments[k]`` packed sequences. n_s is summed over ``cp_group`` (the masks are CP
    shards), then N and S over ``dp_group`` unless ``global_counts=False``. With ``groups`` the
    tokens of each group ride in the same all-reduces (no collective of their own); their ids
    must have been checked (:func:`~megatron_lossfix.runtime.prompt_groups.bad_id_values`).
    """
    rows = _rows_at_once(masks, segment_ids)
    if rows is not None:  # one kernel for every micro-batch's rows
        flat = rows.sum(dim=1, dtype=_COUNT_DTYPE)
        seq_local = list(torch.split(flat, [m.shape[0] for m in masks]))
    else:
        seq_local = []
        for k, mask in enumerate(masks):
            seg = None if segment_ids is None else segment_ids[k]
            if seg is None:
                seq_local.append(mask.sum(dim=1, dtype=_COUNT_DTYPE))
            else:
                counts = torch.zeros(int(num_segments[k]), dtype=_COUNT_DTYPE, device=mask.device)
                seq_local.append(counts.index_add_(0, seg.reshape(-1), mask.reshape(-1).double()))
        flat = torch.cat(seq_local)
    # The groups' counts come from the local shards: summed over CP with n_s, over DP with N.
    pairs = groups is not None and groups.ranges is not None
    per_key = None if groups is None or pairs else group_tokens(seq_local, groups)
    num_seq = flat.numel()
    if group_size(cp_group) > 1:
        both = flat if per_key is None else torch.cat([flat, per_key])
        dist.all_reduce(both, group=cp_group)
        flat, per_key = both[:num_seq], (None if per_key is None else both[num_seq:])
    seq_tokens = list(torch.split(flat, [c.numel() for c in seq_local]))
    # Every CP rank now holds the same n_s: N and S are summed over DP only.
    totals = torch.stack([flat.sum(), (flat > 0).sum(dtype=_COUNT_DTYPE)])
    if pairs:  # P from the whole sequences' counts: each pair lies in one micro-batch
        totals = torch.cat([totals, local_pairs(seq_tokens, groups.ids)[None]])
    if per_key is not None:
        totals = torch.cat([totals, per_key])
    if global_counts and group_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    sizes = {c.numel() for c in seq_tokens}
    if len(sizes) == 1:  # as many sequences in every micro-batch: one kernel
        mb_tokens = flat.view(len(seq_tokens), sizes.pop()).sum(dim=1)
    else:
        mb_tokens = torch.stack([c.sum() for c in seq_tokens])
    return StepCounts(
        num_tokens=totals[0],
        num_sequences=totals[1],
        seq_tokens=seq_tokens,
        mb_tokens=mb_tokens,
        dp_size=group_size(dp_group),
        group_tokens=None if per_key is None else totals[2:],
        group_ids=None if groups is None else list(groups.ids),
        num_pairs=totals[2] if pairs else None,
    )


def local_pairs(
    seq_tokens: Sequence[torch.Tensor], pair_ids: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The pairs with a loss token among one rank's micro-batches (0-dim float64), from each
    sequence's loss tokens over all CP shards and its pair id in its micro-batch."""
    held = [
        (pair_tokens(n, ids) > 0).sum(dtype=_COUNT_DTYPE)
        for n, ids in zip(seq_tokens, pair_ids, strict=True)
    ]
    return torch.stack(held).sum()


def _rows_at_once(
    masks: Sequence[torch.Tensor], segment_ids: Sequence[torch.Tensor | None] | None
) -> torch.Tensor | None:
    """Every micro-batch's rows in one ``[rows, seq]`` tensor, where none is packed and they
    share a width, a dtype and a device; else None."""
    if not masks or (segment_ids is not None and any(s is not None for s in segment_ids)):
        return None
    first = masks[0]
    if any(
        m.dim() != 2 or m.shape[1] != first.shape[1] or m.dtype != first.dtype
        or m.device != first.device for m in masks
    ):  # fmt: skip
        return None
    return torch.cat(list(masks))


def weights_from_counts(
    masks: Sequence[torch.Tensor],
    counts: StepCounts,
    reduction: str,
    *,
    norm_constant: float | None = None,
    segment_ids: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Float32 per-token weights from float32 masks and the step's counts. Denominators are
    clamped to 1 where the numerator is 0 anyway: no weight is ever NaN or Inf."""
    mode = mode_of(reduction)
    if mode.stock:
        raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {REDUCTIONS}")
    if counts.group_ids is not None and mode.group_weights is not None:
        return mode.group_weights(masks, counts, norm_constant, segment_ids)
    if mode.weights is None:  # a mode that needs its ids, and the step has none
        missing = missing_pair_ids_message if mode.ids is Ids.PAIRS else missing_group_ids_message
        raise ValueError(missing())
    return mode.weights(masks, counts, norm_constant, segment_ids)


def segment_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
    """A packed row's sequence index per token, ``[1, num_tokens]``, and the segment count
    (``len(cu_seqlens)``: tokens past the last boundary, padding, form one more segment)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor of cumulative lengths starting at 0")
    positions = torch.arange(num_tokens, device=cu_seqlens.device)
    boundaries = cu_seqlens.to(dtype=torch.long)[1:].contiguous()
    return torch.searchsorted(boundaries, positions, right=True)[None, :], cu_seqlens.numel()


def shifted_masks(masks: Sequence[torch.Tensor], shift: int) -> list[torch.Tensor]:
    """MTP layer ``shift``'s masks: position ``t`` holds the mask of ``t + shift``, the last
    ``shift`` positions 0, as after ``shift`` calls of Megatron's ``roll_tensor(mask, -1)``."""
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    out = []
    for mask in masks:
        shifted = torch.zeros_like(mask)
        keep = mask.shape[-1] - shift
        if keep > 0:
            shifted[..., :keep] = mask[..., shift:]
        out.append(shifted)
    return out
