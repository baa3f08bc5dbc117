"""Shared pytest fixtures: one pool of CPU/gloo worker ranks for the whole test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megatron_lossfix.testing.pool import DistPool


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[DistPool]:
    """8 long-lived ranks, started on first use (imports cost seconds per rank) and shared by all
    tests; each `dist_pool.run(fn, world_size, ...)` gets a fresh gloo world of that size."""
    pool = DistPool(max_ranks=8, timeout_s=120)
    yield pool
    pool.close()
