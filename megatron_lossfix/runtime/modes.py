"""The reduction modes as data: one record per mode and per alias (docs/modes.md), and the
names the package reads off them.

Every other module asks the record (:func:`mode_of`); none names a mode itself. The table is
checked when this module is imported (:func:`~megatron_lossfix.runtime.mode_record.check_table`):
an incomplete or contradictory record raises there, never in a branch that guesses. Adding a
mode is one record here and its row in docs/modes.md (a unit test compares the two). What a
record holds is :mod:`megatron_lossfix.runtime.mode_record`; the weight functions it names are
:mod:`megatron_lossfix.runtime.mode_formulas`.

Plain data and look-ups (the formulas it names are torch); no Megatron.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_lossfix.runtime.mode_formulas import (
    constant_weights,
    group_constant_weights,
    group_mean_weights,
    kept_constant,
    kept_legacy,
    kept_one,
    kept_sequence,
    legacy_weights,
    pair_mean_weights,
    sequence_weights,
    sum_weights,
    token_mean_weights,
)
from megatron_lossfix.runtime.mode_record import (
    Alias,
    Count,
    Ids,
    KeptFactors,
    Mode,
    check_table,
)

__all__ = [
    "ALIASES",
    "ALIAS_RECORDS",
    "DEFAULT_MODE",
    "MODES",
    "MODE_RECORDS",
    "REDUCTIONS",
    "STOCK",
    "canonical_mode",
    "describe_modes",
    "mode_of",
    "modes_reading",
    "quoted_with_aliases",
]


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
        weights=token_mean_weights,
        group_weights=None,
        kept=KeptFactors(local=kept_one, divides_by=Count.N, whole_sequences=False),
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
        weights=sequence_weights,
        group_weights=group_mean_weights,
        kept=KeptFactors(local=kept_sequence, divides_by=Count.S, whole_sequences=True),
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
        weights=constant_weights,
        group_weights=group_constant_weights,
        kept=KeptFactors(local=kept_constant, divides_by=Count.S, whole_sequences=False),
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
        weights=sum_weights,
        group_weights=None,
        kept=KeptFactors(local=kept_one, divides_by=None, whole_sequences=False),
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
        weights=legacy_weights,
        group_weights=None,
        kept=KeptFactors(local=kept_legacy, divides_by=None, whole_sequences=True),
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
        group_weights=group_mean_weights,
        kept=None,
    ),
    Mode(
        name="pair_mean",
        formula="m / (P · n_p)",
        help="every preference pair (or KTO example, reward pair) equal, token mean inside it; "
        "needs pair_ids in the micro-batches",
        global_counts=frozenset({Count.PAIRS}),
        ids=Ids.PAIRS,
        constant=None,
        split_dependent=False,
        megatron_per_token=False,
        weights=None,
        group_weights=pair_mean_weights,
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
