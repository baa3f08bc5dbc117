"""The reduction modes as data: one record per mode and per alias (docs/modes.md).

Each :class:`Mode` says everything the package needs to know about a mode: the global counts
its weights read, the ids it weights by, whether it takes the constant C, whether its gradient
depends on the micro-batch split, its factors when the loss decides its masks, and its weight
functions. Every other module asks the record (:func:`mode_of`); none names a mode itself.
The table is checked when this module is imported: an incomplete or contradictory record
raises there, never in a branch that guesses. Adding a mode is one record here and its row in
docs/modes.md (a unit test compares the two).

Pure torch, no Megatron; the formulas are those of docs/design.md §2. Notation: N loss tokens
of the step, S sequences with a loss token, n_s the tokens of sequence s, n_k of micro-batch k,
M micro-batches per rank, D the data-parallel size, G groups with a loss token, n_g the tokens
of group g, C the constant.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "ALIASES",
    "ALIAS_RECORDS",
    "DEFAULT_MODE",
    "MODES",
    "MODE_RECORDS",
    "REDUCTIONS",
    "STOCK",
    "Alias",
    "Count",
    "Ids",
    "KeptFactors",
    "KeptPart",
    "Mode",
    "canonical_mode",
    "check_table",
    "describe_modes",
    "megatron_normalizes",
    "mode_of",
    "modes_reading",
    "quoted_with_aliases",
]

_COUNT_DTYPE = torch.float64


class Count(enum.Enum):
    """A count summed over the whole step (every micro-batch, every DP and CP rank)."""

    N = "loss tokens"
    S = "sequences with a loss token"
    GROUPS = "loss tokens of each group (prompt or trajectory), and G"


class Ids(enum.Enum):
    """The ids a mode weights by; the value is what ``group_ids.ids_for_mode`` returns."""

    NONE = None
    """Sequences only (rows, or packed sequences)."""
    PROMPT_GROUPS = "group"
    """Each sequence's prompt group: needed (``group_ids``, ``num_groups``)."""
    TRAJECTORIES = "trajectory"
    """Each sequence's trajectory, where given (``trajectory_ids``, ``num_trajectories``): a
    trajectory split into several rows counts once."""


class CountsView(Protocol):
    """What the weight functions read of ``reduction.StepCounts``."""

    num_tokens: torch.Tensor
    num_sequences: torch.Tensor
    seq_tokens: list[torch.Tensor]
    mb_tokens: torch.Tensor
    dp_size: int
    group_tokens: torch.Tensor | None
    group_ids: list[torch.Tensor] | None


Masks = Sequence[torch.Tensor]
Weights = list[torch.Tensor]
#: Packed micro-batches: each token's sequence, per micro-batch (None: rows).
Segments = Sequence[torch.Tensor | None] | None
#: ``(float32 masks, the step's counts, C, packed segment ids) -> float32 weights``.
WeightFn = Callable[[Masks, CountsView, float | None, Segments], Weights]


@dataclass(frozen=True, slots=True)
class KeptPart:
    """What one micro-batch knows of its kept tokens inside the loss (``kept.KeptStep``)."""

    seq_kept: torch.Tensor
    """Each sequence's kept tokens (float64; summed over CP where the mode needs it whole)."""
    segments: torch.Tensor | None
    """Packed micro-batch: each token's sequence (None: rows)."""
    num_microbatches: int
    """M: micro-batches of the step on this rank."""
    dp_size: int
    """D: the data-parallel size."""
    norm_constant: float | None
    """C, for modes that take it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KeptFactors:
    """A mode's weights when the loss decides its masks (``mask_in_loss``, docs/design.md §10)."""

    local: Callable[[KeptPart], torch.Tensor | float]
    """The part of the weight a micro-batch knows from its own kept tokens (multiplies the kept
    mask inside the loss)."""
    divides_by: Count | None
    """The global count the gradients are divided by once after the schedule (``DEFERRED``);
    None: the local part is the whole weight (``LOCAL``)."""
    whole_sequences: bool
    """Whether the local part needs each sequence's kept tokens over all CP shards (one CP
    all-reduce per micro-batch inside the loss)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mode:
    """One ``--loss-reduction`` mode."""

    name: str
    """The mode's name, as ``--loss-reduction`` and ``LossFixConfig.reduction`` take it."""
    formula: str
    """The per-token weight, as docs/modes.md's table prints it."""
    help: str
    """What ``--loss-reduction``'s help says of it, in parentheses (empty: nothing)."""
    stock: bool = False
    """Megatron's own normalization: the plugin weighs nothing and passes the step through."""
    global_counts: frozenset[Count]
    """The counts over the whole step the weights read (empty: each rank's own masks do)."""
    ids: Ids
    """The ids the weights are over, where the micro-batches carry them."""
    constant: str | None
    """What C means in this mode (``--loss-norm-constant``'s help); None: takes no C."""
    split_dependent: bool
    """Whether the gradient depends on the micro-batch split by definition (the first-step
    re-split check is off by default then)."""
    megatron_per_token: bool
    """Whether Megatron's per-token path (``calculate_per_token_loss``, dividing by the
    all-reduced token count) already is this mode: the mask serves as the weights."""
    weights: WeightFn | None
    """The weights from the step's counts without ids; None: the mode needs its ids."""
    group_weights: WeightFn | None
    """The weights over the groups the ids name (None: the mode reads no ids)."""
    kept: KeptFactors | None
    """Its factors when masks are decided in the loss; None: such a step always counts the
    kept masks in a forward-only pass first (``COUNT``) and weighs them with :attr:`weights`."""

    @property
    def uses_constant(self) -> bool:
        """Whether the mode needs ``norm_constant`` (and refuses it otherwise)."""
        return self.constant is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class Alias:
    """Another name of a mode, accepted wherever a mode is and meaning that mode."""

    name: str
    """The other name."""
    mode: str
    """The mode it names."""
    origin: str
    """Where the name comes from."""


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


def _sum_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    stacked = _stacked(masks, segs)
    if stacked is not None:  # a copy: the weights never alias the caller's masks
        return _split(stacked, masks)
    return [m.clone() for m in masks]


def _token_mean_weights(
    masks: Masks, counts: CountsView, c: float | None, segs: Segments
) -> Weights:
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    inv = (one / counts.num_tokens.clamp(min=1)).float()
    return _times(masks, segs, inv)


def _constant_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    inv = (one / (counts.num_sequences.clamp(min=1) * float(c))).float()
    return _times(masks, segs, inv)


def _legacy_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    scale = float(len(counts.seq_tokens) * counts.dp_size)
    inv = (one / (counts.mb_tokens.clamp(min=1) * scale)).float()
    rows = {m.shape[0] for m in masks}
    stacked = _stacked(masks, segs) if len(rows) == 1 else None
    if stacked is not None:  # every micro-batch has the same rows: the factor of each row
        return _split(stacked * inv.repeat_interleave(rows.pop())[:, None], masks)
    return [m * inv[k] for k, m in enumerate(masks)]


def _sequence_weights(masks: Masks, counts: CountsView, c: float | None, segs: Segments) -> Weights:
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


def _group_mean_weights(
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


def _group_constant_weights(
    masks: Masks, counts: CountsView, c: float | None, segs: Segments
) -> Weights:
    """``m / (G * C)``: every group's token sum over C, averaged over groups."""
    one = torch.ones((), dtype=_COUNT_DTYPE, device=counts.num_tokens.device)
    _, num_groups = _num_groups(counts)
    inv = (one / (num_groups * float(c))).float()
    return _times(masks, segs, inv)


# ---------------------------------------------------------------------- kept factors
def _kept_one(part: KeptPart) -> float:
    return 1.0


def _kept_constant(part: KeptPart) -> float:
    return 1.0 / float(part.norm_constant)


def _kept_legacy(part: KeptPart) -> torch.Tensor:
    one = torch.ones((), dtype=_COUNT_DTYPE, device=part.seq_kept.device)
    scale = float(part.num_microbatches * part.dp_size)
    return (one / (part.seq_kept.sum().clamp(min=1) * scale)).float()


def _kept_sequence(part: KeptPart) -> torch.Tensor:
    one = torch.ones((), dtype=_COUNT_DTYPE, device=part.seq_kept.device)
    inv = (one / part.seq_kept.clamp(min=1)).float()
    return inv[:, None] if part.segments is None else inv[part.segments]


# ---------------------------------------------------------------------- the table
#: The modes, in the order ``REDUCTIONS`` and ``MODES`` list them, the stock mode last (the
#: step's agreement encodes a mode by its place in ``MODES``, the same on every rank).
MODE_RECORDS: tuple[Mode, ...] = (
    Mode(
        name="token_mean",
        formula="m / N",
        help="every loss token equal",
        global_counts=frozenset({Count.N}),
        ids=Ids.NONE,
        constant=None,
        split_dependent=False,
        megatron_per_token=True,
        weights=_token_mean_weights,
        group_weights=None,
        kept=KeptFactors(local=_kept_one, divides_by=Count.N, whole_sequences=False),
    ),
    Mode(
        name="sequence_mean",
        formula="m / (S · n_s)",
        help="every sequence equal; every trajectory where micro-batches carry trajectory_ids",
        global_counts=frozenset({Count.S}),
        ids=Ids.TRAJECTORIES,
        constant=None,
        split_dependent=False,
        megatron_per_token=False,
        weights=_sequence_weights,
        group_weights=_group_mean_weights,
        kept=KeptFactors(local=_kept_sequence, divides_by=Count.S, whole_sequences=True),
    ),
    Mode(
        name="seq_mean_token_sum_norm",
        formula="m / (S · C)",
        help="Dr. GRPO, needs --loss-norm-constant",
        global_counts=frozenset({Count.S}),
        ids=Ids.TRAJECTORIES,
        constant="the loss is sum over sequences of the token sum divided by (number of "
        "sequences x C); e.g. the maximum response length",
        split_dependent=False,
        megatron_per_token=False,
        weights=_constant_weights,
        group_weights=_group_constant_weights,
        kept=KeptFactors(local=_kept_constant, divides_by=Count.S, whole_sequences=False),
    ),
    Mode(
        name="sum",
        formula="m",
        help="",
        global_counts=frozenset(),
        ids=Ids.NONE,
        constant=None,
        split_dependent=False,
        megatron_per_token=False,
        weights=_sum_weights,
        group_weights=None,
        kept=KeptFactors(local=_kept_one, divides_by=None, whole_sequences=False),
    ),
    Mode(
        name="token_mean_legacy",
        formula="m / (n_k · M · D)",
        help="reproduces the old mean of per-micro-batch means",
        global_counts=frozenset(),
        ids=Ids.NONE,
        constant=None,
        split_dependent=True,
        megatron_per_token=False,
        weights=_legacy_weights,
        group_weights=None,
        kept=KeptFactors(local=_kept_legacy, divides_by=None, whole_sequences=True),
    ),
    Mode(
        name="group_mean",
        formula="m / (G · n_g)",
        help="every prompt group equal, token mean inside it; needs group_ids and num_groups "
        "in the micro-batches",
        global_counts=frozenset({Count.GROUPS}),
        ids=Ids.PROMPT_GROUPS,
        constant=None,
        split_dependent=False,
        megatron_per_token=False,
        weights=None,
        group_weights=_group_mean_weights,
        kept=None,
    ),
    Mode(
        name="off",
        formula="(stock)",
        help="a literal pass-through to stock Megatron",
        stock=True,
        global_counts=frozenset(),
        ids=Ids.NONE,
        constant=None,
        split_dependent=True,
        megatron_per_token=False,
        weights=None,
        group_weights=None,
        kept=None,
    ),
)

ALIAS_RECORDS: tuple[Alias, ...] = (
    Alias(name="prompt_mean", mode="group_mean", origin="SkyRL's name (group_mean over prompts)"),
)

#: The mode of a ``LossFixConfig()`` without ``reduction``.
DEFAULT_MODE = "token_mean"


def check_table(modes: Sequence[Mode], aliases: Sequence[Alias], default: str) -> None:
    """Raise ``ValueError`` naming the record for a table that is incomplete or contradicts
    itself (run on the table at import; the unit tests run it on broken copies)."""
    names = [m.name for m in modes] + [a.name for a in aliases]
    if len(set(names)) != len(names):
        raise ValueError(f"mode table: a name is given twice in {names}")
    by_name = {m.name: m for m in modes}
    if sum(m.stock for m in modes) != 1 or not modes[-1].stock:
        raise ValueError("mode table: exactly one stock mode, the last record")
    for alias in aliases:
        if alias.mode not in by_name or by_name[alias.mode].stock:
            raise ValueError(f"mode table: alias {alias.name!r} names no plugin mode")
    if default not in by_name or by_name[default].stock:
        raise ValueError(f"mode table: the default {default!r} is no plugin mode")
    for mode in modes:
        problem = _record_problem(mode)
        if problem:
            raise ValueError(f"mode table: record {mode.name!r}: {problem}")


def _record_problem(mode: Mode) -> str | None:
    """What is wrong with one record, or None."""
    if not isinstance(mode.ids, Ids) or not all(isinstance(c, Count) for c in mode.global_counts):
        return "ids must be an Ids and global_counts a set of Count"
    if mode.stock:
        fields = (mode.global_counts, mode.weights, mode.group_weights, mode.kept, mode.constant)
        if any(fields) or mode.ids is not Ids.NONE or not mode.split_dependent:
            return "the stock mode weighs nothing: no counts, ids, weights, constant"
        return None
    if (mode.weights is None) != (mode.ids is Ids.PROMPT_GROUPS):
        return "weights without ids, exactly unless the ids are needed (PROMPT_GROUPS)"
    if (mode.group_weights is None) != (mode.ids is Ids.NONE):
        return "group_weights exactly when the mode reads ids"
    if (Count.GROUPS in mode.global_counts) != (mode.ids is Ids.PROMPT_GROUPS):
        return "Count.GROUPS among global_counts exactly when the ids are needed"
    if mode.kept is None and mode.ids is not Ids.PROMPT_GROUPS:
        return "kept factors are needed (only a mode that needs its ids counts them first)"
    if mode.kept is not None:
        divides_by = mode.kept.divides_by
        if divides_by is not None and divides_by not in mode.global_counts - {Count.GROUPS}:
            return f"kept.divides_by {divides_by} must be one of global_counts (N or S)"
    if mode.megatron_per_token and mode.global_counts != {Count.N}:
        return "megatron_per_token: Megatron's per-token path divides by N alone"
    if not mode.formula or (mode.constant is not None and not mode.constant):
        return "formula (and the constant's meaning, where given) must not be empty"
    return None


check_table(MODE_RECORDS, ALIAS_RECORDS, DEFAULT_MODE)

_BY_NAME: dict[str, Mode] = {m.name: m for m in MODE_RECORDS}
#: The plugin's modes (docs/design.md §2).
REDUCTIONS: tuple[str, ...] = tuple(m.name for m in MODE_RECORDS if not m.stock)
#: The name of stock Megatron's mode.
STOCK: str = next(m.name for m in MODE_RECORDS if m.stock)
#: Every accepted ``--loss-reduction``: the modes, and ``off`` (stock Megatron).
MODES: tuple[str, ...] = (*REDUCTIONS, STOCK)
#: Other names of modes: SkyRL calls ``group_mean`` over prompt groups ``prompt_mean``.
ALIASES: dict[str, str] = {a.name: a.mode for a in ALIAS_RECORDS}


def canonical_mode(reduction: str) -> str:
    """The mode an alias names (``prompt_mean`` -> ``group_mean``); other names unchanged."""
    return ALIASES.get(reduction, reduction)


def mode_of(reduction: str) -> Mode:
    """The record of a mode or alias name; ``ValueError`` for any other name."""
    record = _BY_NAME.get(canonical_mode(reduction)) if isinstance(reduction, str) else None
    if record is None:
        raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {MODES}")
    return record


def modes_reading(ids: Ids) -> tuple[str, ...]:
    """The modes whose weights are over ``ids``."""
    return tuple(m.name for m in MODE_RECORDS if m.ids is ids and not m.stock)


def quoted_with_aliases(names: Sequence[str]) -> str:
    """``'group_mean' (prompt_mean)``: each mode quoted, its aliases after it (for messages)."""
    parts = []
    for name in names:
        aliases = [a for a, m in ALIASES.items() if m == name]
        parts.append(f"{name!r}" + (f" ({', '.join(aliases)})" if aliases else ""))
    return " or ".join(parts)


def megatron_normalizes(mode: Mode, per_token: bool) -> bool:
    """Whether Megatron's own division already is ``mode`` (the mask serves as the weights):
    stock, and on Megatron's per-token path a mode that divides by N alone. A step whose loss
    decides its masks still weighs them (``mask_in_loss``)."""
    return mode.stock or (per_token and mode.megatron_per_token)


def describe_modes() -> str:
    """The modes and their aliases as ``--loss-reduction``'s help lists them."""
    parts = []
    for mode in MODE_RECORDS:
        aliases = [a for a, m in ALIASES.items() if m == mode.name]
        said = mode.name
        if aliases:
            said += f" or its alias{'es' * (len(aliases) > 1)} {', '.join(aliases)}"
        parts.append(said + (f" ({mode.help})" if mode.help else ""))
    return ", ".join(parts[:-1]) + ", or " + parts[-1]
