"""What the step reads, and the self-check's replays of it (docs/design.md §9, step 1).

What ``forward_step`` reads from each data iterator is learnt once (:func:`read_step`): read
ahead where the step itself reads all its micro-batches before its schedule (the step then
reads and agrees on them without running its schedule), else in a forward-only pass. Every
later run of the check gets the step's call over what was read, as read or re-split
(:func:`replays`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from megatron_lossfix.step.counting_pass import recorded, replaying, rng_restored
from megatron_lossfix.step.driver import Step
from megatron_lossfix.step.megatron_compat import resolve_groups
from megatron_lossfix.step.record import StepRecord

__all__ = ["read_step", "replays"]


def read_step(step: Step, call: dict, via: Any, num_chunks: int) -> tuple[list, StepRecord]:
    """What ``forward_step`` reads from each data iterator (None: no iterator), and the record
    of the step that read it, which names its groups: read ahead where the step reads all its
    micro-batches first, else in a forward-only pass of the step (``via``: what runs it, by
    default ``step`` itself)."""
    reads, record = _read_ahead(step, call, via, num_chunks)
    if reads is None:
        reads = _reading_pass(step if via is None else via, call)
        record = step.last_step
    if record is None:
        raise RuntimeError("the self-check's step left no record: it did not run the step")
    return reads, record


def _read_ahead(step: Step, call: dict, via: Any, num_chunks: int) -> tuple:
    """``([micro-batches], record)`` where ``step`` itself reads all its micro-batches before
    its schedule (a ``Step`` called directly, one model chunk and data iterator, no pipeline
    parallelism: every rank is the loss stage), else ``(None, None)``. The micro-batches (dicts
    copied) are read here; the step then reads them again and agrees on them with its peers,
    without running its schedule, so that a refusal or a disagreement surfaces exactly as
    without the check (a read that raised raises there again)."""
    given = call["data_iterator"]
    sources = given if isinstance(given, list) else [given]
    if via is not None or type(step) is not Step or num_chunks != 1 or len(sources) != 1:
        return None, None
    pg_collection = call.get("pg_collection")
    pg_collection = step.pg_collection if pg_collection is None else pg_collection
    if sources[0] is None or resolve_groups(pg_collection).pp_size > 1:
        return None, None
    items: list = []
    error: BaseException | None = None
    for _ in range(call["num_microbatches"]):
        try:
            item = next(sources[0])
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - the step meets it again and refuses
            error = exc
            break
        items.append(dict(item) if isinstance(item, Mapping) else item)
    dry = copy.copy(step)
    dry.inner = _no_schedule
    it = _replaying_then(items, error)
    dry(**{**call, "data_iterator": [it] if isinstance(given, list) else it, "forward_only": True})
    return [items], dry.last_step


def _no_schedule(**call: Any) -> list:
    """A schedule that takes the step's micro-batches (with their input checks, such as
    ``check_finite``'s) and runs nothing: the self-check's step reads and agrees only."""
    given = call["data_iterator"]
    batches = given[-1] if isinstance(given, list) else given
    for _ in zip(range(call["num_microbatches"]), batches, strict=False):
        pass
    return []


def _replaying_then(items: list, error: BaseException | None) -> Iterator:
    """``items`` (dicts copied), then ``error`` raised, if any."""
    for item in items:
        yield dict(item) if isinstance(item, Mapping) else item
    if error is not None:
        raise error


def _reading_pass(run: Callable[..., Any], call: dict) -> list[list | None]:
    """What ``forward_step`` reads from each data iterator (None: no iterator), in a forward-only
    pass of the step without autograd; the RNG states put back."""
    given = call["data_iterator"]
    as_list = isinstance(given, list)
    sources = given if as_list else [given]
    reads = [None if it is None else [] for it in sources]
    its = [it if it is None else recorded(it, r) for it, r in zip(sources, reads, strict=True)]
    with rng_restored(), torch.no_grad():
        run(**{**call, "data_iterator": its if as_list else its[0], "forward_only": True})
    return reads


def replays(call: dict, reads: list, plan: tuple | None = None, source: bool = True) -> dict:
    """``call`` over ``reads`` (each iterator's micro-batches, dicts copied: forward_step may
    pop), re-split by ``plan``; ``source``: then what the call's iterators still yield."""
    given = call["data_iterator"]
    as_list = isinstance(given, list)
    sources = given if as_list else [given]
    rest = sources if source else [iter(()) for _ in sources]
    its = [None if r is None else replaying(r, s) for r, s in zip(reads, rest, strict=True)]
    kwargs = {**call, "data_iterator": its if as_list else its[0]}
    if plan is not None:
        kwargs["num_microbatches"] = plan[2]
        if plan[3] is not None and "micro_batch_size" in call:
            kwargs["micro_batch_size"] = plan[3]
    return kwargs
