"""Benchmark the fused log-prob + entropy kernel against the naive full-vocabulary path.

Measures, for forward + backward of ``logprobs`` and ``entropy`` over ``[tokens, vocab]`` logits,
the peak memory used beyond the logits tensor and its gradient (reported as a fraction of the
logits tensor's size) and the wall time, for
``megatron_lossfix.rl.logprobs.vocab_parallel_logprobs_entropy`` (chunked, one autograd.Function)
and ``naive_logprobs_entropy`` (``log_softmax`` + gather + ``-(p * logp).sum()``). Prints a
markdown table.

Launch (CPU, fp32, about 2 minutes on 2 cores)::

    python examples/benchmark_logprobs.py --device cpu --tokens 2048 --vocabs 32768,131072,151936

On a GPU (docs/benchmarks.md's figures, one H100)::

    python examples/benchmark_logprobs.py --device cuda --dtype bfloat16 --tokens 8192 --iters 10
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from megatron_lossfix.rl.logprobs import naive_logprobs_entropy, vocab_parallel_logprobs_entropy

IMPLS = ("kernel", "naive")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    ap.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="logits dtype"
    )
    ap.add_argument("--tokens", type=int, default=2048, help="number of tokens (rows of logits)")
    ap.add_argument(
        "--vocabs",
        default="32768,131072,151936",
        help="comma-separated vocabulary sizes (32k, 128k, Qwen's 152k by default)",
    )
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="kernel tokens per chunk (default: the kernel's own, 16 MiB of fp32 per chunk); "
        "extra memory is about chunk_size/tokens of the logits",
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed iterations per implementation (alternating); the fastest is reported",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU intra-op threads (0: torch's default). On a machine shared with other jobs use "
        "1: with oversubscribed cores every multi-threaded op waits for a descheduled thread, "
        "which punishes the many mid-sized ops of the chunked kernel far more than naive's few "
        "huge ones and measures the neighbours, not the code",
    )
    ap.add_argument("--seed", type=int, default=0, help="random seed for logits and targets")
    ap.add_argument(
        "--worker",
        default=None,
        help="internal: run one CPU subprocess job, 'IMPL:VOCAB' (memory) or 'time:VOCAB', "
        "and print its result as JSON",
    )
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return args


def _run_once(impl: str, logits: torch.Tensor, target: torch.Tensor, chunk: int) -> None:
    if impl == "kernel":
        logp, ent = vocab_parallel_logprobs_entropy(logits, target, chunk_size=chunk)
    else:
        logp, ent = naive_logprobs_entropy(logits, target)
    # Both outputs get a gradient, as in an RL loss with an entropy term.
    torch.autograd.backward([logp, ent], [torch.ones_like(logp), torch.full_like(ent, 0.01)])


def _reset_rss_peak() -> int:
    """Reset the RSS high-water mark where Linux allows it; return the baseline in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # no reset: the fresh subprocess's mark is then close to its current RSS anyway
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_inputs(args: argparse.Namespace, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = torch.device(args.device)
    # Drawn where they are used: a CPU draw of GBs of logits would dominate a GPU run.
    gen = torch.Generator(device).manual_seed(args.seed)
    logits = torch.randn(args.tokens, vocab, generator=gen, device=device).mul_(2.0)
    logits = logits.to(getattr(torch, args.dtype)).requires_grad_(True)
    target = torch.randint(0, vocab, (args.tokens,), generator=gen, device=device)
    # Warm up on a tiny problem so one-time allocations (thread pools, kernels, autograd engine)
    # land in the baseline instead of being charged to the first big call.
    small = torch.randn(8, 64, device=device, dtype=logits.dtype, requires_grad=True)
    for impl in IMPLS:
        _run_once(impl, small, torch.zeros(8, dtype=torch.long, device=device), args.chunk_size)
    _sync(device)
    return logits, target


def _measure_memory(args: argparse.Namespace, impl: str, vocab: int) -> float:
    """Peak memory of one forward+backward beyond logits and their gradient, / logits bytes."""
    logits, target = _make_inputs(args, vocab)
    logits_bytes = logits.numel() * logits.element_size()
    if logits.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(logits.device)
        base = torch.cuda.memory_allocated(logits.device)
        _run_once(impl, logits, target, args.chunk_size)
        _sync(logits.device)
        peak = torch.cuda.max_memory_allocated(logits.device) - base
    else:
        # CPU: glibc serves these large buffers with mmap and unmaps them on free, so the
        # process's resident-set high-water mark (ru_maxrss, KiB on Linux) is an exact peak of
        # what the call touched. The mark only ever rises, hence a fresh subprocess per
        # measurement, and we reset it to the current RSS right before the call (Linux
        # clear_refs "5") so earlier transient buffers cannot hide the call's own peak.
        # torch.profiler's memory view was not used: it lists allocations per op, not the
        # concurrent peak of one forward+backward.
        base = _reset_rss_peak()
        _run_once(impl, logits, target, args.chunk_size)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    # The gradient is one more logits-sized tensor, needed by any implementation.
    return (peak - logits_bytes) / logits_bytes


def _measure_time(args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """Best-of-N seconds per implementation, alternating them so that load from other work on
    a shared machine hits both alike (other work only ever adds time, hence the minimum)."""
    logits, target = _make_inputs(args, vocab)
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for _ in range(args.iters):
        for impl in IMPLS:
            logits.grad = None
            _sync(logits.device)
            t0 = time.perf_counter()
            _run_once(impl, logits, target, args.chunk_size)
            _sync(logits.device)
            times[impl].append(time.perf_counter() - t0)
    return {impl: min(ts) for impl, ts in times.items()}


def _in_subprocess(argv: list[str], job: str) -> object:
    cmd = [sys.executable, __file__, *argv, "--worker", job]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    if args.worker:
        job, vocab = args.worker.rsplit(":", 1)
        if job == "time":
            print(json.dumps(_measure_time(args, int(vocab))))
        else:
            print(json.dumps(_measure_memory(args, job, int(vocab))))
        return

    vocabs = [int(v) for v in args.vocabs.split(",")]
    print(
        f"device={args.device} dtype={args.dtype} tokens={args.tokens} "
        f"chunk_size={args.chunk_size} iters={args.iters} threads={torch.get_num_threads()}\n"
    )
    print(
        "| vocab | logits MiB | kernel extra | naive extra | kernel fwd+bwd s | naive fwd+bwd s |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for vocab in vocabs:
        if args.device == "cpu":
            extra = {impl: _in_subprocess(argv, f"{impl}:{vocab}") for impl in IMPLS}
            secs = _in_subprocess(argv, f"time:{vocab}")
        else:
            extra = {impl: _measure_memory(args, impl, vocab) for impl in IMPLS}
            torch.cuda.empty_cache()
            secs = _measure_time(args, vocab)
            torch.cuda.empty_cache()
        elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
        mib = args.tokens * vocab * elem / 2**20
        print(
            f"| {vocab} | {mib:.0f} | {extra['kernel']:.1%} | {extra['naive']:.1%} "
            f"| {secs['kernel']:.3f} | {secs['naive']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
