"""Re-split plans for the self-check: how to cut one step's micro-batches differently.

Pure bookkeeping over the micro-batch dicts (no Megatron, no communication): the plan depends on
the micro-batch count, the micro-batch size and the layout only, so every pipeline stage agrees
on it; :func:`resplit` cuts, merges or shuffles the recorded micro-batches by it. Used by
:mod:`megatron_lossfix.selfcheck`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ResplitPlan", "resplit", "resplit_plan"]


@dataclass(frozen=True)
class ResplitPlan:
    """How to cut the step again."""

    kind: str
    """``split``: each micro-batch cut in ``factor`` parts; ``merge``: groups of ``factor``
    micro-batches concatenated; ``shuffle``: same count and shapes, rows dealt to other
    micro-batches (row i of new micro-batch j is row i of old micro-batch (i + j) mod M)."""
    factor: int
    num_microbatches: int
    """The re-run's micro-batch count."""
    micro_batch_size: int | None
    """The re-run's ``micro_batch_size`` argument (None: leave the call's)."""


def _smallest_factor(n: int) -> int:
    return next(k for k in range(2, n + 1) if n % k == 0)


def resplit_plan(
    num_microbatches: int,
    micro_batch_size: int | None,
    *,
    pipeline_size: int = 1,
    interleaved_group: int | None = None,
    keep_shapes: bool = False,
) -> ResplitPlan | None:
    """The re-split of a step of ``num_microbatches`` micro-batches of ``micro_batch_size`` rows.

    Prefers cutting each micro-batch in two (same activation memory, changes the count and every
    micro-batch's content); else merges groups of the smallest factor of ``num_microbatches``;
    else shuffles rows between micro-batches. With pipeline parallelism micro-batches keep one
    shape, so they are only cut evenly. ``interleaved_group``: Megatron's
    ``microbatch_group_size_per_vp_stage`` for interleaved schedules, which the count must fit.
    ``keep_shapes``: only the shuffle, for ``forward_step`` functions that broadcast the batch
    into buffers of a fixed shape. None when nothing can change (one micro-batch of one row).
    """
    m, mbs = num_microbatches, micro_batch_size

    def fits(new_m: int) -> bool:
        if interleaved_group is None:
            return True
        rest = new_m % interleaved_group
        return new_m >= interleaved_group and (rest == 0 or rest >= pipeline_size)

    shuffle = ResplitPlan("shuffle", 1, m, None) if m >= 2 and (mbs is None or mbs >= 2) else None
    if keep_shapes:
        return shuffle
    if mbs is not None and mbs >= 2 and (mbs % 2 == 0 or pipeline_size == 1) and fits(2 * m):
        return ResplitPlan("split", 2, 2 * m, mbs // 2 if mbs % 2 == 0 else None)
    if m >= 2 and fits(m // _smallest_factor(m)):
        g = _smallest_factor(m)
        return ResplitPlan("merge", g, m // g, None if mbs is None else mbs * g)
    return shuffle


def _rows(batch: Mapping, mask_key: str | None) -> int:
    """Micro-batch rows: the loss mask's first dim, else the first tensor's."""
    if mask_key is not None and isinstance(batch.get(mask_key), torch.Tensor):
        return int(batch[mask_key].shape[0])
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError("a micro-batch holds no tensor to split")


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are simply not the same
        return False


def resplit(
    batches: Sequence[Any], plan: ResplitPlan, *, mask_key: str | None = "loss_mask"
) -> list[dict]:
    """Apply ``plan`` to one iterator's micro-batches (dicts of tensors).

    Tensors whose first dim is the micro-batch's row count are cut or concatenated along it;
    everything else (broadcast position ids, scalars, ...) is kept, and must be equal within a
    merged group. Raises ``ValueError`` when the data does not allow it.
    """
    for k, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"micro-batch {k} is a {type(batch).__name__}; the self-check re-splits only "
                "dict micro-batches"
            )
        if "cu_seqlens" in batch:
            raise ValueError("packed (THD, cu_seqlens) micro-batches cannot be re-split")
    if plan.kind == "shuffle":
        return _shuffle(batches, mask_key)
    if plan.kind == "split":
        out = []
        for batch in batches:
            rows = _rows(batch, mask_key)
            if rows < 2:
                raise ValueError(f"a micro-batch of {rows} row cannot be cut in two")
            cut = [rows // 2, rows - rows // 2]
            halves: list[dict] = [{}, {}]
            for key, value in batch.items():
                parts = torch.split(value, cut) if _per_row(value, rows) else (value, value)
                halves[0][key], halves[1][key] = parts
            out += halves
        return out
    out = []
    for start in range(0, len(batches), plan.factor):
        group = list(batches[start : start + plan.factor])
        rows = [_rows(b, mask_key) for b in group]
        if any(set(b) != set(group[0]) for b in group):
            raise ValueError("micro-batches to merge hold different keys")
        merged = {}
        for key, first in group[0].items():
            values = [b[key] for b in group]
            if all(_per_row(v, r) for v, r in zip(values, rows, strict=True)):
                if any(v.shape[1:] != first.shape[1:] for v in values):
                    raise ValueError(
                        f"micro-batches to merge have different shapes under {key!r}: "
                        f"{[tuple(v.shape) for v in values]}"
                    )
                merged[key] = torch.cat(values, dim=0)
            elif all(_same(first, v) for v in values[1:]):
                merged[key] = first
            else:
                raise ValueError(f"cannot merge micro-batches: {key!r} differs and is not per-row")
        out.append(merged)
    return out


def _per_row(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def _shuffle(batches: Sequence[Mapping], mask_key: str | None) -> list[dict]:
    rows = {_rows(b, mask_key) for b in batches}
    if len(rows) != 1 or min(rows) < 2 or len(batches) < 2:
        raise ValueError(
            f"shuffling rows needs >= 2 micro-batches of one size >= 2, got sizes {sorted(rows)}"
        )
    (r,) = rows
    m = len(batches)
    first = batches[0]
    out = []
    for j in range(m):
        new = {}
        for key, value in first.items():
            if _per_row(value, r):
                new[key] = torch.stack([batches[(i + j) % m][key][i] for i in range(r)])
            elif all(_same(value, b[key]) for b in batches[1:]):
                new[key] = value
            else:
                raise ValueError(f"cannot shuffle micro-batches: {key!r} differs, not per-row")
        out.append(new)
    return out
