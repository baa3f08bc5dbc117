"""The counting pass: the step's data through Megatron's schedule forward-only, before the step.

A ``mask_in_loss`` step whose gradient cannot wait for the kept counts (docs/design.md §10: the
gradient holds terms besides the loss, such as MoE auxiliary losses or multi-token prediction,
that a scale after the schedule would rescale too; or ``LossFixConfig.counting_pass``) learns them
first: every rank runs the schedule with ``forward_only=True`` and without autograd, the loss
stage's loss functions only telling the step what they keep. What each data iterator yields is
kept and replayed to the real pass, so both passes see the same micro-batches on every pipeline
stage and model chunk; the RNG states (PyTorch's, and Megatron's CUDA RNG tracker) are put
back, so the real pass draws the same dropout as without the counting pass. Under no autograd
Megatron's router adds no auxiliary loss and counts no tokens for its expert bias.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["counting_pass", "recorded", "replaying", "rng_restored"]


def counting_pass(
    schedule: Callable[..., Any],
    call: dict,
    forward_step_func: Callable,
    iterators: list,
    loss_iterators: tuple[Iterator, Iterator] | None,
) -> list:
    """Run ``schedule`` forward-only with ``forward_step_func`` over the step's data; return the
    data iterators for the real pass, which replay what each of ``iterators`` yielded.

    ``loss_iterators``: on the loss stage, the last chunk's iterator for this pass and the one
    for the real pass (both over the micro-batches the step already holds)."""
    counting, replays = [], []
    for i, source in enumerate(iterators):
        if loss_iterators is not None and i == len(iterators) - 1:
            counting.append(loss_iterators[0])
            replays.append(loss_iterators[1])
        elif source is None:
            counting.append(None)
            replays.append(None)
        else:
            items: list = []
            counting.append(recorded(source, items))
            replays.append(replaying(items, source))
    as_list = isinstance(call["data_iterator"], list)
    kwargs = {
        **call,
        "forward_step_func": forward_step_func,
        "data_iterator": counting if as_list else counting[0],
        "forward_only": True,
    }
    with rng_restored(), torch.no_grad():
        schedule(**kwargs)
    return replays


def recorded(source: Iterator, items: list) -> Iterator:
    """``source``'s items, each also appended to ``items`` (dicts copied: forward_step may pop)."""
    for item in iter(lambda: next(source), object()):  # RerunDataIterator has no __iter__
        items.append(dict(item) if isinstance(item, Mapping) else item)
        yield item


def replaying(items: list, source: Iterator) -> Iterator:
    """``items`` again, then whatever ``source`` still yields."""
    for item in items:
        yield dict(item) if isinstance(item, Mapping) else item
    yield from iter(lambda: next(source), object())


@contextlib.contextmanager
def rng_restored() -> Iterator[None]:
    """PyTorch's RNG states (CPU and every initialized CUDA device) and Megatron's CUDA RNG
    tracker's states, as they were before."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices, device_type="cuda"):
        try:
            yield
        finally:
            tracker.set_states(dict(states))
