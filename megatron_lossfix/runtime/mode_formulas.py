"""The per-token weight formulas of the modes (docs/design.md §2): the weight functions and the
factors when the loss decides its masks that the records of
:mod:`megatron_lossfix.runtime.modes` point at.

Pure torch, no Megatron. Notation: N loss tokens of the step, S sequences with a loss token,
n_s the tokens of sequence s, n_k of micro-batch k, M micro-batches per rank, D the
data-parallel size, G groups with a loss token, n_g the tokens of group g, P pairs with a loss
token, n_p the tokens of pair p, C the constant.
"""

from __future__ import annotations

import torch

from megatron_lossfix.runtime.mode_record import CountsView, KeptPart, Masks, Segments, Weights

__all__ = [
    "constant_weights",
    "group_constant_weights",
    "group_mean_weights",
    "kept_constant",
    "kept_legacy",
    "kept_one",
    "kept_sequence",
    "legacy_weights",
    "pair_mean_weights",
    "pair_tokens",
    "sequence_weights",
    "sum_weights",
    "token_mean_weights",
]

_COUNT_DTYPE = torch.float64


# ---------------------------------------------------------------------- weight functions
def _stacked(masks: Masks, segs: Segments) -> torch.Tensor | None:
    """The masks as one ``[rows, seq]`` tensor where they share a width, a dtype and a device
    and none is packed, so that a mode's weights take a few kernels whatever the number of
    micro-batches; None otherwise (one by one)."""
    first = masks[0] if masks else None
    if first is None or first.dim() != 2 or (segs is not None and any(s is not None for s in segs)):
        return None
    for m in masks:
        if m.dim() != 2 or m.shape[1] != first.shape[1] or m.dtype != first.dtype:
            return None
        if m.device != first.device:
            return None
    return torch.cat(list(masks))


def _split(stacked: torch.Tensor, masks: Masks) -> Weights:
    """Weights computed on :func:`_stacked` masks, back into one tensor per micro-batch."""
    return list(torch.split(stacked, [m.shape[0] for m in masks]))


def _times(masks: Masks, segs: Segments, factor: torch.Tensor) -> Weights:
    """Each mask times one 0-dim ``factor``."""
    stacked = _stacked(masks, segs)
    if stacked is not None:
        return _split(stacked * factor, masks)
    return [m * factor for m in masks]


def sum_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    """``m``: the mask itself, a copy."""
    stacked = _stacked(masks, segs)
    if stacked is not None:  # a copy: the weights never alias the caller's masks
        return _split(stacked, masks)
    return [m.clone() for m in masks]


def token_mean_weights(
    masks: Masks, counts: CountsView, c: float | None, segs: Segments
) -> Weights:
    """``m / N``: every loss token equal."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    inv = (one / counts.num_tokens.clamp(min=1)).float()
    return _times(masks, segs, inv)


def constant_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    """``m / (S * C)``: every sequence's token sum over C, averaged over sequences."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    inv = (one / (counts.num_sequences.clamp(min=1) * float(c))).float()
    return _times(masks, segs, inv)


def legacy_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    """``m / (n_k * M * D)``: the mean of per-micro-batch token means."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    scale = float(len(counts.seq_tokens) * counts.dp_size)
    inv = (one / (counts.mb_tokens.clamp(min=1) * scale)).float()
    rows = {m.shape[0] for m in masks}
    stacked = _stacked(masks, segs) if len(rows) == 1 else None
    if stacked is not None:  # every micro-batch has the same rows: the factor of each row
        return _split(stacked * inv.repeat_interleave(rows.pop())[:, None], masks)
    return [m * inv[k] for k, m in enumerate(masks)]


def sequence_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    """``m / (S * n_s)``: every sequence equal, a token mean inside it."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    stacked = _stacked(masks, segs)
    if stacked is not None and len(counts.seq_tokens) == len(masks):
        seq_tokens = torch.cat(list(counts.seq_tokens))
        inv_seq = one / (seq_tokens.clamp(min=1) * counts.num_sequences.clamp(min=1))
        return _split(stacked * inv_seq.float()[:, None], masks)
    out = []
    for k, m in enumerate(masks):
        inv_seq = one / (counts.seq_tokens[k].clamp(min=1) * counts.num_sequences.clamp(min=1))
        seg = None if segs is None else segs[k]
        out.append(m * (inv_seq.float()[:, None] if seg is None else inv_seq.float()[seg]))
    return out


def _num_groups(counts: CountsView) -> tuple[torch.Tensor, torch.Tensor]:
    """n_g of each group (on the counts' device) and G, the groups with a loss token (>= 1)."""
    n_group = counts.group_tokens.to(counts.num_tokens.device)
    return n_group, (n_group > 0).sum(dtype=_COUNT_DTYPE).clamp(min=1)


def group_mean_weights(
    masks: Masks, counts: CountsView, c: float | None, segs: Segments
) -> Weights:
    """``m / (G * n_g)``: every group equal, a token mean inside it."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    n_group, num_groups = _num_groups(counts)
    inv_group = one / (n_group.clamp(min=1) * num_groups)
    out = []
    for k, m in enumerate(masks):
        ids = counts.group_ids[k].to(device=inv_group.device, dtype=torch.long)
        inv_seq = inv_group[ids].float().to(m.device)
        seg = None if segs is None else segs[k]
        out.append(m * (inv_seq[:, None] if seg is None else inv_seq[seg]))
    return out


def group_constant_weights(
    masks: Masks, counts: CountsView, c: float | None, segs: Segments
) -> Weights:
    """``m / (G * C)``: every group's token sum over C, averaged over groups."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    _, num_groups = _num_groups(counts)
    inv = (one / (num_groups * float(c))).float()
    return _times(masks, segs, inv)


def pair_tokens(seq_tokens: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
    """n_p of each pair id of one micro-batch (``[len(pair_ids)]``, ids being local to it and
    below its number of sequences), from its sequences' counts (all CP shards)."""
    out = torch.zeros(pair_ids.numel(), dtype=seq_tokens.dtype, device=seq_tokens.device)
    return out.index_add_(0, pair_ids.to(device=seq_tokens.device, dtype=torch.long), seq_tokens)


def pair_mean_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    """``m / (P * n_p)``: every pair equal, a token mean inside it. A pair is the sequences of
    one micro-batch that share a pair id; its tokens' weights add up to ``1 / P``."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    pairs = counts.num_pairs.to(counts.num_tokens.device).clamp(min=1)
    out = []
    for k, m in enumerate(masks):
        ids = counts.group_ids[k].to(device=counts.seq_tokens[k].device, dtype=torch.long)
        n_pair = pair_tokens(counts.seq_tokens[k], ids).to(one.device)
        inv_seq = (one / (n_pair.clamp(min=1) * pairs))[ids.to(one.device)].float().to(m.device)
        seg = None if segs is None else segs[k]
        out.append(m * (inv_seq[:, None] if seg is None else inv_seq[seg]))
    return out


# ---------------------------------------------------------------------- kept factors
def kept_one(part: KeptPart) -> float:
    """1: the kept mask alone (a global count, where the mode has one, divides after the
    schedule)."""
    return 1.0


def kept_constant(part: KeptPart) -> float:
    """``1 / C``."""
    return 1.0 / float(part.norm_constant)


def kept_legacy(part: KeptPart) -> torch.Tensor:
    """``1 / (n_k * M * D)``, n_k the micro-batch's kept tokens."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=part.seq_kept.device)
    scale = float(part.num_microbatches * part.dp_size)
    return (one / (part.seq_kept.sum().clamp(min=1) * scale)).float()


def kept_sequence(part: KeptPart) -> torch.Tensor:
    """``1 / n_s`` of each token's sequence, n_s its kept tokens."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=part.seq_kept.device)
    inv = (one / part.seq_kept.clamp(min=1)).float()
    return inv[:, None] if part.segments is None else inv[part.segments]
