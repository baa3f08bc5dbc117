"""Per-token loss weights for every reduction mode, from counts reduced once per step.

The modes and their formulas: docs/design.md §2.

A step's loss is ``L = sum_{s,t} w[s,t] * l[s,t]`` over the whole mini-batch. This module turns
the step's loss masks into the weights ``w``: it counts loss tokens per sequence and per
micro-batch, reduces the counts over the context-parallel group (a sequence is split over CP
ranks) and the data-parallel group (sequences live on one DP rank), and divides.

Collectives per call, whatever the data: one all-reduce over CP when ``cp_group`` has more than
one rank and the masks are CP shards; one all-reduce over DP for the modes that need global
counts (``token_mean``, ``sequence_mean``, ``seq_mean_token_sum_norm``) when ``dp_group`` has
more than one rank. Nothing is reduced over TP (every TP rank sees the same tokens) or over the
world group. Counts stay on the device: no host synchronization except the optional mask check.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "REDUCTIONS",
    "GLOBAL_COUNT_MODES",
    "StepCounts",
    "bad_mask_message",
    "bad_mask_values",
    "check_norm_constant",
    "check_reduction",
    "count_tokens",
    "float_masks",
    "group_size",
    "loss_weights",
    "norm_constant_misplaced",
    "segment_ids",
    "shifted_masks",
    "weights_from_counts",
]

REDUCTIONS: tuple[str, ...] = (
    "token_mean",
    "sequence_mean",
    "seq_mean_token_sum_norm",
    "sum",
    "token_mean_legacy",
)

#: Modes whose weights depend on counts summed over data-parallel ranks.
GLOBAL_COUNT_MODES: frozenset[str] = frozenset(
    {"token_mean", "sequence_mean", "seq_mean_token_sum_norm"}
)

# Counts are reduced in float64: float32 is exact only up to 2**24 (16.7M) tokens per step.
_COUNT_DTYPE = torch.float64


@dataclass(frozen=True, slots=True)
class StepCounts:
    """Loss-token counts of one step, as seen by one rank (all on the masks' device)."""

    num_tokens: torch.Tensor
    """N: loss tokens in the whole mini-batch (0-dim; global when the DP group was given)."""
    num_sequences: torch.Tensor
    """S: sequences with at least one loss token in the whole mini-batch (0-dim)."""
    seq_tokens: list[torch.Tensor]
    """n_s for each local sequence, one ``[num_sequences_k]`` vector per micro-batch, summed
    over CP shards."""
    mb_tokens: torch.Tensor
    """n_k: loss tokens of each local micro-batch over all CP shards, ``[M]``."""
    dp_size: int
    """D: data-parallel size (without context parallelism)."""

    @property
    def num_microbatches(self) -> int:
        """M: this rank's micro-batch count."""
        return len(self.seq_tokens)


def check_norm_constant(norm_constant: object) -> None:
    """Raise ``ValueError`` unless ``norm_constant`` is None or a finite real number > 0."""
    if norm_constant is None:
        return
    if isinstance(norm_constant, bool) or not isinstance(norm_constant, numbers.Real):
        raise ValueError(
            f"norm_constant (--loss-norm-constant) must be a number, got {norm_constant!r}"
        )
    if not (math.isfinite(norm_constant) and norm_constant > 0):  # also rejects NaN
        raise ValueError(
            f"norm_constant (--loss-norm-constant) must be > 0 and finite, got {norm_constant!r}"
        )


def check_reduction(reduction: str, norm_constant: float | None) -> None:
    """Raise ``ValueError`` for an unknown mode, a bad ``norm_constant``, or a constant given to
    a mode that does not use it (it would be silently ignored)."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {REDUCTIONS}")
    if reduction != "seq_mean_token_sum_norm" and norm_constant is not None:
        raise ValueError(norm_constant_misplaced(reduction))
    check_norm_constant(norm_constant)
    if reduction == "seq_mean_token_sum_norm" and norm_constant is None:
        raise ValueError(
            "reduction 'seq_mean_token_sum_norm' needs norm_constant (e.g. the maximum "
            "response length); pass --loss-norm-constant"
        )


def norm_constant_misplaced(reduction: object) -> str:
    """The message for a ``norm_constant`` given with a mode that does not use it."""
    return (
        "norm_constant (--loss-norm-constant) applies only to reduction "
        f"seq_mean_token_sum_norm, not {reduction}; drop it or change the reduction"
    )


def float_masks(loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Check the masks' structure (no device sync) and return them as float32."""
    if isinstance(loss_masks, torch.Tensor) or not isinstance(loss_masks, Sequence):
        raise ValueError(
            "loss_masks must be a list of per-micro-batch [batch, seq] tensors, got "
            f"{type(loss_masks).__name__}"
        )
    if len(loss_masks) == 0:
        raise ValueError("loss_masks is empty: a step needs at least one micro-batch")
    device = None
    masks = []
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
        if device is None:
            device = mask.device
        elif mask.device != device:
            raise ValueError(
                f"loss masks live on different devices ({device} and {mask.device}, "
                f"micro-batch {k})"
            )
        masks.append(mask.to(torch.float32))
    return masks


def bad_mask_values(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per micro-batch, on the device: does the float32 mask hold anything but 0 and 1?

    A fractional or negative "mask" would silently reweight tokens, so it is refused.
    """
    return torch.stack([((m != 0) & (m != 1)).any() for m in masks])


def _check_masks(loss_masks: Sequence[torch.Tensor], *, check_values: bool) -> list[torch.Tensor]:
    """Validate masks and return them as float32; one device sync when checking values."""
    masks = float_masks(loss_masks)
    if check_values:
        bad = bad_mask_values(masks)
        if bool(bad.any()):
            raise ValueError(bad_mask_message(int(bad.nonzero()[0, 0])))
    return masks


def bad_mask_message(k: int) -> str:
    """Why micro-batch ``k``'s mask was refused (the schedule raises the same words)."""
    return (
        f"loss mask of micro-batch {k} must hold only 0 and 1 (bool or 0/1 float); "
        "found other values (negative, fractional, NaN or > 1)"
    )


def group_size(group: dist.ProcessGroup | None) -> int:
    """The number of ranks in ``group``; ``None`` (no such parallelism) counts as 1."""
    return 1 if group is None else dist.get_world_size(group)


def count_tokens(
    masks: Sequence[torch.Tensor],
    *,
    global_counts: bool = True,
    dp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    segment_ids: Sequence[torch.Tensor | None] | None = None,
    num_segments: Sequence[int | None] | None = None,
) -> StepCounts:
    """Count loss tokens per sequence, micro-batch and step, reduced over CP then DP.

    ``masks`` are float32 ``[batch, seq]``. Sequences are the rows, unless ``segment_ids[k]``
    (long, same shape as the mask) assigns each token to one of ``num_segments[k]`` packed
    sequences. ``global_counts=False`` skips the DP all-reduce (modes that need no global N/S).
    """
    seq_local = []
    for k, mask in enumerate(masks):
        seg = None if segment_ids is None else segment_ids[k]
        if seg is None:
            seq_local.append(mask.sum(dim=1, dtype=_COUNT_DTYPE))
        else:
            counts = torch.zeros(int(num_segments[k]), dtype=_COUNT_DTYPE, device=mask.device)
            values = mask.reshape(-1).to(_COUNT_DTYPE)
            seq_local.append(counts.index_add_(0, seg.reshape(-1), values))
    sizes = [c.numel() for c in seq_local]
    flat = torch.cat(seq_local)
    if group_size(cp_group) > 1:
        # A sequence's tokens are spread over the CP ranks: n_s is their sum.
        dist.all_reduce(flat, group=cp_group)
    seq_tokens = list(torch.split(flat, sizes))
    mb_tokens = torch.stack([c.sum() for c in seq_tokens])
    # After the CP reduction every CP rank holds identical n_s, so N and S are summed over DP
    # only: each sequence is counted once.
    totals = torch.stack([flat.sum(), (flat > 0).sum(dtype=_COUNT_DTYPE)])
    if global_counts and group_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    return StepCounts(
        num_tokens=totals[0],
        num_sequences=totals[1],
        seq_tokens=seq_tokens,
        mb_tokens=mb_tokens,
        dp_size=group_size(dp_group),
    )


def weights_from_counts(
    masks: Sequence[torch.Tensor],
    counts: StepCounts,
    reduction: str,
    *,
    norm_constant: float | None = None,
    segment_ids: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Turn float32 masks and the step's counts into float32 per-token weights.

    Denominators are clamped to 1 where the numerator is 0 anyway (empty sequences, zero-token
    micro-batches, an all-zero mini-batch), so no weight is ever NaN or Inf.
    """
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    if reduction == "sum":
        return [m.clone() for m in masks]
    if reduction == "token_mean":
        inv = (one / counts.num_tokens.clamp(min=1)).to(torch.float32)
        return [m * inv for m in masks]
    if reduction == "seq_mean_token_sum_norm":
        inv = (one / (counts.num_sequences.clamp(min=1) * float(norm_constant))).to(torch.float32)
        return [m * inv for m in masks]
    if reduction == "token_mean_legacy":
        scale = float(counts.num_microbatches * counts.dp_size)
        inv = (one / (counts.mb_tokens.clamp(min=1) * scale)).to(torch.float32)
        return [m * inv[k] for k, m in enumerate(masks)]
    if reduction == "sequence_mean":
        out = []
        for k, m in enumerate(masks):
            denom = counts.seq_tokens[k].clamp(min=1) * counts.num_sequences.clamp(min=1)
            inv_seq = (one / denom).to(torch.float32)
            seg = None if segment_ids is None else segment_ids[k]
            per_token = inv_seq[:, None] if seg is None else inv_seq[seg]
            out.append(m * per_token)
        return out
    raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {REDUCTIONS}")


def segment_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
    """A packed (THD) row's sequence index per token, ``[1, num_tokens]``, and the number of
    segments, from its 1-D cumulative sequence lengths (starting at 0).

    Tokens past the last boundary (padding) land in one extra segment, normally empty: the count
    is ``len(cu_seqlens)``. The inverse of how the packing laid the sequences out, so that
    ``sequence_mean`` weighs each packed sequence like a row of its own.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor of cumulative lengths starting at 0")
    positions = torch.arange(num_tokens, device=cu_seqlens.device)
    boundaries = cu_seqlens.to(dtype=torch.long)[1:].contiguous()
    segment = torch.searchsorted(boundaries, positions, right=True)
    return segment[None, :], cu_seqlens.numel()


def shifted_masks(masks: Sequence[torch.Tensor], shift: int) -> list[torch.Tensor]:
    """The loss masks of multi-token prediction layer ``shift``: position ``t`` holds the mask of
    position ``t + shift`` of its sequence, and the last ``shift`` positions hold 0, as after
    ``shift`` calls of Megatron's ``roll_tensor(mask, shifts=-1)`` on whole sequences."""
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


def loss_weights(
    loss_masks: Sequence[torch.Tensor],
    reduction: str,
    *,
    norm_constant: float | None = None,
    dp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """Per-token weights ``w`` for this rank's micro-batches, so that ``sum(w * loss)`` over the
    whole mini-batch is the step's loss under ``reduction`` (docs/design.md §2).

    Args:
        loss_masks: this rank's micro-batch masks, each ``[batch, seq]`` (bool or 0/1 float);
            with ``cp_group``, this rank's context-parallel shard of each sequence.
        reduction: one of :data:`REDUCTIONS`.
        norm_constant: C of ``seq_mean_token_sum_norm`` (required there, > 0).
        dp_group: data-parallel group (without CP); counts are summed over it.
        cp_group: context-parallel group; per-sequence counts are summed over it.

    Returns:
        One float32 weight tensor per micro-batch, same shapes as the masks. With both groups
        ``None`` nothing is communicated and the list is the whole mini-batch.

    Raises:
        ValueError: unknown mode, missing or non-positive ``norm_constant``, malformed masks.
    """
    check_reduction(reduction, norm_constant)
    masks = _check_masks(loss_masks, check_values=True)
    counts = count_tokens(
        masks,
        global_counts=reduction in GLOBAL_COUNT_MODES,
        dp_group=dp_group,
        cp_group=cp_group,
    )
    return weights_from_counts(masks, counts, reduction, norm_constant=norm_constant)
