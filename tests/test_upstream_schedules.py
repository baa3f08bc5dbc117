"""Megatron-Core's own pipeline-schedule unit tests, stock and with the plugin swapped in.

Needs ``MEGATRON_LM_ARCHIVES`` (a folder of Megatron-LM source archives; the tag of the
installed megatron-core's release series is unpacked, or those of ``MEGATRON_LM_TAGS``),
pytest-mock, and for tags >= 0.19 Megatron-LM's training dependencies (its ``test_utilities``
imports ``megatron.training``); skips without them. Runs the tree's
``tests/unit_tests/pipeline_parallel/test_schedules.py`` on 8 ranks on gloo (launched as torchrun
would, ``helpers.launch``) through :mod:`helpers.upstream_schedules` with
``LossFixSchedule(LossFixConfig(reduction="off"), forward_backward_func=<stock>)`` in place of
each of the three schedules: every test must pass on every rank, or skip on every rank by its
own condition (the custom-process-group tests left out on gloo, see ``DESELECT``). Each rank
writes its tests' outcomes to a file (``helpers.upstream_schedules.OUTCOMES_ENV``); a test a rank
did not report counts as MISSING there. Only when some test does not pass is the file run stock
too, to tell what fails alike without the plugin from what the plugin causes: then every test
must end the same way on every rank in both runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

import pytest
from helpers.launch import launch
from helpers.megatron_lm_run import (
    archives_folder,
    skip_reason,
    tags_to_test,
    unpack_tag,
)
from helpers.upstream_schedules import OUTCOMES_ENV

ARCHIVES = archives_folder()
TAGS = tags_to_test(ARCHIVES) if ARCHIVES else []
TEST_FILE = "tests/unit_tests/pipeline_parallel/test_schedules.py"
RANKS = 8

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not TAGS,
        reason=skip_reason(ARCHIVES),
    ),
    pytest.mark.skipif(importlib.util.find_spec("pytest_mock") is None, reason="needs pytest-mock"),
]


#: What the 8 ranks import, once for all the runs of a tree (``helpers.launch``).
PRELOAD = (
    "pytest",
    "torch.distributed",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "helpers.upstream_schedules",
)
#: Left out: the custom-process-group tests build their groups with ``dist.new_group`` called
#: with a different rank list on each rank, which NCCL tolerates; on gloo that group creation
#: deadlocks until the group timeout now and then, stock and swapped alike, before any schedule
#: runs (seen at both tags), and a deadlock takes the tests after it down too.
DESELECT = "not custom_pgs"


def _run(checkout: Path, swap: str, test: str = TEST_FILE) -> dict[str, set[str]]:
    """``test id -> outcomes seen on the 8 ranks`` for one launch of the upstream file (or of
    one of its tests), from the files the ranks write (``OUTCOMES_ENV``); a test that a rank
    did not report (it died, or never got there) counts as MISSING on that rank."""
    outcomes_dir = Path(tempfile.mkdtemp(prefix="outcomes-", dir=checkout))
    env = {
        **os.environ,
        "LOSSFIX_SWAP": swap,
        OUTCOMES_ENV: str(outcomes_dir),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(  # the package, and tests/ for helpers.upstream_schedules
            [
                str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parent),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    args = ["-q", "-o", "addopts=", "--noconftest", "-p", "no:cacheprovider",
            "-p", "helpers.upstream_schedules", "-k", DESELECT, test]  # fmt: skip
    launch("pytest", RANKS, args, module=True, cwd=checkout, env=env, preload=PRELOAD,
           timeout=1800)  # fmt: skip
    per_rank = [
        json.loads(path.read_text()) if path.is_file() else {}
        for path in (outcomes_dir / f"rank{rank}.json" for rank in range(RANKS))
    ]
    tests = set().union(*per_rank)
    return {t: {rank.get(t, "MISSING") for rank in per_rank} for t in tests}


def _differing(stock: dict, swapped: dict) -> list[str]:
    return sorted(t for t in stock.keys() | swapped.keys() if stock.get(t) != swapped.get(t))


@pytest.mark.parametrize("tag", TAGS or ["none"])
def test_megatron_schedule_tests_pass_alike_stock_and_swapped(tag, tmp_path, report_figure):
    """Swapped first; the stock run (as long again) only when the swapped run has a test that
    did not pass on every rank, to tell "alike without the plugin" from "caused by it"."""
    checkout = unpack_tag(ARCHIVES, tag, tmp_path)
    if not (checkout / TEST_FILE).exists():
        pytest.skip(f"{TEST_FILE} not in {tag}")
    swapped = _run(checkout, "off")
    assert swapped, f"the swapped run reported no test outcome (tag {tag})"
    passed = sum(o == {"PASSED"} for o in swapped.values())
    skipped = sum(o == {"SKIPPED"} for o in swapped.values())  # the tests' own conditions
    assert passed, f"no test passed swapped (tag {tag}): {swapped}"
    if passed + skipped == len(swapped):
        report_figure(
            f"Megatron-Core's schedule tests {tag}: {passed} of {len(swapped)} passed on all 8 "
            f"ranks with the plugin swapped in, {skipped} skipped on all 8 by their own "
            "conditions (stock run not needed: nothing to tell apart)"
        )
        return
    stock = _run(checkout, "stock")
    assert any(o == {"PASSED"} for o in stock.values()), f"stock passed nothing: {stock}"
    # Should a gloo deadlock still strike (see DESELECT), the test that hit the timeout leaves
    # the tests after it failing too: a test whose outcome differs is run again alone, both ways.
    retried = []
    for _ in range(2):
        differ = _differing(stock, swapped)
        for test in differ:
            stock.update(_run(checkout, "stock", test))
            swapped.update(_run(checkout, "off", test))
        retried += differ
    assert swapped == stock, f"swapped {swapped} != stock {stock}"
    passed = sum(o == {"PASSED"} for o in stock.values())
    others = {t.split("::")[-1]: sorted(o) for t, o in stock.items() if o != {"PASSED"}}
    report_figure(
        f"Megatron-Core's schedule tests {tag}: {passed} of {len(stock)} passed on all 8 ranks, "
        f"swapped and stock (run because some did not pass swapped); the others, alike both "
        f"runs: {others}; run again alone: {retried or 'none'}"
    )
