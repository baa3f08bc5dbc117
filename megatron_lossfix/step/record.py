"""The step's record and the data it reads: what one step leaves behind, and who writes what.

A :class:`StepRecord` is filled in as the step runs (:mod:`megatron_lossfix.step.driver`); each
field has one owner, the phase that produces its value, and the step driver writes it once, from
that phase's return value (``kept_counts`` once per agreement after a pass):

=====================================  ======================================================
field                                  owner (module: function)
=====================================  ======================================================
``config``, ``num_microbatches``,      the driver, when the step starts
``pg_collection``                      (``step: Step.__call__``)
``model_config``, ``groups``           prepare (``step_read: model_settings``;
                                       ``megatron_compat.resolve_groups``)
``counts``, ``grouped``                agree (``step_agree: agree_counts``)
``phase``                              weigh (``step_weigh: kept_phase``)
``kept``                               weigh (``step_weigh: kept_step``)
``mtp``                                weigh (``step_weigh: mtp_weights``)
``contributions``, ``reports``         the micro-batch pass (``step_microbatch: PassLog``);
                                       with ``off``, the stock call (``step: Step._stock``)
``kept_counts``                        the agreement after a pass (``step_after: agree_kept``)
``loss_scale``                         after the schedule (``step_after: after_schedule``)
=====================================  ======================================================

Nothing else writes the record: the micro-batch index and what the loss closure needs travel
as arguments (:mod:`megatron_lossfix.step.microbatch`), and a rank's problem is a value that
each phase returns and the next agreement reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mask_in_loss import KeptCounts, KeptStep, Phase
from megatron_lossfix.runtime.mode_record import megatron_normalizes
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.process_groups import StepGroups
from megatron_lossfix.runtime.prompt_groups import GroupIds
from megatron_lossfix.runtime.weights import StepCounts, count_tokens
from megatron_lossfix.step.mtp import MTPStep

__all__ = ["StepData", "StepRecord"]


@dataclass(slots=True)
class StepRecord:
    """This rank's record of one step, filled in as the step runs (tensors stay on device).

    :attr:`Step.last_step` holds the record of the last step that went through: the step's
    metrics reduce it, and the self-check puts the normal run's record back after its re-runs.
    """

    config: LossFixConfig
    """The schedule's configuration."""
    num_microbatches: int
    pg_collection: Any
    """The process groups the step was given (the call's, else the schedule's; None: Megatron's
    ``parallel_state``)."""
    groups: StepGroups | None = None
    """The step's groups; None with ``off``, which resolves nothing (the metrics do, on
    demand, from :attr:`pg_collection`)."""
    model_config: Any = None
    """The model's config (None with ``off``)."""
    counts: StepCounts | None = None
    """The step's global counts (plugin modes, loss stage)."""
    mtp: MTPStep | None = None
    """The MTP layers' weights and recorded losses (plugin modes, loss stage)."""
    contributions: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's ``sum(w * l)``."""
    reports: list[Any] = field(default_factory=list)
    """The loss functions' reports (``off``: the list Megatron's schedule returned)."""
    phase: Phase | None = None
    """What ``kept_weights`` serves in this step (every rank; None with ``off``)."""
    kept: KeptStep | None = None
    """The masks the loss decided (loss stage, plugin modes)."""
    kept_counts: KeptCounts | None = None
    """Their agreed counts (every rank; None where no loss said what it kept)."""
    grouped: bool = False
    """Whether the weights are over group ids (``group_mean``; the sequence modes with
    trajectory ids), as agreed by every rank of the step."""
    loss_scale: float = 1.0
    """What each recorded contribution is multiplied by to give L: the global factor a
    ``DEFERRED`` step applied to its gradients after the schedule (1 otherwise)."""

    @property
    def per_token(self) -> bool:
        """The model's ``calculate_per_token_loss``."""
        return bool(getattr(self.model_config, "calculate_per_token_loss", False))

    @property
    def passthrough(self) -> bool:
        """Whether the loss tuples go to Megatron unchanged: ``off``, and ``token_mean`` on
        Megatron's per-token path, whose division by the all-reduced N already is the mode."""
        normalized = megatron_normalizes(mode_of(self.config.reduction), self.per_token)
        return normalized and not self.config.mask_in_loss  # stock has no mask_in_loss


@dataclass(frozen=True, slots=True)
class StepData:
    """The loss stage's micro-batches as read before Megatron's schedule (empty elsewhere)."""

    batches: list = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    """Float32 loss masks, one per micro-batch."""
    segments: list[tuple[torch.Tensor | None, int | None]] = field(default_factory=list)
    """Per micro-batch: each token's packed-sequence index and their number (None: rows)."""
    group_ids: GroupIds | None = None
    """Each sequence's group (``group_mean``) or trajectory (the sequence modes), where the
    mode weights by them and the micro-batches carry them; their range is not checked yet."""

    @property
    def segment_ids(self) -> list[torch.Tensor | None]:
        return [ids for ids, _ in self.segments]

    @property
    def num_segments(self) -> list[int | None]:
        return [num for _, num in self.segments]

    def counts(self, masks: list[torch.Tensor], **groups: Any) -> StepCounts:
        """``masks`` (these micro-batches' or their shift) counted with their segments."""
        return count_tokens(
            masks, segment_ids=self.segment_ids, num_segments=self.num_segments, **groups
        )
