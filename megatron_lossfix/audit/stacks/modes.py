"""A framework's loss aggregation modes and their counterparts among the plugin's modes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StackMode"]


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
