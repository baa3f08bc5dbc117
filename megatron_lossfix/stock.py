"""``reduction="off"``: stock Megatron, looked on for the metrics.

Megatron gets the caller's arguments; nothing is communicated and nothing is required of the
batches, the loss tuple, the iterator or the model config. The loss chunk's iterator is looked
through (:class:`Observer`) to record the loss masks, and the loss function's tuples are
recorded, into the step's record (``StepState``), so that ``step_metrics()`` can report what
it could see. Nothing seen here is ever refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megatron_lossfix.batches import check_finite_inputs, segments_of
from megatron_lossfix.config import LossFixConfig
from megatron_lossfix.lossfunc import check_finite_outputs
from megatron_lossfix.metrics import StepState
from megatron_lossfix.reduction import float_masks

__all__ = ["Observer", "observe_iterators", "observing_forward_step"]


class Observer:
    """``off``: the caller's iterator, looked through. ``next()`` returns what the source
    returns (a dict holding a loss mask gains the mask as its weights, unless it has weights
    already) and raises what the source raises; other attributes are the source's."""

    def __init__(self, source: Any, on_batch: Callable[[Any], Any]):
        self._source = source
        self._on_batch = on_batch

    def __iter__(self) -> Observer:
        return self

    def __next__(self) -> Any:
        return self._on_batch(next(self._source))

    def __getattr__(self, name: str) -> Any:
        if name in ("_source", "_on_batch"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self._source, name)


def observe_iterators(config: LossFixConfig, data_iterator: Any, state: StepState) -> Any:
    """``data_iterator`` with the loss chunk's iterator looked through into ``state``."""
    # Only the loss chunk's iterator is looked through (the last one; on other pipeline
    # stages nobody calls its loss function and what it reads is never used).
    if isinstance(data_iterator, list) and data_iterator:
        return [*data_iterator[:-1], _observed(config, data_iterator[-1], state)]
    if not isinstance(data_iterator, list):
        return _observed(config, data_iterator, state)
    return data_iterator


def _observed(config: LossFixConfig, source: Any, state: StepState) -> Any:
    # Only real iterators: None, a range or a list go to Megatron as they are, to fail (or
    # not) exactly as they do there.
    if source is None or not hasattr(source, "__next__"):
        return source
    return Observer(source, lambda batch: _observe_batch(config, batch, state))


def _observe_batch(config: LossFixConfig, batch: Any, state: StepState) -> Any:
    k = len(state.masks) + state.unmasked
    mask = batch.get(config.loss_mask_key) if isinstance(batch, Mapping) else None
    if config.check_finite and isinstance(batch, Mapping):
        check_finite_inputs(batch, k)
    try:
        if not isinstance(mask, torch.Tensor):
            raise ValueError("no loss mask")
        mask = float_masks([mask])[0]
        segments = segments_of(config, batch, mask, k)
    except ValueError:
        state.unmasked += 1  # stock has no requirement on the batch: recorded, never refused
        return batch
    state.masks.append(mask)
    state.segments.append(segments)
    if config.weights_key in batch:
        return batch
    return {**batch, config.weights_key: mask}


def observing_forward_step(
    config: LossFixConfig, forward_step_func: Callable, state: StepState
) -> Callable:
    """``forward_step_func`` whose loss function's tuples are recorded into ``state``."""

    def forward_step(*args: Any, **kw: Any) -> Any:
        returned = forward_step_func(*args, **kw)
        if not (isinstance(returned, tuple) and len(returned) == 2) or returned[1] is None:
            return returned
        output, loss_func = returned

        def loss(output_tensor: Any, *a: Any, **lkw: Any) -> Any:
            outputs = loss_func(output_tensor, *a, **lkw)
            if not lkw.get("non_loss_data"):
                _record(config, outputs, state)
            return outputs

        return output, loss

    return forward_step


def _record(config: LossFixConfig, outputs: Any, state: StepState) -> None:
    """Remember a loss tuple's numbers for the metrics; never judge it (Megatron does)."""
    loss = num_tokens = report = None
    if isinstance(outputs, (tuple, list)) and len(outputs) in (2, 3):
        loss, report = outputs[0], outputs[-1]
        if len(outputs) == 3 and isinstance(outputs[1], torch.Tensor):
            num_tokens = outputs[1].detach()
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        # A copy: Megatron scales the returned tensor in place right after this call.
        loss = loss.detach().clone().reshape(())
        if config.check_finite:
            check_finite_outputs(loss, report, len(state.raw))
    else:
        loss = None
    state.raw.append((loss, num_tokens))
    state.reports.append(report)
