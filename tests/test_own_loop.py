"""End-to-end: ``examples/own_loop.py``, the own-loop recipe as a script, its refusal
under torchrun (its agreement run forks its ranks as torchrun would start them: ``helpers.launch``).

One rank and DP2 must agree step by step; DP2 without ``finalize_model_grads_func`` (the
gradients would never be reduced across ranks) must be refused at the first step on both ranks,
each with the one-line fix, by the plugin's structural guard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launch import launch, slots
from test_examples import PRELOAD, example_env

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
FIX = "set config.finalize_model_grads_func = finalize_model_grads"


def _own_loop(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(ROOT / "examples" / "own_loop.py"), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with slots(nproc):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def _records(proc: subprocess.CompletedProcess) -> list[dict]:
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _forked_records(nproc: int, *args: str) -> list[dict]:
    """The records of a launch forked from the examples' zygote (``helpers.launch``)."""
    script = ROOT / "examples" / "own_loop.py"
    run = launch(script, nproc, args, cwd=ROOT, env=example_env(), preload=PRELOAD, timeout=600)
    assert run.returncode == 0, run.output[-6000:]
    return [json.loads(line) for line in run.output.splitlines() if line.startswith("{")]


def test_one_rank_and_dp2_agree():
    one = _forked_records(1, "--micro-batch-size", "8")
    two = _forked_records(2, "--micro-batch-size", "2")  # 2 ranks x 2 micro-batches
    assert [r["iteration"] for r in one] == [r["iteration"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert a["num_tokens"] == b["num_tokens"]
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-6 * abs(a[key]), (key, one, two)


def test_dp2_without_finalize_model_grads_is_refused_on_both_ranks():
    proc = _own_loop(2, "--micro-batch-size", "2", "--skip-finalize-model-grads")
    assert proc.returncode != 0, proc.stdout
    assert not [line for line in proc.stdout.splitlines() if line.startswith("{")], proc.stdout
    for rank in (0, 1):
        lines = [x for x in proc.stdout.splitlines() if x.startswith(f"rank {rank}: ")]
        assert len(lines) == 1, (rank, proc.stdout, proc.stderr[-3000:])
        assert lines[0].startswith(f"rank {rank}: megatron_lossfix refused this step: ")
        assert FIX in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--lr", "-0.01"), "--lr"),
        (("--micro-batch-size", "0"), "--micro-batch-size"),
        (("--global-batch-size", "8", "--micro-batch-size", "3"), "--global-batch-size"),
        (("--loss-norm-constant", "5"), "--loss-norm-constant"),
    ],
)
def test_bad_flags_stop_before_start_up_with_one_line(args, flag):
    """Checked before the process group starts: argparse's one line naming the flag, exit 2."""
    cmd = [sys.executable, str(ROOT / "examples" / "own_loop.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]  # no usage screen, no traceback
    error = lines[0]
    assert error.startswith("own_loop.py: error: "), proc.stderr[-2000:]
    assert flag in error and "Traceback" not in proc.stderr, proc.stderr[-2000:]
