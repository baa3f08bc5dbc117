"""Megatron-Core's own pipeline-schedule unit tests, stock and with the plugin swapped in.

Needs a Megatron-LM checkout (``MEGATRON_LM_PATH``; any supported tag), pytest-mock, and for
tags >= 0.19 Megatron-LM's training dependencies (its ``test_utilities`` imports
``megatron.training``); skips without them. Runs the checkout's
``tests/unit_tests/pipeline_parallel/test_schedules.py`` under torchrun with 8 ranks on gloo
through :mod:`megatron_lossfix.testing.upstream_schedules`, once stock and once with
``LossFixSchedule(LossFixConfig(reduction="off"), forward_backward_func=<stock>)`` in place of
each of the three schedules; every test must end the same way on every rank in both runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
TEST_FILE = "tests/unit_tests/pipeline_parallel/test_schedules.py"

pytestmark = [
    pytest.mark.skipif(not CHECKOUT, reason="MEGATRON_LM_PATH (a Megatron-LM checkout) not set"),
    pytest.mark.skipif(
        importlib.util.find_spec("pytest_mock") is None, reason="needs pytest-mock"
    ),
]


def _run(swap: str, port: int) -> dict[str, set[str]]:
    """``test id -> outcomes seen on the 8 ranks`` for one torchrun of the upstream file."""
    env = {
        **os.environ,
        "LOSSFIX_SWAP": swap,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8",
        "--master-port", str(port), "-m", "pytest", "-q", "-rA", "-o", "addopts=",
        "--noconftest", "-p", "no:cacheprovider",
        "-p", "megatron_lossfix.testing.upstream_schedules", TEST_FILE,
    ]
    out = subprocess.run(
        cmd, cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=1800
    ).stdout
    outcomes: dict[str, set[str]] = {}
    for kind, test in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+)", out, re.M):
        outcomes.setdefault(test, set()).add(kind)
    return outcomes


def test_megatron_schedule_tests_pass_alike_stock_and_swapped():
    if not (Path(CHECKOUT) / TEST_FILE).exists():
        pytest.skip(f"{TEST_FILE} not in {CHECKOUT}")
    stock = _run("stock", 29531)
    swapped = _run("off", 29532)
    assert any(o == {"PASSED"} for o in stock.values()), f"stock passed nothing: {stock}"
    assert swapped == stock, f"swapped {swapped} != stock {stock}"
