"""What a reduction mode is: the record each mode of the table fills in, and the check that a
table of them is complete and agrees with itself (docs/modes.md).

Each :class:`Mode` says everything the package needs to know about a mode: the global counts
its weights read, the ids it weights by, whether it takes the constant C, whether its gradient
depends on the micro-batch split, its factors when the loss decides its masks, and its weight
functions. A rule about modes is a field of the record (or a function of the record alone,
such as :func:`megatron_normalizes`), never a branch on a mode's name. The records themselves
are the table of :mod:`megatron_lossfix.runtime.modes`, their formulas
:mod:`megatron_lossfix.runtime.mode_formulas`.

Pure torch, no Megatron.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "Alias",
    "Count",
    "CountsView",
    "Ids",
    "KeptFactors",
    "KeptPart",
    "Masks",
    "Mode",
    "Segments",
    "WeightFn",
    "Weights",
    "check_table",
    "megatron_normalizes",
]


class Count(enum.Enum):
    """A count summed over the whole step (every micro-batch, every DP and CP rank)."""

    N = "loss tokens"
    S = "sequences with a loss token"
    GROUPS = "loss tokens of each group (prompt or trajectory), and G"
    PAIRS = "pairs (units of sequences sharing a pair id in a micro-batch) with a loss token"


class Ids(enum.Enum):
    """The ids a mode weights by; the value is what ``prompt_groups.ids_for_mode`` returns."""

    NONE = None
    """Sequences only (rows, or packed sequences)."""
    PROMPT_GROUPS = "group"
    """Each sequence's prompt group: needed (``group_ids``, ``num_groups``)."""
    TRAJECTORIES = "trajectory"
    """Each sequence's trajectory, where given (``trajectory_ids``, ``num_trajectories``): a
    trajectory split into several rows counts once."""
    PAIRS = "pair"
    """Each sequence's pair in its micro-batch: needed (``pair_ids``, local to the micro-batch,
    in ``[0, its sequences)``; no range): a preference pair, a KTO example, a reward pair."""

    @property
    def needed(self) -> bool:
        """Whether the mode cannot weigh without them (a sequence mode's trajectories are
        optional)."""
        return self in (Ids.PROMPT_GROUPS, Ids.PAIRS)

    @property
    def whole_units(self) -> bool:
        """Whether the sequences sharing an id are one unit that must stay in one micro-batch
        (a pair): the self-check then never moves rows and halves by whole units."""
        return self is Ids.PAIRS

    @property
    def step_wide(self) -> bool:
        """Whether the ids are global over the step, in a range every rank gives alike (counted
        per id over DP x CP); else each micro-batch's own (pairs, counted where they lie)."""
        return self in (Ids.PROMPT_GROUPS, Ids.TRAJECTORIES)


class CountsView(Protocol):
    """What the weight functions read of ``weights.StepCounts``."""

    num_tokens: torch.Tensor
    num_sequences: torch.Tensor
    seq_tokens: list[torch.Tensor]
    mb_tokens: torch.Tensor
    dp_size: int
    group_tokens: torch.Tensor | None
    group_ids: list[torch.Tensor] | None
    num_pairs: torch.Tensor | None


Masks = Sequence[torch.Tensor]
Weights = list[torch.Tensor]
#: Packed micro-batches: each token's sequence, per micro-batch (None: rows).
Segments = Sequence[torch.Tensor | None] | None
#: ``(float32 masks, the step's counts, C, packed segment ids) -> float32 weights``.
WeightFn = Callable[[Masks, CountsView, float | None, Segments], Weights]


@dataclass(frozen=True, slots=True)
class KeptPart:
    """What one micro-batch knows of its kept tokens inside the loss (``mask_in_loss.KeptStep``)."""

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


def megatron_normalizes(mode: Mode, per_token: bool) -> bool:
    """Whether Megatron's own division already is ``mode`` (the mask serves as the weights):
    stock, and on Megatron's per-token path a mode that divides by N alone. A step whose loss
    decides its masks still weighs them (``mask_in_loss``)."""
    return mode.stock or (per_token and mode.megatron_per_token)


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
    if (mode.weights is None) != mode.ids.needed:
        return "weights without ids, exactly unless the ids are needed (PROMPT_GROUPS, PAIRS)"
    if (mode.group_weights is None) != (mode.ids is Ids.NONE):
        return "group_weights exactly when the mode reads ids"
    if (Count.GROUPS in mode.global_counts) != (mode.ids is Ids.PROMPT_GROUPS):
        return "Count.GROUPS among global_counts exactly when the prompt groups are needed"
    if (Count.PAIRS in mode.global_counts) != (mode.ids is Ids.PAIRS):
        return "Count.PAIRS among global_counts exactly when the mode reads pair ids"
    if mode.kept is None and not mode.ids.needed:
        return "kept factors are needed (only a mode that needs its ids counts them first)"
    if mode.kept is not None:
        divides_by = mode.kept.divides_by
        if divides_by is not None and divides_by not in mode.global_counts & {Count.N, Count.S}:
            return f"kept.divides_by {divides_by} must be one of global_counts (N or S)"
    if mode.megatron_per_token and mode.global_counts != {Count.N}:
        return "megatron_per_token: Megatron's per-token path divides by N alone"
    if not mode.formula or (mode.constant is not None and not mode.constant):
        return "formula (and the constant's meaning, where given) must not be empty"
    return None
