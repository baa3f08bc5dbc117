"""Multi-token prediction (MTP) losses under the plugin's reduction.

Megatron's GPTModel computes each MTP layer's loss inside the model, on the loss stage: per layer
it rolls the labels and the loss mask one position to the left (``roll_tensor``), takes the
masked sum of the layer's cross entropy, divides it by the rolled mask's local count (or, in
per-token mode, rescales it by local counts) and attaches the result to the hidden states through
``MTPLossAutoScaler``, whose backward scale the schedule sets. Divided by local counts, the MTP
gradient is the same mean of per-micro-batch means the plugin removes from the main loss.

The plugin normalizes MTP layer ``j`` like the main loss, with the same mode, over that layer's
rolled masks and their global counts (:func:`megatron_lossfix.reduction.shifted_masks`). While
the plugin's forward step runs on the loss stage (:func:`active`), the hooks installed here hand
Megatron, in place of each rolled loss mask, that layer's weights times the factor that undoes
Megatron's averaging, and a count of 1; what Megatron then attaches is ``scale * sum(w_j * l_j)``
exactly, after its own scaling. In per-token mode from megatron-core 0.17, ``process_mtp_loss``
rescales by ``loss_mask.sum() / rolled count``; the hooks let it take its other branch (divide
by the count, 1). Every other call goes to Megatron unchanged: labels and input ids, ``off``,
steps outside the plugin.

The hooks count the rolls: a model that rolls a float mask more or less often than it has MTP
layers in one forward (no ``loss_mask`` passed to the model, a Megatron that changed how it
computes MTP) is reported through :attr:`MTPStep.problem` and the step refused, never silently
mis-weighted. Megatron is imported only by :func:`install_hooks`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["MTPStep", "active", "install_hooks"]


@dataclass(slots=True)
class MTPStep:
    """One step's MTP weights on the loss stage, and what the hooks saw."""

    weights: list[list[torch.Tensor]]
    """``weights[j][k]``: what replaces MTP layer ``j + 1``'s rolled loss mask in micro-batch
    ``k`` (this rank's context-parallel share; the plugin weights times ``factor``)."""
    factor: torch.Tensor | float
    """What the weights were multiplied by to undo Megatron's averaging of the MTP loss."""
    scale: float
    """Megatron's ``mtp_loss_scaling_factor / mtp_num_layers``."""
    microbatch: Callable[[], int]
    """The index of the micro-batch whose forward pass is running."""
    contributions: list[list[torch.Tensor]] = field(default_factory=list)
    """Per layer, each micro-batch's ``sum(w_j * l_j)`` on this rank (for the metrics)."""
    layer: int = 0
    """Masks handed out in the running forward pass."""
    problem: str | None = None
    """Why the step must be refused (the first thing that did not fit), else None."""

    def __post_init__(self) -> None:
        self.contributions = [[] for _ in self.weights]

    @property
    def num_layers(self) -> int:
        return len(self.weights)

    def next_mask(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weights for the next rolled mask, or None (Megatron's own roll) after noting
        why they do not fit."""
        j, k = self.layer, self.microbatch()
        if j >= self.num_layers:
            self._fail(
                f"micro-batch {k}: the model rolled a float loss mask more than once per MTP "
                f"layer ({self.num_layers} layers); megatron-core >= 0.17 does this when the "
                "model gets no labels, which the plugin's MTP normalization does not cover"
            )
            return None
        weights = self.weights[j][k]
        if weights.shape != mask.shape:
            self._fail(
                f"micro-batch {k}: the loss mask the model rolls for MTP is "
                f"{tuple(mask.shape)}, the plugin's weights {tuple(weights.shape)}; slice the "
                "batch for context parallelism with megatron_compat.slice_batch_for_cp"
            )
            return None
        self.layer += 1
        return weights.to(mask.device), torch.ones((), device=mask.device)

    def record(self, attached: torch.Tensor) -> None:
        """Note layer ``layer``'s attached loss, ``scale * sum(w_j * l_j) * factor``."""
        j = self.layer - 1
        if 0 <= j < self.num_layers and self.scale != 0:
            self.contributions[j].append(attached.detach().sum() / (self.scale * self.factor))

    def finish_forward(self) -> None:
        """After one forward pass: every MTP layer must have taken its weights."""
        if self.layer != self.num_layers and self.problem is None:
            self._fail(
                f"micro-batch {self.microbatch()}: the model rolled a float loss mask "
                f"{self.layer} times for {self.num_layers} MTP layers; pass the loss mask to "
                "the model (GPTModel(..., labels=labels, loss_mask=loss_mask)): Megatron "
                "computes the MTP loss inside the model from it"
            )
        self.layer = 0

    def _fail(self, message: str) -> None:
        if self.problem is None:
            self.problem = message


_ACTIVE: MTPStep | None = None


@contextlib.contextmanager
def active(step: MTPStep | None) -> Iterator[None]:
    """Hand ``step``'s weights to Megatron's MTP loss for the duration of one forward pass."""
    global _ACTIVE
    if step is None:
        yield
        return
    _ACTIVE = step
    try:
        yield
    finally:
        _ACTIVE = None
    step.finish_forward()


def _is_mask(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and (
        tensor.is_floating_point() or tensor.dtype == torch.bool
    )


def _hooked_roll(roll: Callable) -> Callable:
    @functools.wraps(roll)
    def roll_tensor(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        step = _ACTIVE
        if step is not None and _is_mask(tensor):
            replaced = step.next_mask(tensor)
            if replaced is not None:
                return replaced
        return roll(tensor, *args, **kwargs)

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
                _ACTIVE.record(mtp_loss)
            return super().apply(output, mtp_loss)

    return RecordingMTPLossAutoScaler


def _hook(module: Any, name: str, make: Callable[[Any], Any]) -> None:
    current = getattr(module, name, None)
    if current is not None and not hasattr(current, "__lossfix_original__"):
        setattr(module, name, make(current))


@functools.cache
def install_hooks() -> None:
    """Hook Megatron's MTP loss, where it lives in this release (idempotent).

    megatron-core 0.16 computes it inline in ``gpt_model``; 0.17+ in
    ``multi_token_prediction.process_mtp_loss``, which ``gpt_model`` imports. The names are
    replaced in the module that calls them; the hooks pass every call through unless a plugin
    step is running its forward pass on the loss stage.
    """
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

    inline = not hasattr(gpt_model, "process_mtp_loss")
    loss_module = gpt_model if inline else mtp
    _hook(loss_module, "roll_tensor", _hooked_roll)
    _hook(loss_module, "MTPLossAutoScaler", _recording_scaler)
    if not inline:
        _hook(gpt_model, "process_mtp_loss", _hooked_process)
