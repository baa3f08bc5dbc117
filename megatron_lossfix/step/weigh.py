"""The step's weights, once the counts are agreed: each micro-batch's, each MTP layer's, what
``kept_weights`` serves in this step, and the factor that undoes Megatron's averaging.

Each function reads the step's record (filled by the phases before) and returns what it
builds; the step driver writes it into the record (:mod:`megatron_lossfix.step.record`).
"""

from __future__ import annotations

from typing import Any

import torch

import megatron_lossfix.step.megatron_compat as megatron_compat
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mask_in_loss import KeptStep, Phase, phase_for
from megatron_lossfix.runtime.weights import StepCounts, weights_from_counts
from megatron_lossfix.step.agreement import default_device
from megatron_lossfix.step.mtp import MTPStep, mtp_step
from megatron_lossfix.step.record import StepData, StepRecord

__all__ = ["kept_phase", "kept_step", "loss_factor", "microbatch_weights", "mtp_weights"]


def microbatch_weights(record: StepRecord, data: StepData) -> list[torch.Tensor]:
    """Each of the loss stage's micro-batches' weights, ``batch[config.weights_key]``."""
    cfg = record.config
    weights = data.masks  # per-token token_mean: Megatron's division by N is exact
    if not record.passthrough:
        weights = weights_from_counts(
            data.masks,
            record.counts,
            cfg.reduction,
            norm_constant=cfg.norm_constant,
            segment_ids=data.segment_ids,
        )
    return weights


def mtp_weights(
    record: StepRecord, mtp_masks: list[list[torch.Tensor]], mtp_counts: list[StepCounts]
) -> MTPStep | None:
    """The MTP layers' weights and what their hooks will record (None without MTP layers)."""
    if not mtp_counts:
        return None
    factor = loss_factor(record, mtp=True)
    scaling = record.model_config.mtp_loss_scaling_factor
    return mtp_step(record.config, mtp_masks, mtp_counts, factor, record.groups, scaling)


def kept_phase(
    config: LossFixConfig, model_config: Any, forward_only: bool, grouped: bool
) -> Phase:
    """The step's :class:`~megatron_lossfix.runtime.mask_in_loss.Phase`, the same on every rank: it
    depends on the config, the model, the call and the agreed presence of group ids only. A
    ``mask_in_loss`` step counts in a pass of its own where asked to, where a gradient scale
    after the schedule would also rescale terms outside the loss, or where the weights are over
    groups (no one scale is right); a forward-only call (evaluation) without groups has no
    gradient, and its loss waits for the counts."""
    side_paths = bool(megatron_compat.gradient_side_paths(model_config)) and not forward_only
    counting = config.counting_pass and not forward_only
    return phase_for(config.reduction, config.mask_in_loss, counting, side_paths, grouped)


def kept_step(record: StepRecord, data: StepData) -> KeptStep:
    """The loss stage's :class:`~megatron_lossfix.runtime.mask_in_loss.KeptStep` for this step."""
    groups = record.groups
    rows = [
        int(mask.shape[0]) if num is None else int(num)
        for mask, num in zip(data.masks, data.num_segments, strict=True)
    ]
    packed = any(ids is not None for ids in data.segment_ids)
    return KeptStep(
        mode=record.config.reduction,
        phase=record.phase,
        rows=rows,
        device=data.masks[0].device if data.masks else default_device(),
        dp_size=groups.dp_size,
        cp_group=groups.cp if groups.cp_size > 1 else None,
        norm_constant=record.config.norm_constant,
        segment_ids=data.segment_ids if packed else None,
        group_ids=data.group_ids if record.grouped else None,
        dp_cp_group=groups.dp_cp,
    )


def loss_factor(record: StepRecord, *, mtp: bool = False) -> torch.Tensor | float | None:
    """The factor that undoes Megatron's averaging of this step's main or MTP loss; None where
    the loss tuples go to Megatron unchanged (``passthrough``). A ``DEFERRED`` step on
    Megatron's per-token path hands the kept tokens as the count by which Megatron divides:
    its losses go through unscaled."""
    if record.passthrough and not mtp:
        return None
    if record.phase is Phase.DEFERRED and record.per_token and not mtp:
        return 1.0
    return megatron_compat.undo_averaging(
        record.per_token,
        record.counts.num_tokens,
        record.num_microbatches,
        record.groups,
        mtp=mtp,
    )
