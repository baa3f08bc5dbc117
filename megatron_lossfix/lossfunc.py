"""The user's loss function inside a plugin step: each loss tuple checked, then rescaled.

Megatron averages what ``loss_func`` returns (docs/design.md §1); :func:`wrap_forward_step`
wraps the user's ``forward_step_func`` so that each loss tuple Megatron receives, after that
averaging, yields exactly ``sum(w * l)`` (§3). A loss tuple the plugin cannot use does not stop
the loss stage: the error is recorded in the step's record (``StepState.problem``), Megatron
gets a zero loss, and the agreement after the schedule refuses the step on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megatron_lossfix.agreement import LOSS_FUNC, MTP_PROBLEM, LocalProblem, default_device
from megatron_lossfix.batches import StepIterator
from megatron_lossfix.config import LossFixConfig
from megatron_lossfix.megatron_compat import undo_averaging
from megatron_lossfix.metrics import StepState
from megatron_lossfix.mtp import active

__all__ = ["check_finite_outputs", "loss_scale", "wrap_forward_step"]


def loss_scale(state: StepState) -> torch.Tensor | float | None:
    """What each micro-batch's ``sum(w * l)`` is multiplied by (None: handed on unchanged)."""
    if state.passthrough:
        return None
    return undo_averaging(
        state.per_token, state.counts.num_tokens, state.num_microbatches, state.groups
    )


def wrap_forward_step(
    config: LossFixConfig,
    forward_step_func: Callable,
    step_iter: StepIterator,
    state: StepState,
) -> Callable:
    """``forward_step_func`` whose loss function, on the loss chunk, is checked and rescaled;
    what it saw goes into ``state`` (the step's record)."""
    scale = loss_scale(state)

    def forward_step(data_iterator: Any, model: Any, *args: Any) -> tuple:
        if data_iterator is not step_iter:
            # Another model chunk: Megatron never calls its loss.
            return forward_step_func(data_iterator, model, *args)
        with active(state.mtp):  # the model computes its MTP losses in this call
            output, loss_func = forward_step_func(data_iterator, model, *args)
        k = step_iter.index
        if state.mtp is not None and state.mtp.problem and state.problem is None:
            state.problem = LocalProblem(MTP_PROBLEM, state.mtp.problem)

        def loss(output_tensor: Any, *a: Any, **kw: Any) -> tuple:
            if state.problem is not None:
                return _zero_loss(output_tensor, state)
            try:
                if k < 0:
                    raise ValueError(
                        "forward_step_func returned without reading its micro-batch from "
                        "the data iterator on the loss stage"
                    )
                outputs = loss_func(output_tensor, *a, **kw)
                if kw.get("non_loss_data"):
                    return outputs
                return _convert(config, outputs, k, scale, state)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it after the step
                message = f"{type(exc).__name__}: {exc}"
                if f"micro-batch {k}" not in message:
                    message = f"micro-batch {k}: {message}"
                state.problem = LocalProblem(LOSS_FUNC, message)
                state.problem.__cause__ = exc
                return _zero_loss(output_tensor, state)

        return output, loss

    return forward_step


def _check_tuple(outputs: Any, k: int, per_token: bool) -> None:
    """Raise ``ValueError`` when ``outputs`` is not a loss tuple this path can use."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
        raise ValueError(
            "loss_func must return (loss, num_tokens, report) or (loss, report); got "
            + (
                f"a tuple of length {len(outputs)}"
                if isinstance(outputs, (tuple, list))
                else type(outputs).__name__
            )
        )
    loss = outputs[0]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise ValueError(
            f"loss_func must return a one-element loss tensor first, got "
            f"{type(loss).__name__}{shape} (micro-batch {k})"
        )
    if len(outputs) == 2 and per_token:
        raise ValueError(
            "calculate_per_token_loss=True needs loss_func to return (loss, num_tokens, "
            "report), the loss tokens of the micro-batch on this rank; got (loss, report). "
            "Return a 3-tuple (megatron_lossfix.weighted_loss does), or set "
            "calculate_per_token_loss=False."
        )


def _convert(
    config: LossFixConfig,
    outputs: Any,
    k: int,
    scale: torch.Tensor | float | None,
    state: StepState,
) -> tuple:
    """Check one micro-batch's loss tuple, record it, and return what Megatron should
    receive."""
    _check_tuple(outputs, k, bool(state.per_token))
    loss, report = outputs[0], outputs[-1]
    if config.check_finite:
        check_finite_outputs(loss, report, k)
    num_tokens = outputs[1] if len(outputs) == 3 else None
    state.contributions.append(loss.detach().reshape(()))
    if num_tokens is not None:
        state.local_tokens.append(num_tokens.detach())
    state.reports.append(report)
    if state.passthrough:
        return outputs  # Megatron's own semantics, untouched
    if state.per_token:
        return loss * scale, num_tokens, report
    return loss * scale, report


def _zero_loss(output_tensor: Any, state: StepState) -> tuple:
    """A loss of 0 with the output's graph, in the form Megatron expects: the schedule ends
    normally (backward sends zero gradients upstream) and the step is refused after it."""
    if isinstance(output_tensor, torch.Tensor) and output_tensor.is_floating_point():
        zero = (output_tensor * 0).sum().float()
    else:
        zero = torch.zeros((), device=default_device())
    if state.per_token:
        return zero, torch.zeros((), dtype=torch.int, device=zero.device), {}
    return zero, {}


def check_finite_outputs(loss: torch.Tensor, report: Any, k: int) -> None:
    """Raise ``FloatingPointError`` on a non-finite loss or a NaN report entry (check_finite;
    a host sync per micro-batch, which is why it is opt-in)."""
    if not bool(torch.isfinite(loss).all()):
        raise FloatingPointError(
            f"loss of micro-batch {k} is not finite ({loss.item()}); check_finite is on"
        )
    for key, value in report.items() if isinstance(report, Mapping) else ():
        # Extremes (ratio_min/_max) may legitimately be +-inf on a zero-token micro-batch.
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and bool(torch.isnan(value).any())
        ):
            raise FloatingPointError(
                f"report entry {key!r} of micro-batch {k} is NaN (check_finite is on)"
            )
