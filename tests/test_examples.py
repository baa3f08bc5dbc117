"""End-to-end: the example scripts under torchrun, two layouts of the same training run.

Runs that differ only in layout must write ``--metrics-out`` files whose loss and grad_norm
agree to 1e-5 relative for 3 iterations; with ``--loss-reduction off`` they must not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def run_example(script: str, nproc: int, out: Path, *args: str) -> list[dict]:
    """Launch ``examples/<script>`` with torchrun and return its metrics records."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(ROOT / "examples" / script),
        "--metrics-out", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{tail}"
    return [json.loads(line) for line in out.read_text().splitlines()]


def max_rel_diff(a: list[dict], b: list[dict], key: str) -> float:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    return max(abs(x[key] - y[key]) / abs(x[key]) for x, y in zip(a, b, strict=True))


COMMON = ["--train-iters", "3", "--global-batch-size", "12", "--seq-length", "64",
          "--hidden-size", "32", "--num-layers", "2"]  # fmt: skip


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "off"])
def test_pretrain_gpt_layouts_agree(tmp_path, reduction):
    one = run_example("pretrain_gpt.py", 1, tmp_path / "one.jsonl", *COMMON,
                      "--micro-batch-size", "12", "--loss-reduction", reduction)  # fmt: skip
    two = run_example("pretrain_gpt.py", 2, tmp_path / "two.jsonl", *COMMON,
                      "--micro-batch-size", "2", "--loss-reduction", reduction)  # fmt: skip
    assert len(one) == len(two) == 3
    for rec in one:
        assert {"iteration", "loss", "grad_norm", "num_tokens", "step_time_s"} <= set(rec)
    assert [r["num_tokens"] for r in one] == [r["num_tokens"] for r in two]
    loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
    if reduction == "off":
        assert max(loss_diff, norm_diff) > 1e-3, f"stock Megatron agreed: {loss_diff}, {norm_diff}"
    else:
        assert loss_diff <= TOL and norm_diff <= TOL, (reduction, loss_diff, norm_diff, one, two)


@pytest.mark.parametrize(
    "layout_args",
    [
        ["--context-parallel-size", "2", "--no-attention"],
        ["--expert-model-parallel-size", "2", "--num-experts", "4"],
    ],
    ids=["cp2", "ep2-moe"],
)
def test_pretrain_gpt_cp_and_ep_layouts_agree(tmp_path, layout_args):
    """Context parallelism (attention-free layers on CPU) and expert parallelism against one
    rank with one micro-batch; aux losses off, since by design they keep stock semantics."""
    model = [a for a in layout_args if a in ("--no-attention",)]
    if "--num-experts" in layout_args:
        model += ["--num-experts", "4"]
    one = run_example("pretrain_gpt.py", 1, tmp_path / "one.jsonl", *COMMON,
                      "--micro-batch-size", "12", *model)  # fmt: skip
    two = run_example("pretrain_gpt.py", 2, tmp_path / "two.jsonl", *COMMON,
                      "--micro-batch-size", "2", *layout_args)  # fmt: skip
    loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
    assert loss_diff <= TOL and norm_diff <= TOL, (layout_args, loss_diff, norm_diff)
