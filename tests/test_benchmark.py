"""``examples/benchmark.py`` runs as docs/benchmarks.md launches it, on a tiny model: its default
variants (every one, ``off`` included) and workloads time one round each on one rank and print a
row each (``--no-memory``: a fresh process per variant would take minutes). The timings depend
on the machine; docs/benchmarks.md states them, this only keeps the commands working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ("--ranks", "1", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "32", "--global-batch-size", "4", "--rounds", "1",
        "--steps-per-round", "1", "--warmup", "0")  # fmt: skip


def _benchmark(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "benchmark.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "benchmark.py"), *TINY, *flags,
         "--json-out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {"stdout": done.stdout, **json.loads(out.read_text())}


@pytest.mark.e2e
def test_default_variants_run_on_a_tiny_model(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from benchmark import WORKLOADS
        from benchmark_step import VARIANTS
    finally:
        sys.path.remove(str(ROOT / "examples"))
    result = _benchmark(tmp_path, "--no-memory")
    rounds = result["timing"]["1"]["rounds"]
    assert sorted(rounds) == sorted(WORKLOADS)
    for workload in WORKLOADS:
        assert sorted(rounds[workload][0]) == sorted(VARIANTS), workload
    for name in VARIANTS:  # a row per variant and workload
        rows = [line for line in result["stdout"].splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == len(WORKLOADS), (name, result["stdout"][-3000:])
