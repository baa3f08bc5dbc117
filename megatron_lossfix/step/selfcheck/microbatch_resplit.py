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

from megatron_lossfix.runtime.weights import segment_ids

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


def loss_token_half(
    which: int,
    *,
    mask_key: str | None = "loss_mask",
    cu_seqlens_key: str | None = "cu_seqlens",
    id_keys: Sequence[str] = (),
    only: range | None = None,
    unit_key: str | None = None,
) -> Callable[[list, list[torch.Tensor]], tuple[list, list[torch.Tensor]]]:
    """The micro-batches and weights of run ``which`` (0 or 1) over halves of the loss tokens
    (``Step.halves``). The two runs' weights add up to the step's; each micro-batch's loss mask
    (``mask_key``) changes with them, so that a loss dividing by a count of its own mask sees
    another count in each run, while a statistic the loss takes over a whole sequence (a mean
    over its mask, as GSPO's ratio) stays what it is in the normal run:

    * a micro-batch whose loss tokens lie in two or more sequences (rows; in a packed row, its
      ``cu_seqlens_key`` sequences) keeps every other such sequence whole, its mask zeroed on
      the others. A packed row's boundaries are rewritten so that each sequence it drops joins
      the one before it (where causal attention cannot reach the kept tokens): a loss that
      divides by its number of sequences sees another count too. Per-sequence ids
      (``id_keys``) and a ``max_seqlen`` follow;
    * a micro-batch of one sequence keeps every other loss token in its weights, and its mask
      counts twice (each 1 becomes 2; a bool mask stays as it is): a mean over the mask is
      unchanged, a division of the weighted sum by the mask's count is halved.

    A micro-batch without a mask of the weights' shape has its weights halved only. ``only``:
    the micro-batches to halve (by index), the others left whole; None: every one.
    ``unit_key``: each sequence's unit (a pair, ``pair_mean``), whose loss is not a sum over
    its tokens: whole units are kept, every other one; a micro-batch of one unit has its
    weights halved only (its mask and sequences untouched, for a loss nonlinear in them)."""

    def halves(batches: list, weights: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        out = [
            _half(b, w, which, mask_key, cu_seqlens_key, id_keys, unit_key)
            if only is None or k in only
            else (b, w)
            for k, (b, w) in enumerate(zip(batches, weights, strict=True))
        ]
        return [b for b, _ in out], [w for _, w in out]

    return halves


def _half(
    batch: Any,
    weights: torch.Tensor,
    which: int,
    mask_key: str | None,
    cu_key: str | None,
    id_keys: Sequence[str],
    unit_key: str | None = None,
) -> tuple[Any, torch.Tensor]:
    """One micro-batch's half (:func:`loss_token_half`)."""
    fields = batch if isinstance(batch, Mapping) else {}
    mask = fields.get(mask_key) if mask_key else None
    if not (isinstance(mask, torch.Tensor) and mask.shape == weights.shape):
        mask = None
    tokens = weights != 0 if mask is None else (weights != 0) | (mask != 0)
    packed = _packed_sequences(fields.get(cu_key) if cu_key else None, tokens)
    sequences = packed or _row_sequences(tokens)
    changed: dict[str, Any] = {}
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    units = _units(fields.get(unit_key) if unit_key else None, sequences)
    if unit_key is not None and units is None:  # one unit: its weights alone are halved
        rank = tokens.reshape(-1).cumsum(0).view(tokens.shape)
        keep = tokens & (rank.remainder(2) == 1 - which)
        return batch, torch.where(keep, weights, zero)
    if sequences is not None:  # every other sequence (unit) holding loss tokens, whole
        index, holding = sequences[0], sequences[1]
        mine = holding[which::2] if units is None else [s for s in holding if units[s] == which]
        keep = tokens & torch.isin(index, torch.tensor(mine, device=tokens.device))
        if packed is not None:
            changed = _joined_boundaries(fields, cu_key, id_keys, packed[2], mine)
        if mask is not None:
            changed[mask_key] = torch.where(keep, mask, torch.zeros((), dtype=mask.dtype))
    else:  # every other loss token, in the order of the flattened weights; the mask doubled
        rank = tokens.reshape(-1).cumsum(0).view(tokens.shape)  # 1, 2, ... at loss tokens
        keep = tokens & (rank.remainder(2) == 1 - which)
        if mask is not None and mask.dtype != torch.bool:
            changed[mask_key] = mask * 2
    half = torch.where(keep, weights, zero)
    return ({**batch, **changed} if changed else batch), half


def _units(ids: Any, sequences: tuple | None) -> dict[int, int] | None:
    """Each sequence holding loss tokens -> the parity of its unit's place among the units
    holding loss tokens, where two or more units hold some; else None (the check's own host
    reads of the ids)."""
    if sequences is None or not isinstance(ids, torch.Tensor):
        return None
    of = ids.reshape(-1).tolist()
    holding = [s for s in sequences[1] if s < len(of)]
    places = {u: i for i, u in enumerate(sorted({of[s] for s in holding}))}
    return {s: places[of[s]] % 2 for s in holding} if len(places) >= 2 else None


def _row_sequences(tokens: torch.Tensor) -> tuple | None:
    """``(row index per token, the rows holding loss tokens)`` of a ``[rows, seq]`` micro-batch
    with loss tokens in two or more rows; else None."""
    if tokens.dim() < 2 or tokens.shape[0] < 2:
        return None
    holding = [r for r, any_token in enumerate(tokens.reshape(len(tokens), -1).any(1)) if any_token]
    index = torch.arange(len(tokens), device=tokens.device).view(-1, *[1] * (tokens.dim() - 1))
    return (index.expand(tokens.shape), holding) if len(holding) >= 2 else None


def _packed_sequences(cu_seqlens: Any, tokens: torch.Tensor) -> tuple | None:
    """``(sequence index per token, the sequences holding loss tokens, boundaries)`` of a packed
    ``[1, T]`` row whose ``cu_seqlens`` are plain cumulative lengths from 0, with two or more
    sequences holding loss tokens; else None."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or tokens.dim() != 2:
        return None
    bounds = [int(c) for c in cu_seqlens.tolist()]  # the first step's check only: host values
    total = tokens.shape[-1]
    if tokens.shape[0] != 1 or len(bounds) < 3 or bounds[0] != 0 or bounds[-1] > total:
        return None
    if any(b > a for a, b in zip(bounds[1:], bounds, strict=False)):
        return None  # not non-decreasing: some other convention (padded with -1, ...)
    index = segment_ids(cu_seqlens, total)[0].to(tokens.device)
    per_sequence = torch.zeros(len(bounds), dtype=torch.long, device=tokens.device)
    per_sequence.index_add_(0, index[tokens], torch.ones_like(index[tokens]))
    holding = [i for i, n in enumerate(per_sequence.tolist()[:-1]) if n > 0]
    return (index, holding, bounds) if len(holding) >= 2 else None


def _joined_boundaries(
    batch: Mapping, cu_key: str, id_keys: Sequence[str], bounds: list[int], kept: list[int]
) -> dict[str, Any]:
    """A packed row's entries rewritten for the sequences ``kept``: each other sequence joins
    the one before it (sequence 0 stays on its own: nothing is before it)."""
    starts = sorted({0, *kept})
    new = [bounds[i] for i in starts] + [bounds[-1]]
    cu = batch[cu_key]
    changed: dict[str, Any] = {}
    for key, value in batch.items():  # the boundaries, under any key that holds them
        if isinstance(value, torch.Tensor) and value.shape == cu.shape and torch.equal(value, cu):
            changed[key] = torch.tensor(new, dtype=cu.dtype, device=cu.device)
    for key in id_keys:  # one id per sequence: the kept ones' (a joined one takes its host's)
        ids = batch.get(key)
        if isinstance(ids, torch.Tensor) and ids.numel() == len(bounds) - 1:
            changed[key] = ids.reshape(-1)[torch.tensor(starts, device=ids.device)]
    if "max_seqlen" in batch:
        longest = max(b - a for a, b in zip(new, new[1:], strict=False))
        old = batch["max_seqlen"]
        is_tensor = isinstance(old, torch.Tensor)
        changed["max_seqlen"] = old.new_full(old.shape, longest) if is_tensor else longest
    return changed


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
