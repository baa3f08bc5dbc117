"""A framework's loss aggregation modes, their counterparts among the plugin's modes, and the
stack report's rows per mode."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StackMode", "mode_rows"]


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
