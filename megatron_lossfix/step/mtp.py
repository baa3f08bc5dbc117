"""Multi-token prediction (MTP) losses under the plugin's modes (docs/design.md §3).

Megatron computes each MTP layer's loss inside the model: it rolls the loss mask one position
left per layer (``roll_tensor``), divides the masked sum by the rolled mask's local count and
attaches it with ``MTPLossAutoScaler``: a mean of per-micro-batch means. The plugin normalizes
layer ``j`` like the main loss, over the masks shifted by ``j`` and their global counts. While
its forward step runs on the loss stage (:func:`active`, given the micro-batch's index), the
hooks hand Megatron, in place of each rolled mask, that layer's weights times the factor that
undoes Megatron's averaging, and a count of 1 (from 0.17 ``process_mtp_loss`` is also kept off
its per-token rescaling). Every other call passes through. A model that rolls a float mask more
or less often than it has MTP layers is reported in :attr:`MTPStep.problem`, and the step refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.process_groups import StepGroups
from megatron_lossfix.runtime.weights import StepCounts, weights_from_counts
from megatron_lossfix.step.megatron_compat import slice_batch_for_cp


@dataclass(slots=True)
class MTPStep:
    """One step's MTP weights on the loss stage, and what the hooks saw."""

    weights: list[list[torch.Tensor]]
    """``weights[j][k]``: what replaces layer ``j + 1``'s rolled mask in micro-batch ``k``."""
    factor: torch.Tensor | float
    """What the weights were multiplied by to undo Megatron's averaging of the MTP loss."""
    scale: float
    """Megatron's ``mtp_loss_scaling_factor / mtp_num_layers``."""
    contributions: list[list[torch.Tensor]] = field(default_factory=list)
    """Per layer, each micro-batch's ``sum(w_j * l_j)`` on this rank (for the metrics)."""
    layer: int = 0
    """Masks handed out in the running forward pass."""
    problem: str | None = None
    """The first thing that did not fit (the step is then refused), else None."""

    def __post_init__(self) -> None:
        self.contributions = [[] for _ in self.weights]

    def next_mask(self, mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weights and count for the next rolled mask of micro-batch ``k``; None (Megatron's
        own roll) after noting why they do not fit."""
        j, layers = self.layer, len(self.weights)
        if j >= layers:
            return self._fail(
                f"micro-batch {k}: the model rolled a float loss mask more than once per MTP "
                f"layer ({layers} layers); megatron-core >= 0.17 does this when the model "
                "gets no labels, which the plugin's MTP normalization does not cover"
            )
        weights = self.weights[j][k]
        if weights.shape != mask.shape:
            return self._fail(
                f"micro-batch {k}: the loss mask the model rolls for MTP is "
                f"{tuple(mask.shape)}, the plugin's weights {tuple(weights.shape)}; slice the "
                "batch for context parallelism with megatron_compat.slice_batch_for_cp"
            )
        self.layer += 1
        return weights.to(mask.device), torch.ones((), device=mask.device)

    def record(self, attached: torch.Tensor) -> None:
        """Note the current layer's attached loss, ``scale * sum(w_j * l_j) * factor``."""
        j = self.layer - 1
        if 0 <= j < len(self.weights) and self.scale != 0:
            self.contributions[j].append(attached.detach().sum() / (self.scale * self.factor))

    def finish_forward(self, k: int) -> None:
        """After micro-batch ``k``'s forward pass: every MTP layer must have taken its weights."""
        if self.layer != len(self.weights):
            self._fail(
                f"micro-batch {k}: the model rolled a float loss mask "
                f"{self.layer} times for {len(self.weights)} MTP layers; pass the loss mask to "
                "the model (GPTModel(..., labels=labels, loss_mask=loss_mask)): Megatron "
                "computes the MTP loss inside the model from it"
            )
        self.layer = 0

    def _fail(self, message: str) -> None:
        if self.problem is None:
            self.problem = message


def mtp_step(
    config: LossFixConfig,
    layer_masks: list[list[torch.Tensor]],
    layer_counts: list[StepCounts],
    factor: torch.Tensor | float,
    groups: StepGroups,
    scaling_factor: float,
) -> MTPStep:
    """Each layer's weights: the mode over its shifted masks and global counts, times
    ``factor`` (``megatron_compat.undo_averaging(..., mtp=True)``), sliced for context
    parallelism."""
    install_hooks()
    weights = []
    for masks, counts in zip(layer_masks, layer_counts, strict=True):
        layer = weights_from_counts(
            masks, counts, config.reduction, norm_constant=config.norm_constant
        )
        layer = [w * factor for w in layer]
        if groups.cp_size > 1:
            layer = [slice_batch_for_cp({"w": w}, groups.cp)["w"] for w in layer]
        weights.append(layer)
    scale = float(scaling_factor) / len(weights)
    return MTPStep(weights=weights, factor=factor, scale=scale)


_ACTIVE: tuple[MTPStep, int] | None = None
"""The step whose weights the hooks hand out, and the micro-batch whose forward pass runs."""


@contextlib.contextmanager
def active(step: MTPStep | None, k: int) -> Iterator[None]:
    """Hand ``step``'s weights of micro-batch ``k`` to Megatron's MTP loss for the duration of
    its forward pass."""
    global _ACTIVE
    if step is None:
        yield
        return
    _ACTIVE = (step, k)
    try:
        yield
    finally:
        _ACTIVE = None
    step.finish_forward(k)


def _hooked_roll(roll: Callable) -> Callable:
    @functools.wraps(roll)
    def roll_tensor(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        is_mask = isinstance(tensor, torch.Tensor) and (
            tensor.is_floating_point() or tensor.dtype == torch.bool
        )
        replaced = None
        if _ACTIVE is not None and is_mask:
            step, k = _ACTIVE
            replaced = step.next_mask(tensor, k)
        return roll(tensor, *args, **kwargs) if replaced is None else replaced

    roll_tensor.__lossfix_original__ = roll
    return roll_tensor


class _NotPerToken:
    """A model config seen as ``calculate_per_token_loss=False`` (everything else unchanged)."""

    calculate_per_token_loss = False

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name == "_config":
            raise AttributeError(name)
        return getattr(self._config, name)


def _hooked_process(process: Callable) -> Callable:
    @functools.wraps(process)
    def process_mtp_loss(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE is not None and "config" in kwargs:
            kwargs["config"] = _NotPerToken(kwargs["config"])
        return process(*args, **kwargs)

    process_mtp_loss.__lossfix_original__ = process
    return process_mtp_loss


def _recording_scaler(scaler: type) -> type:
    class RecordingMTPLossAutoScaler(scaler):  # type: ignore[misc, valid-type]
        """Megatron's MTPLossAutoScaler, noting each attached loss during a plugin step."""

        __lossfix_original__ = scaler

        @classmethod
        def apply(cls, output: torch.Tensor, mtp_loss: torch.Tensor) -> Any:  # type: ignore[override]
            if _ACTIVE is not None:
                _ACTIVE[0].record(mtp_loss)
            return super().apply(output, mtp_loss)

    return RecordingMTPLossAutoScaler


def _hook(module: Any, name: str, make: Callable[[Any], Any]) -> None:
    current = getattr(module, name, None)
    if current is not None and not hasattr(current, "__lossfix_original__"):
        setattr(module, name, make(current))


@functools.cache
def install_hooks() -> None:
    """Hook Megatron's MTP loss where this release computes it (idempotent): inline in
    ``gpt_model`` up to 0.16, in ``multi_token_prediction.process_mtp_loss`` from 0.17."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

    inline = not hasattr(gpt_model, "process_mtp_loss")
    loss_module = gpt_model if inline else mtp
    _hook(loss_module, "roll_tensor", _hooked_roll)
    _hook(loss_module, "MTPLossAutoScaler", _recording_scaler)
    if not inline:
        _hook(gpt_model, "process_mtp_loss", _hooked_process)
