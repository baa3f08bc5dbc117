"""The self-check's re-split of a step's micro-batches (docs/design.md §9, step 2): which
re-split of the rows a layout allows (:func:`resplit_plan`), the micro-batches it makes
(:func:`resplit`), and, where no row can move without growing a micro-batch, the halves of each
micro-batch's loss tokens that two runs weigh instead (:func:`loss_token_half`).

No re-split grows a micro-batch: rows are cut in two or dealt to other micro-batches of the
same size; never merged."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["loss_token_half", "resplit", "resplit_plan"]


def resplit_plan(
    m: int, mbs: int | None, pp: int = 1, group: int | None = None, keep_shapes: bool = False
) -> tuple | None:
    """``(kind, factor, new m, new mbs or None: the call's)``, or None: no row can move without
    growing a micro-batch (one row each, or a pipeline with an odd size and nothing to deal)."""

    def fits(new_m: int) -> bool:  # a count Megatron's interleaved schedule accepts
        return group is None or (new_m >= group and not 0 < new_m % group < pp)

    shuffle = ("shuffle", 1, m, None) if m >= 2 and (mbs is None or mbs >= 2) else None
    if keep_shapes:  # forward_step broadcasts fixed-shape batches
        return shuffle
    # Cut in two (less memory), with pipelines only evenly (one activation shape); else deal.
    if mbs is not None and mbs >= 2 and (mbs % 2 == 0 or pp == 1) and fits(2 * m):
        return ("split", 2, 2 * m, mbs // 2 if mbs % 2 == 0 else None)
    return shuffle


def loss_token_half(which: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """The weights filter (``Step.weights_filter``) of run ``which`` (0 or 1) over halves of the
    loss tokens: each micro-batch keeps the weights of its 1st, 3rd, 5th... loss token (run 0)
    or of its 2nd, 4th... (run 1), in the order of its flattened weights, and zero elsewhere.
    The two runs' weights add up to the step's; nothing is synchronized with the host."""

    def half(k: int, weights: torch.Tensor) -> torch.Tensor:
        nonzero = weights != 0
        rank = nonzero.reshape(-1).cumsum(0).view(weights.shape)  # 1, 2, ... at loss tokens
        keep = nonzero & (rank.remainder(2) == 1 - which)
        return torch.where(keep, weights, torch.zeros((), dtype=weights.dtype))

    return half


def resplit(batches: Sequence[Any], plan: tuple, *, mask_key: str | None = "loss_mask") -> list:
    """``plan`` (``split`` or ``shuffle``) applied to one iterator's dict micro-batches (per-row
    tensors cut or dealt, the rest kept)."""
    rows = []  # the loss mask's first dim, else the first tensor's
    for k, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            kind = type(batch).__name__
            raise ValueError(f"micro-batch {k} is a {kind}; the self-check re-splits only dicts")
        if "cu_seqlens" in batch:
            raise ValueError("packed (THD, cu_seqlens) micro-batches cannot be re-split")
        tensors = [v for v in (batch.get(mask_key), *batch.values()) if _is_rows(v)]
        if not tensors:
            raise ValueError("a micro-batch holds no tensor to split")
        rows.append(len(tensors[0]))
    kind, m = plan[0], len(batches)
    # Per new micro-batch: (old micro-batch, its rows) pairs; shuffle: row i of new j is row i
    # of old (i + j) mod m. Packed micro-batches hold one row: they are run as halves instead.
    if kind == "split":
        if min(rows) < 2:
            raise ValueError(f"a micro-batch of {min(rows)} row cannot be cut in two")
        pieces = [[(k, s)] for k, r in enumerate(rows) for s in (slice(r // 2), slice(r // 2, r))]
    else:
        if len(set(rows)) != 1 or rows[0] < 2 or m < 2:
            sizes = sorted(set(rows))
            raise ValueError(f"shuffling needs >= 2 micro-batches of one size >= 2, not {sizes}")
        pieces = [[((i + j) % m, slice(i, i + 1)) for i in range(rows[0])] for j in range(m)]
    out = []
    for piece in pieces:
        group = [batches[k] for k, _ in piece]
        if any(set(b) != set(group[0]) for b in group):
            raise ValueError(f"micro-batches to {kind} hold different keys")
        new = {}
        for key, first in group[0].items():
            values = [b[key] for b in group]
            if all(_is_rows(v, rows[k]) for v, (k, _) in zip(values, piece, strict=True)):
                new[key] = torch.cat([v[s] for v, (_, s) in zip(values, piece, strict=True)])
            elif all(_same(first, v) for v in values[1:]):
                new[key] = first
            else:
                raise ValueError(f"cannot {kind} micro-batches: {key!r} differs and is not per-row")
        out.append(new)
    return out


def _is_rows(value: Any, rows: int | None = None) -> bool:
    """Whether ``value`` is a tensor with a first dim (of ``rows`` rows, when given)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and rows in (None, len(value))


def _same(a: Any, b: Any) -> bool:
    try:
        tensors = isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)
        return a is b or bool(torch.equal(a, b) if tensors else a == b)
    except Exception:  # noqa: BLE001 - incomparable values are simply not the same
        return False
