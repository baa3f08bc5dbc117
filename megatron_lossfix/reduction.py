"""The modes and their settings, and masks -> counts -> weights (pure torch, docs/design.md §2).

A step's loss is ``L = sum_{s,t} w[s,t] * l[s,t]`` over the whole mini-batch. The weights ``w``
come from the step's loss masks: loss tokens are counted per sequence and per micro-batch, the
per-sequence counts summed over the context-parallel group (a sequence is split over CP ranks),
N and S over the data-parallel group (a sequence lives on one DP rank); never over TP or the
world. Counts stay on the device, in float64 (float32 is exact only up to 2**24 tokens).

Group counts (:class:`~megatron_lossfix.group_ids.GroupIds`): where sequences carry a group id
global over the step (a prompt group for ``group_mean``, a trajectory for the sequence modes),
loss tokens are also counted per group, over every micro-batch and every DP and CP rank.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lossfix.group_ids import (
    GroupIds,
    group_tokens,
    ids_for_mode,
    missing_group_ids_message,
)
from megatron_lossfix.groups import group_size

#: The plugin's modes (docs/design.md §2).
REDUCTIONS: tuple[str, ...] = (
    "token_mean",
    "sequence_mean",
    "seq_mean_token_sum_norm",
    "sum",
    "token_mean_legacy",
    "group_mean",
)
#: Other names of modes: SkyRL calls ``group_mean`` over prompt groups ``prompt_mean``.
ALIASES: dict[str, str] = {"prompt_mean": "group_mean"}
#: Every accepted ``--loss-reduction``: the modes, and ``off`` (stock Megatron).
MODES: tuple[str, ...] = (*REDUCTIONS, "off")
_COUNT_DTYPE = torch.float64


def canonical_mode(reduction: str) -> str:
    """The mode an alias names (``prompt_mean`` -> ``group_mean``); other names unchanged."""
    return ALIASES.get(reduction, reduction)


def check_mode(reduction: object, norm_constant: object, modes: tuple[str, ...]) -> None:
    """Raise ``ValueError`` for an unknown mode or a bad, missing or misplaced constant.

    ``modes`` lists the accepted names; an alias of one of them is accepted too."""
    if isinstance(reduction, str) and ALIASES.get(reduction) in modes:
        reduction = ALIASES[reduction]
    if not isinstance(reduction, str) or reduction not in modes:
        aliases = ", ".join(f"{a} = {m}" for a, m in ALIASES.items() if m in modes)
        raise ValueError(
            f"unknown loss reduction {reduction!r} (--loss-reduction); choose one of {modes}"
            + (f" (aliases: {aliases})" if aliases else "")
        )
    uses_constant = reduction == "seq_mean_token_sum_norm"
    if norm_constant is None:
        if uses_constant:
            raise ValueError(
                "reduction 'seq_mean_token_sum_norm' needs norm_constant (e.g. the maximum "
                "response length); pass --loss-norm-constant"
            )
        return
    if not uses_constant:
        raise ValueError(
            "norm_constant (--loss-norm-constant) applies only to reduction "
            f"seq_mean_token_sum_norm, not {reduction}; drop it or change the reduction"
        )
    if isinstance(norm_constant, bool) or not isinstance(norm_constant, numbers.Real):
        raise ValueError(
            f"norm_constant (--loss-norm-constant) must be a number, got {norm_constant!r}"
        )
    if not (math.isfinite(norm_constant) and norm_constant > 0):
        raise ValueError(
            f"norm_constant (--loss-norm-constant) must be > 0 and finite, got {norm_constant!r}"
        )


@dataclass(kw_only=True, slots=True)
class LossFixConfig:
    """How the plugin normalizes the loss of one optimizer step (flags: ``args.from_args``)."""

    reduction: str = "token_mean"
    """One of ``MODES``; ``off`` leaves Megatron's per-micro-batch mean (stock)."""

    norm_constant: float | None = None
    """C of ``seq_mean_token_sum_norm`` (Dr. GRPO), e.g. the maximum response length; > 0."""

    loss_mask_key: str = "loss_mask"
    """Key of the ``[batch, seq]`` 0/1 loss mask in each micro-batch dict from the iterator."""

    weights_key: str = "loss_weights"
    """Key under which the plugin puts the float32 per-token weights into each micro-batch."""

    cu_seqlens_key: str = "cu_seqlens"
    """Key of a packed (THD) micro-batch's cumulative sequence lengths: its ``[1, T]`` mask
    holds several sequences, each counted as its own. Without it each row is a sequence."""

    group_ids_key: str = "group_ids"
    """Key of each sequence's group id (``group_mean``: a prompt's id, the same for all its
    responses), an integer tensor with one entry per row (packed: per ``cu_seqlens`` sequence),
    in ``[0, batch[num_groups_key])`` and global over the step."""

    num_groups_key: str = "num_groups"
    """Key of the step's group id range (an int, the same in every micro-batch and on every
    rank); groups without a loss token in the step neither contribute nor count."""

    trajectory_ids_key: str = "trajectory_ids"
    """Key of each sequence's trajectory id, like ``group_ids_key``: where given, the sequence
    modes weight trajectories (a trajectory split into several rows counts once)."""

    num_trajectories_key: str = "num_trajectories"
    """Key of the step's trajectory id range, like ``num_groups_key``."""

    data_is_cp_sharded: bool = False
    """True when the iterator yields this rank's context-parallel shard of each sequence; False
    (Megatron-LM's convention) when ``forward_step`` slices whole sequences with
    ``slice_batch_for_cp`` (the weights are sliced along)."""

    validate: bool = True
    """Refuse masks holding values other than 0 and 1, and ranks that disagree on the mode, on
    every rank at once (rides on the step's count all-reduce; one device sync per step)."""

    check_finite: bool = False
    """Raise, naming micro-batch and tensor, on a NaN/Inf floating input, loss or report entry
    (device syncs per micro-batch: for debugging). Plugin modes only."""

    mask_in_loss: bool = False
    """What a token the loss drops (``kept_weights``, ``weighted_loss(keep=)``, ``rl_objective``'s
    masks) means: False, its loss is zeroed and it still counts in the normalization; True, it
    leaves every count of the mode, exactly under every layout (docs/design.md §10)."""

    counting_pass: bool = False
    """With ``mask_in_loss``: always learn the kept counts from a forward-only pass before the
    step (one extra forward), instead of scaling the gradients once after Megatron's schedule.
    The step takes that path by itself where the scale would be wrong (MoE auxiliary losses,
    multi-token prediction)."""

    self_check: bool | None = None
    """At the first training step, re-run its data split into other micro-batches and raise
    ``SelfCheckError`` when the gradient changes (a forward-only pass and one or two extra
    passes, once, no copy of the gradient): it catches a loss function that returns a mean
    instead of the weighted sum. ``None`` (the default): on
    in every mode but ``off`` and ``token_mean_legacy``, skipped silently where the step
    cannot be re-split or an integration cannot run it; ``True``: on, and refused (or warned
    about) where it cannot run; ``False``: off (``--no-lossfix-self-check``)."""

    self_check_tolerance: float = 1e-5
    """The largest relative L2 gradient change the self-check accepts (about 1e-2 with bf16)."""

    def __post_init__(self) -> None:
        # The one validation: the flags (``args.from_args``) come through here too.
        check_mode(self.reduction, self.norm_constant, MODES)
        self.reduction = canonical_mode(self.reduction)
        switches = {
            "validate": "--lossfix-no-validate",
            "check_finite": "--lossfix-check-finite",
            "data_is_cp_sharded": "no flag",
            "self_check": "--[no-]lossfix-self-check",
            "mask_in_loss": "--lossfix-mask-in-loss",
            "counting_pass": "--lossfix-counting-pass",
        }
        for name, flag in switches.items():
            value, default = getattr(self, name), " or None (the default)" * (name == "self_check")
            if not isinstance(value, bool) and not (default and value is None):
                raise ValueError(f"{name} ({flag}) must be True or False{default}, got {value!r}")
        keys = (
            "loss_mask_key",
            "weights_key",
            "cu_seqlens_key",
            "group_ids_key",
            "num_groups_key",
            "trajectory_ids_key",
            "num_trajectories_key",
        )
        for name in keys:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string (a batch key), got {value!r}")
        tol = self.self_check_tolerance
        if (
            isinstance(tol, bool)
            or not isinstance(tol, (int, float))
            or not (math.isfinite(tol) and tol > 0)
        ):
            raise ValueError(
                "self_check_tolerance (--lossfix-self-check-tolerance) must be a finite number "
                f"> 0, got {tol!r}"
            )
        if self.loss_mask_key == self.weights_key:
            raise ValueError("loss_mask_key and weights_key must differ")
        if self.mask_in_loss and self.reduction == "off":
            raise ValueError(
                "mask_in_loss (--lossfix-mask-in-loss) needs a plugin mode: with "
                "--loss-reduction off Megatron normalizes as stock; pick a mode or drop the flag"
            )
        if self.counting_pass and not self.mask_in_loss:
            raise ValueError(
                "counting_pass (--lossfix-counting-pass) applies only with mask_in_loss "
                "(--lossfix-mask-in-loss); add that flag or drop this one"
            )


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
    """With group ids: the group of each local sequence, one vector per micro-batch."""


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
    must have been checked (:func:`~megatron_lossfix.group_ids.bad_id_values`).
    """
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
    per_key = None if groups is None else group_tokens(seq_local, groups)
    num_seq = flat.numel()
    if group_size(cp_group) > 1:
        both = flat if per_key is None else torch.cat([flat, per_key])
        dist.all_reduce(both, group=cp_group)
        flat, per_key = both[:num_seq], (None if per_key is None else both[num_seq:])
    seq_tokens = list(torch.split(flat, [c.numel() for c in seq_local]))
    # Every CP rank now holds the same n_s: N and S are summed over DP only.
    totals = torch.stack([flat.sum(), (flat > 0).sum(dtype=_COUNT_DTYPE)])
    if per_key is not None:
        totals = torch.cat([totals, per_key])
    if global_counts and group_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    return StepCounts(
        num_tokens=totals[0],
        num_sequences=totals[1],
        seq_tokens=seq_tokens,
        mb_tokens=torch.stack([c.sum() for c in seq_tokens]),
        dp_size=group_size(dp_group),
        group_tokens=None if per_key is None else totals[2:],
        group_ids=None if groups is None else list(groups.ids),
    )


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
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    if counts.group_tokens is not None and ids_for_mode(reduction) is not None:
        return _group_weights(masks, counts, reduction, norm_constant, segment_ids)
    if reduction == "group_mean":
        raise ValueError(missing_group_ids_message())
    if reduction == "sum":
        return [m.clone() for m in masks]
    if reduction == "token_mean":
        inv = (one / counts.num_tokens.clamp(min=1)).float()
        return [m * inv for m in masks]
    if reduction == "seq_mean_token_sum_norm":
        inv = (one / (counts.num_sequences.clamp(min=1) * float(norm_constant))).float()
        return [m * inv for m in masks]
    if reduction == "token_mean_legacy":
        scale = float(len(counts.seq_tokens) * counts.dp_size)
        inv = (one / (counts.mb_tokens.clamp(min=1) * scale)).float()
        return [m * inv[k] for k, m in enumerate(masks)]
    if reduction == "sequence_mean":
        out = []
        for k, m in enumerate(masks):
            inv_seq = one / (counts.seq_tokens[k].clamp(min=1) * counts.num_sequences.clamp(min=1))
            seg = None if segment_ids is None else segment_ids[k]
            out.append(m * (inv_seq.float()[:, None] if seg is None else inv_seq.float()[seg]))
        return out
    raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {REDUCTIONS}")


def _group_weights(
    masks: Sequence[torch.Tensor],
    counts: StepCounts,
    reduction: str,
    norm_constant: float | None,
    segment_ids: Sequence[torch.Tensor | None] | None,
) -> list[torch.Tensor]:
    """The weights over groups: G groups with a loss token, n_g tokens of group g.
    ``group_mean`` and ``sequence_mean`` over trajectories: ``m / (G * n_g)``;
    ``seq_mean_token_sum_norm`` over trajectories: ``m / (G * C)``."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    n_group = counts.group_tokens.to(counts.num_tokens.device)
    num_groups = (n_group > 0).sum(dtype=_COUNT_DTYPE).clamp(min=1)
    if reduction == "seq_mean_token_sum_norm":
        inv = (one / (num_groups * float(norm_constant))).float()
        return [m * inv for m in masks]
    inv_group = one / (n_group.clamp(min=1) * num_groups)
    out = []
    for k, m in enumerate(masks):
        ids = counts.group_ids[k].to(device=inv_group.device, dtype=torch.long)
        inv_seq = inv_group[ids].float().to(m.device)
        seg = None if segment_ids is None else segment_ids[k]
        out.append(m * (inv_seq[:, None] if seg is None else inv_seq[seg]))
    return out


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
