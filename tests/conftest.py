"""Shared pytest fixtures and the test tiers.

Every test carries exactly one tier marker (set per file with ``pytestmark``, or per test in a
file that mixes tiers); collection fails otherwise, so a new test cannot slip in untiered:

* ``unit``: no process group and no Megatron model (weights, config, flags, losses, the log-prob
  kernel, the re-split planner, the patch tool offline, the agreement record). ``pytest -m unit``
  runs in under a minute: run it before every commit.
* ``oracle``: the rank pool and the gradient oracle over the layout matrix.
* ``e2e``: whole programs (examples, the pages' commands, Megatron Bridge, Megatron-LM's
  ``pretrain_gpt.py``, Megatron-Core's own schedule tests).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.inputs import fail_in_ci
from helpers.launch import slots

from megatron_lossfix.audit.pool import DistPool

TIERS = {
    "unit": "no process group, no Megatron model; `pytest -m unit` runs in under a minute",
    "oracle": "the rank pool and the gradient oracle over the layout matrix",
    "e2e": "whole programs: examples, the pages' commands, Bridge, Megatron-LM, upstream schedules",
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
    # Whole programs first, then the oracle, then the unit tests (a stable sort: files keep
    # their order within a tier). pytest-xdist hands out files in this order (the noxfile turns
    # its reordering by test count off): the files that take minutes start early, and the run
    # ends on short ones that keep both workers busy to the end.
    order = list(TIERS)[::-1]
    items.sort(key=lambda item: order.index(_tier(item)))


def _tier(item: pytest.Item) -> str:
    return next(m.name for m in item.iter_markers() if m.name in TIERS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fail-if-none-ran",
        action="store_true",
        help="exit 1 when no selected test passed or failed (all skipped: a missing dependency)",
    )


@pytest.fixture
def report_figure(record_property):
    """``report_figure(line)``: print ``line`` in the run's closing summary, pass or fail (a
    property of the test's report, so that it reaches the summary from pytest-xdist's workers)."""
    return lambda line: record_property("figure", line)


def pytest_terminal_summary(terminalreporter) -> None:
    calls = [r for reports in terminalreporter.stats.values() for r in reports
             if getattr(r, "when", None) == "call"]  # fmt: skip
    figures = [value for r in calls for name, value in r.user_properties if name == "figure"]
    if figures:
        terminalreporter.section("figures")
        for line in figures:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Under CI, a test skipped for a missing input (``helpers.inputs``) fails instead."""
    outcome = yield
    fail_in_ci(outcome.get_result())


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.getoption("fail_if_none_ran") or hasattr(session.config, "workerinput"):
        return  # an xdist worker: its controller decides
    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    if exitstatus == 0 and not stats.get("passed") and not stats.get("failed"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nno test ran: every selected test was skipped (--fail-if-none-ran)")


class _SharingPool(DistPool):
    """The rank pool, holding two of the machine's slots per run (``helpers.launch.slots``): a
    run is seconds, and need not wait for the other worker's launches, but an 8-rank launch
    that holds them all then runs alone, and no run crowds in beside it."""

    def run(self, fn, world_size: int, *args, **kwargs) -> list:
        with slots(min(world_size, 2)):
            return super().run(fn, world_size, *args, **kwargs)


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[DistPool]:
    """8 long-lived ranks, started on first use (imports cost seconds per rank) and shared by all
    tests; each `dist_pool.run(fn, world_size, ...)` gets a fresh gloo world of that size."""
    pool = _SharingPool(max_ranks=8, timeout_s=120)
    yield pool
    pool.close()
