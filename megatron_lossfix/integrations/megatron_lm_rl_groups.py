"""The GRPO group of each training row of Megatron-LM's ``train_rl.py`` (``group_mean``).

``prepare_data_for_update`` receives the step's rollouts in groups (``GroupedRollouts``, the same
list on every rank), drops the grouping and turns the rollouts into training rows, in rollout
order: one row per turn, or (main) one row for a rollout whose turns form a prefix chain;
zero-turn rollouts give none. From core_v0.19 the rows are padded to a multiple of DP x
micro-batch size and split over the DP ranks in contiguous slices; before, the rollouts are
split (contiguous slices) and then expanded into rows. Each rank's loader reads its rows in
order, ``micro-batch size`` at a time, cycling; packed bins list global row indices (the ranks'
rows concatenated in rank order, ``packing_info.bin_seq_indices``).

:func:`install` wraps ``prepare_data_for_update`` so that it records, for the iterator it
returns, each row's group (:class:`RowGroups`); the iterator and its items are unchanged.
:func:`micro_batch_groups` reads a micro-batch's group ids from that record.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["RowGroups", "install", "micro_batch_groups", "row_groups", "step_groups"]


@dataclasses.dataclass(slots=True, eq=False)
class RowGroups:
    """The groups of one collection's rows (one ``prepare_data_for_update`` call)."""

    global_rows: list[int]
    """The group of every row over the DP ranks (padding rows: 0; they have no loss token)."""
    local_rows: list[int]
    """This rank's rows, in the order its loader reads them."""
    count: int
    """The number of groups: every id is in ``[0, count)``."""
    micro_batch_size: int
    read: int = 0
    """Unpacked micro-batches read so far (the loader cycles over ``local_rows``)."""


def row_groups(
    grouped: Sequence[Sequence[Any]],
    *,
    data_parallel_size: int,
    data_parallel_rank: int,
    micro_batch_size: int,
    pads_rows: bool,
    collapsible: Any = None,
) -> RowGroups:
    """Each row's group, as ``prepare_data_for_update`` forms and splits the rows.

    ``pads_rows``: the rows are padded and split over DP (core_v0.19 on), else the rollouts are
    split and then expanded. ``collapsible(rollout)``: whether a rollout is one row (main)."""
    rollouts = [(g, r) for g, group in enumerate(grouped) for r in group]

    def rows(part: Sequence[tuple[int, Any]]) -> list[int]:
        out = []
        for g, rollout in part:
            turns = len(rollout.trajectory)
            if turns and collapsible is not None and collapsible(rollout):
                turns = 1
            out.extend([g] * turns)
        return out

    size = max(data_parallel_size, 1)
    if pads_rows:
        every = rows(rollouts)
        every += [0] * (-len(every) % (size * micro_batch_size))
        split = len(every) // size
        per_rank = [every[k * split : (k + 1) * split] for k in range(size)]
    else:
        split = len(rollouts) // size
        per_rank = [rows(rollouts[k * split : (k + 1) * split]) for k in range(size)]
    return RowGroups(
        global_rows=[g for part in per_rank for g in part],
        local_rows=per_rank[data_parallel_rank],
        count=max(len(grouped), 1),
        micro_batch_size=micro_batch_size,
    )


_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_groups(iterator: Any) -> RowGroups | None:
    """The record of the rows ``iterator`` (from ``prepare_data_for_update``) reads, or None."""
    try:
        return _RECORDS.get(iterator)
    except TypeError:  # not weak-referenceable: not an RL data iterator
        return None


def install(rl_utils: Any) -> None:
    """Wrap ``rl_utils.prepare_data_for_update`` (once) to record each row's group."""
    original = rl_utils.prepare_data_for_update
    if getattr(original, "_lossfix_row_groups", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def prepare_data_for_update(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        from megatron.core import mpu
        from megatron.training import get_args

        grouped = signature.bind(*args, **kwargs).arguments["rollouts"]
        iterator = result[0] if isinstance(result, tuple) else result
        _RECORDS[iterator] = row_groups(
            grouped,
            data_parallel_size=mpu.get_data_parallel_world_size(),
            data_parallel_rank=mpu.get_data_parallel_rank(),
            micro_batch_size=get_args().micro_batch_size,
            pads_rows=hasattr(rl_utils, "PAD_ROW") or hasattr(rl_utils, "PAD_TURN_UNIT"),
            collapsible=getattr(rl_utils, "_is_collapsible_rollout", None),
        )
        return result

    prepare_data_for_update._lossfix_row_groups = True  # type: ignore[attr-defined]
    rl_utils.prepare_data_for_update = prepare_data_for_update


def micro_batch_groups(
    record: RowGroups, rows: int, bin_rows: Sequence[int] | None = None
) -> list[int]:
    """The group ids of the next micro-batch: ``rows`` unpacked rows (advances the loader's
    position), or, for a packed bin, one id per row of its global rows ``bin_rows`` (an empty
    bin: one id for its one, empty, sequence)."""
    if bin_rows is not None:
        return [record.global_rows[i] for i in bin_rows] or [0]
    size = record.micro_batch_size
    batches = max(-(-len(record.local_rows) // size), 1)
    start = (record.read % batches) * size
    record.read += 1
    ids = record.local_rows[start : start + size]
    return ids[:rows] + [0] * (rows - len(ids))
