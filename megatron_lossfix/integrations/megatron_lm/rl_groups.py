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
returns, each row's group (:class:`RowGroups`); the iterator and its items are unchanged. Under
``--loss-reduction`` from core_v0.19 the patched function lays the rows out step by step
(:mod:`~megatron_lossfix.integrations.megatron_lm.rl_steps`); the record then follows that
layout (:func:`planned_groups`), and with packing the wrapper sets the step's micro-batch count
to the bins of one step.
:func:`micro_batch_groups` reads a micro-batch's group ids from that record.

Up to core_v0.18 the step does not read every row once: it splits the rollouts over the DP
ranks, expands them into rows there, and sizes the step by the number of *rollouts* (one
micro-batch per rollout, over the DP ranks). With multi-turn rollouts (or a number of rollouts
that the DP ranks do not divide), each rank's loader then drops its last rows, or reads its
first ones again, and which rows depends on the layout. Under ``--loss-reduction`` the wrapper
refuses such a collection before its step, on every rank (:func:`unread_rows`), and so a
collection of several optimizer steps under DP (:func:`several_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

from megatron_lossfix.integrations.megatron_lm import rl_steps as megatron_lm_rl_steps

__all__ = [
    "RowGroups",
    "install",
    "micro_batch_groups",
    "planned_groups",
    "row_groups",
    "same_rows",
    "several_steps",
    "step_groups",
    "unread_rows",
]


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


def same_rows(reader: Any, iterator: Any) -> Any:
    """Let ``reader`` (a wrapper of ``iterator`` that yields its items) carry ``iterator``'s
    record; returns ``reader``."""
    record = step_groups(iterator)
    if record is not None:
        _RECORDS[reader] = record
    return reader


def unread_rows(
    grouped: Sequence[Sequence[Any]], *, data_parallel_size: int, sequence_packing: bool
) -> str | None:
    """Why a step of a Megatron-LM that does not pad rows (before core_v0.19) would not read
    each of these rollouts' rows exactly once, in one line; None when it would.

    There the rollouts are split over the DP ranks in contiguous slices of
    ``len(rollouts) // DP`` (the rest is dropped), then expanded into rows (one per turn).
    Unpacked, the step reads ``len(rollouts) // DP`` rows on each rank (its number of
    micro-batches counts rollouts, not rows), cycling over its own. Packed, the ranks' rows are
    gathered for the bins as equal-sized blocks: the ranks must hold as many rows each."""
    rollouts = [r for group in grouped for r in group]
    size = max(data_parallel_size, 1)
    fix = "use core_v0.19.0 or later, which pads the rows"
    if len(rollouts) % size:
        return (
            f"the {len(rollouts)} rollouts of this step do not divide among {size} DP ranks: "
            f"Megatron-LM before core_v0.19.0 drops the last {len(rollouts) % size}; {fix}"
        )
    split = len(rollouts) // size
    held = [sum(len(r.trajectory) for r in rollouts[k * split : (k + 1) * split])
            for k in range(size)]  # fmt: skip
    if sequence_packing:
        if len(set(held)) == 1:
            return None
        return (
            f"Megatron-LM before core_v0.19.0 packs equal numbers of rows from each DP rank, "
            f"but its {size} DP ranks hold {', '.join(map(str, held))} of this step's "
            f"{sum(held)} rows ({len(rollouts)} rollouts, not all of one turn); {fix}"
        )
    if all(rows == split for rows in held):
        return None
    if size == 1:
        held_read = f"its one rank holds {held[0]} rows and reads {split}"
    else:
        held_read = f"its {size} DP ranks hold {', '.join(map(str, held))} and read {split} each"
    return (
        f"Megatron-LM before core_v0.19.0 trains a layout-dependent subset of this step's "
        f"{sum(held)} rows ({len(rollouts)} rollouts, not all of one turn): {held_read} (the "
        f"step counts rollouts, not rows); {fix}"
    )


def several_steps(args: Any, data_parallel_size: int) -> str | None:
    """Why a Megatron-LM before core_v0.19.0 trains layout-dependent rows in the steps of one
    collection, in one line; None when it has one step per collection or one DP rank.

    There each rank holds a contiguous slice of the rollouts and step i reads the i-th part of
    every rank's slice (and, packed, of every rank's bins): under DP the steps mix rollouts
    that one rank trains in other steps."""
    steps = megatron_lm_rl_steps.steps_per_collection(args)
    if steps == 1 or data_parallel_size == 1:
        return None
    return (
        f"Megatron-LM before core_v0.19.0 splits a collection's rollouts over the DP ranks "
        f"before its {steps} optimizer steps (--grpo-prompts-per-step x --grpo-group-size = "
        f"{int(args.grpo_prompts_per_step) * int(args.grpo_group_size)}, --global-batch-size "
        f"{args.global_batch_size}), so each step trains other rows on {data_parallel_size} DP "
        f"ranks than on one; use core_v0.19.0 or later, or a --global-batch-size of "
        f"--grpo-prompts-per-step x --grpo-group-size"
    )


def planned_groups(
    grouped: Sequence[Sequence[Any]],
    plan: megatron_lm_rl_steps.StepRows,
    data_parallel_rank: int,
    micro_batch_size: int,
) -> RowGroups:
    """Each row's group in the layout of :mod:`~megatron_lossfix.integrations.megatron_lm.rl_steps`
    (``--loss-reduction`` from core_v0.19.0 on)."""
    of_rollout = [g for g, group in enumerate(grouped) for _ in group]
    rows = [0 if o < 0 else of_rollout[plan.row_rollouts[o]] for o in plan.order]
    per_rank = len(rows) // plan.data_parallel_size
    return RowGroups(
        global_rows=rows,
        local_rows=rows[data_parallel_rank * per_rank : (data_parallel_rank + 1) * per_rank],
        count=max(len(grouped), 1),
        micro_batch_size=micro_batch_size,
    )


def install(rl_utils: Any) -> None:
    """Wrap ``rl_utils.prepare_data_for_update`` (once) to record each row's group."""
    original = rl_utils.prepare_data_for_update
    if getattr(original, "_lossfix_row_groups", False):
        return
    signature = inspect.signature(original)

    pads_rows = hasattr(rl_utils, "PAD_ROW") or hasattr(rl_utils, "PAD_TURN_UNIT")

    @functools.wraps(original)
    def prepare_data_for_update(*args: Any, **kwargs: Any) -> Any:
        from megatron.core import mpu
        from megatron.training import get_args

        bound = signature.bind(*args, **kwargs).arguments
        grouped = bound["rollouts"]
        margs = get_args()
        packing = bool(bound.get("sequence_packing", False))
        if not pads_rows and getattr(margs, "loss_reduction", None) is not None:
            # Every rank checks the same rollouts (the same list on every rank): each refuses.
            reason = unread_rows(
                grouped, data_parallel_size=mpu.get_data_parallel_world_size(),
                sequence_packing=packing,
            ) or several_steps(margs, mpu.get_data_parallel_world_size())  # fmt: skip
            if reason is not None:
                raise ValueError(f"megatron_lossfix: --loss-reduction: {reason}")
        megatron_lm_rl_steps.reset()  # order_rows sets it (patched, core_v0.19 on)
        result = original(*args, **kwargs)
        iterator = result[0] if isinstance(result, tuple) else result
        plan = megatron_lm_rl_steps.current()
        if plan is None:
            record = row_groups(
                grouped,
                data_parallel_size=mpu.get_data_parallel_world_size(),
                data_parallel_rank=mpu.get_data_parallel_rank(),
                micro_batch_size=margs.micro_batch_size,
                pads_rows=pads_rows,
                collapsible=getattr(rl_utils, "_is_collapsible_rollout", None),
            )
        else:
            record = planned_groups(grouped, plan, mpu.get_data_parallel_rank(),
                                    margs.micro_batch_size)  # fmt: skip
            if packing:
                megatron_lm_rl_steps.reconfigure_bins(plan, margs.micro_batch_size)
        _RECORDS[iterator] = record
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
