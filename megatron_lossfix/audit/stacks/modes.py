"""A framework's loss aggregation modes, their counterparts among the plugin's modes, and the
stack report's rows per mode and per run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_lossfix.audit.oracle import relative_error

__all__ = ["StackMode", "mode_rows", "record_runs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StackMode:
    """A framework's loss aggregation mode and its counterpart among the plugin's modes."""

    plugin_mode: str
    """The plugin mode with the same per-token weights up to ``sequence_scale``."""
    norm_constant: float | None = None
    """The plugin's ``norm_constant`` for ``seq_mean_token_sum_norm`` counterparts."""
    divides_by_batch_size: bool = False
    """The framework divides by the configured number of sequences (empty ones included) where
    the plugin divides by the sequences that have loss tokens: its reference is the plugin's
    scaled by (non-empty sequences / all sequences)."""


def mode_rows(rows: Sequence[str], modes: Sequence[str]) -> dict[tuple[str, str], str]:
    """``(row, mode) -> "row:mode"``, the report's row of each stack row under each mode, where
    the run checks more than one mode; with one mode the worst-mode rows ``rows`` are those
    rows already (the table would print each twice), so there are none."""
    if len(modes) < 2:
        return {}
    return {(row, mode): f"{row}:{mode}" for row in rows for mode in modes}


def record_runs(
    report: Any,
    tolerance: float,
    layout: Any,
    got: dict,
    targets: dict,
    *,
    released: str,
    own: str,
    name: Callable[[str, str, str], str],
) -> None:
    """Record one layout's rows of a stack whose runs are ``(row, mode, setting)``: each run's
    error against its target (``name`` gives its row), and the worst of each row over the runs.
    The row ``own`` (the framework against its own one-rank result) compares the ``released``
    row's gradient and has no worst row."""
    worst: dict[str, float] = {}
    for (row, mode, setting), want in targets.items():
        have = got[(released if row == own else row, mode, setting)]
        err = relative_error(have, want)
        if row != own:
            worst[row] = max(worst.get(row, 0.0), err)
        report.add_result(name(row, mode, setting), layout, {"error": err}, tolerance)
    for row, err in worst.items():
        report.add_result(row, layout, {"error": err}, tolerance)
