"""The micro-batch wrapping: one pass of Megatron's schedule over the loss stage's micro-batches.

:class:`MicroBatches` hands the user's ``forward_step`` each micro-batch with its weights
(``batch[config.weights_key]``); :func:`wrap_forward_step` wraps ``forward_step`` so that, on
the loss chunk, each loss tuple is checked, recorded and multiplied by what undoes Megatron's
averaging (:func:`scale_loss`). On an error the problem is noted in the pass's
:class:`PassLog` and Megatron gets a zero loss; the step refuses itself on every rank after
the schedule (:mod:`megatron_lossfix.step.after`).

Values travel as arguments: the index ``k`` of the micro-batch a forward step reads is the
iterator's position when the step starts, handed to the MTP hooks (``mtp.active(mtp, k)``),
the kept masks (``kept.active(k)``) and the loss closure; what the closure needs for the whole
pass is one :class:`PassSettings`. Nothing here synchronizes with the host unless
``check_finite`` asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mask_in_loss import KeptStep, Phase
from megatron_lossfix.step.agreement import Problem, StepRefused, default_device
from megatron_lossfix.step.mtp import MTPStep, active

__all__ = ["MicroBatches", "PassLog", "PassSettings", "scale_loss", "wrap_forward_step"]


class MicroBatches(Iterator[dict]):
    """One pass over the loss stage's micro-batches, each with its weights; :attr:`taken`
    counts those handed out (the counting pass and the real one each get their own)."""

    def __init__(self, batches: list, weights: list[torch.Tensor], config: LossFixConfig) -> None:
        self._batches, self._weights, self._config = batches, weights, config
        self.taken = 0
        """Micro-batches handed out: the next one's index."""

    def __iter__(self) -> MicroBatches:
        return self

    def __next__(self) -> dict:
        k = self.taken
        if k >= len(self._batches):
            raise StopIteration
        self.taken = k + 1
        batch, cfg = self._batches[k], self._config
        if cfg.check_finite:
            check_finite(batch.items(), f"micro-batch {k}: {{!r}} holds NaN or Inf")
        return {**batch, cfg.weights_key: self._weights[k]}


@dataclass(frozen=True, slots=True)
class PassSettings:
    """What the loss closure needs, the same for every micro-batch of one pass."""

    config: LossFixConfig
    per_token: bool
    """The model's ``calculate_per_token_loss``."""
    passthrough: bool
    """The loss tuples go to Megatron unchanged (``StepRecord.passthrough``)."""
    scale: torch.Tensor | float | None
    """What each loss is multiplied by (None with ``passthrough``)."""
    kept: KeptStep
    """The step's kept masks."""
    mtp: MTPStep | None
    """The MTP layers' weights (None without MTP layers)."""
    counting: bool = False
    """The counting pass's: the loss only tells the step what it keeps."""


@dataclass(slots=True)
class PassLog:
    """What one pass over the micro-batches produced, written by the wrapped forward step and
    its loss closure only."""

    contributions: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's ``sum(w * l)``."""
    reports: list[Any] = field(default_factory=list)
    """The loss functions' reports."""
    problem: StepRefused | None = None
    """The first problem met in the pass (the step is refused after the schedule)."""


def wrap_forward_step(
    forward_step_func: Callable,
    batches: MicroBatches | None,
    settings: PassSettings | None,
    log: PassLog,
) -> Callable:
    """``forward_step_func`` whose loss function, on the loss chunk (the one that reads
    ``batches``; None: not the loss stage), is checked, recorded into ``log`` and rescaled."""
    if batches is None or settings is None:  # not the loss stage
        return forward_step_func
    mtp = None if settings.counting else settings.mtp

    def forward_step(data_iterator: Any, model: Any, *args: Any) -> tuple:
        if data_iterator is not batches:  # another chunk: Megatron never calls its loss
            return forward_step_func(data_iterator, model, *args)
        k = batches.taken  # the micro-batch this forward step reads
        with active(mtp, k):  # the model computes MTP losses here
            output, loss_func = forward_step_func(data_iterator, model, *args)
        read = batches.taken > k
        if settings.mtp is not None and settings.mtp.problem and log.problem is None:
            log.problem = Problem.MTP.refusal(settings.mtp.problem)

        def loss(output_tensor: Any, *a: Any, **kw: Any) -> tuple:
            return _microbatch_loss(settings, log, k, read, loss_func, output_tensor, a, kw)

        return output, loss

    return forward_step


def _microbatch_loss(
    settings: PassSettings,
    log: PassLog,
    k: int,
    read: bool,
    loss_func: Callable,
    output_tensor: Any,
    args: tuple,
    kwargs: dict,
) -> Any:
    """Micro-batch ``k``'s loss through ``loss_func``, checked and scaled; a zero loss after a
    problem (noted in ``log``). ``read``: whether its forward step read it."""
    kept = settings.kept
    if log.problem is not None:
        return zero_loss(output_tensor, settings.per_token, kept, k)
    try:
        if not read:
            raise ValueError(
                "forward_step_func returned without reading its micro-batch from "
                "the data iterator on the loss stage"
            )
        with kept.active(k):
            outputs = loss_func(output_tensor, *args, **kwargs)
        if kwargs.get("non_loss_data"):
            return outputs
        if kept.phase is not Phase.ZERO and not kept.called[k]:
            raise ValueError(
                "mask_in_loss is on, but loss_func did not say which tokens it kept: "
                "weigh the per-token losses with megatron_lossfix.kept_weights(weights, "
                "keep) (weighted_loss(..., keep=) and rl_objective do)"
            )
        if settings.counting:
            return zero_loss(output_tensor, settings.per_token, kept, k)
        kept.finish(k)
        return scale_loss(outputs, k, settings, log)
    except Exception as exc:  # noqa: BLE001 - every rank hears of it after the step
        message = f"{type(exc).__name__}: {exc}"
        if f"micro-batch {k}" not in message:
            message = f"micro-batch {k}: {message}"
        log.problem = Problem.LOSS_FUNC.refusal(message, exc)
        return zero_loss(output_tensor, settings.per_token, kept, k)


def scale_loss(outputs: Any, k: int, settings: PassSettings, log: PassLog) -> tuple:
    """Check micro-batch ``k``'s loss tuple and record it in ``log``; what Megatron should
    receive."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
        is_tuple = isinstance(outputs, (tuple, list))
        got = f"a tuple of length {len(outputs)}" if is_tuple else type(outputs).__name__
        raise ValueError(
            f"loss_func must return (loss, num_tokens, report) or (loss, report); got {got}"
        )
    loss, report = outputs[0], outputs[-1]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise ValueError(
            f"loss_func must return a one-element loss tensor first, got "
            f"{type(loss).__name__}{shape} (micro-batch {k})"
        )
    if len(outputs) == 2 and settings.per_token:
        raise ValueError(
            "calculate_per_token_loss=True needs loss_func to return (loss, num_tokens, "
            "report), the loss tokens of the micro-batch on this rank; got (loss, report). "
            "Return a 3-tuple (megatron_lossfix.weighted_loss does), or set "
            "calculate_per_token_loss=False."
        )
    if settings.config.check_finite:  # a host sync per micro-batch: opt-in
        if not bool(torch.isfinite(loss).all()):
            raise FloatingPointError(
                f"loss of micro-batch {k} is not finite ({loss.item()}); check_finite is on"
            )
        # Extremes (ratio_min/_max) may legitimately be +-inf on a zero-token micro-batch.
        entries = report.items() if isinstance(report, Mapping) else ()
        check_finite(entries, f"report entry {{!r}} of micro-batch {k} is NaN", torch.isnan)
    log.contributions.append(loss.detach().reshape(()))
    log.reports.append(report)
    if settings.passthrough:
        return outputs  # Megatron's own semantics, untouched
    scale = settings.scale
    if settings.per_token:
        num_tokens = outputs[1]
        if settings.config.mask_in_loss:  # the step decides what Megatron divides by
            num_tokens = settings.kept.num_tokens(k, num_tokens)
        return loss * scale, num_tokens, report
    return loss * scale, report


def check_finite(entries: Any, message: str, bad: Callable = lambda t: ~torch.isfinite(t)) -> None:
    """Raise ``FloatingPointError`` for the first floating tensor among ``(key, value)``
    ``entries`` holding a value ``bad`` flags; ``message`` names the key."""
    for key, value in entries:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and bool(bad(value).any()):
            raise FloatingPointError(message.format(key) + " (check_finite is on)")


def zero_loss(
    output_tensor: Any, per_token: bool, kept: KeptStep | None = None, k: int = -1
) -> tuple:
    """A zero loss with the output's graph, in Megatron's form: the schedule ends normally
    (backward sends zero gradients upstream) and the step is refused after it. The kept
    masks' CP sum of micro-batch ``k`` still happens (its peers wait for it)."""
    if kept is not None and k >= 0:
        kept.finish(k)
    if isinstance(output_tensor, torch.Tensor) and output_tensor.is_floating_point():
        zero = (output_tensor * 0).sum().float()
    else:
        zero = torch.zeros((), device=default_device())
    if per_token:
        return zero, torch.zeros((), dtype=torch.int, device=zero.device), {}
    return zero, {}
