"""GPU-only checks (skipped without CUDA): NCCL, and context parallelism with Transformer
Engine's real attention instead of the CPU suite's attention-free layers.

These run on a GPU machine with the same command as the rest of the suite; CI has no GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_examples import COMMON, TOL, max_rel_diff, run_example

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus_and_te = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or importlib.util.find_spec("transformer_engine") is None,
    reason="needs 2 GPUs and Transformer Engine",
)


@needs_cuda
def test_nccl_microbatch_split_is_invariant(tmp_path):
    """One GPU, NCCL: one micro-batch versus six."""
    one = run_example("pretrain_gpt.py", 1, tmp_path / "one.jsonl", *COMMON,
                      "--micro-batch-size", "12")  # fmt: skip
    six = run_example("pretrain_gpt.py", 1, tmp_path / "six.jsonl", *COMMON,
                      "--micro-batch-size", "2")  # fmt: skip
    assert max_rel_diff(one, six, "loss") <= TOL
    assert max_rel_diff(one, six, "grad_norm") <= TOL


@needs_two_gpus_and_te
def test_context_parallel_with_transformer_engine_attention(tmp_path):
    te = ["--transformer-impl", "transformer_engine"]
    one = run_example("pretrain_gpt.py", 1, tmp_path / "one.jsonl", *COMMON, *te,
                      "--micro-batch-size", "12")  # fmt: skip
    cp2 = run_example("pretrain_gpt.py", 2, tmp_path / "cp2.jsonl", *COMMON, *te,
                      "--micro-batch-size", "2", "--context-parallel-size", "2")  # fmt: skip
    # TE's attention kernels are not bitwise identical across sequence splits.
    assert max_rel_diff(one, cp2, "loss") <= 1e-4
    assert max_rel_diff(one, cp2, "grad_norm") <= 1e-4
