"""Shared pytest fixtures and the test tiers.

Every test carries exactly one tier marker (set per file with ``pytestmark``, or per test in a
file that mixes tiers); collection fails otherwise, so a new test cannot slip in untiered:

* ``unit``: no process group and no Megatron model (weights, config, flags, losses, the log-prob
  kernel, the re-split planner, the patch tool offline, the agreement record). ``pytest -m unit``
  runs in under a minute: run it before every commit.
* ``oracle``: the rank pool and the gradient oracle over the layout matrix.
* ``e2e``: whole programs (examples, README commands, Megatron Bridge, Megatron-LM's
  ``pretrain_gpt.py``, Megatron-Core's own schedule tests).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megatron_lossfix.audit.pool import DistPool

TIERS = {
    "unit": "no process group, no Megatron model; `pytest -m unit` runs in under a minute",
    "oracle": "the rank pool and the gradient oracle over the layout matrix",
    "e2e": "whole programs: examples, README commands, Bridge, Megatron-LM, upstream schedules",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def tier_problems(items: list[pytest.Item]) -> list[str]:
    """One line per test without exactly one tier, or a unit test that asks for the rank pool."""
    problems = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: tiers {tiers or 'none'}; needs one of {list(TIERS)}")
        elif tiers == ["unit"] and "dist_pool" in getattr(item, "fixturenames", ()):
            problems.append(f"{item.nodeid}: marked unit but uses the rank pool (dist_pool)")
    return problems


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = tier_problems(items)
    if problems:
        raise pytest.UsageError("tests without a valid tier marker:\n" + "\n".join(problems))


#: Lines that tests report for the run's summary (the figures of the Megatron-LM runs).
FIGURES: list[str] = []


@pytest.fixture
def report_figure():
    """``report_figure(line)``: print ``line`` in the run's closing summary, pass or fail."""
    return FIGURES.append


def pytest_terminal_summary(terminalreporter) -> None:
    if FIGURES:
        terminalreporter.section("figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[DistPool]:
    """8 long-lived ranks, started on first use (imports cost seconds per rank) and shared by all
    tests; each `dist_pool.run(fn, world_size, ...)` gets a fresh gloo world of that size."""
    pool = DistPool(max_ranks=8, timeout_s=120)
    yield pool
    pool.close()
