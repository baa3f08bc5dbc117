"""Overhead of megatron_lossfix against stock Megatron-Core: step time and peak memory.

The same GPT, data and data-parallel layout train under each variant: ``stock`` (Megatron's
``get_forward_backward_func()``, no plugin, Megatron-LM's loss ``(sum(mask * l), mask.sum(),
report)`` and its all-reduce of the report), ``stock-repeat`` (stock again: the noise floor),
``stock-per-token`` (``calculate_per_token_loss=True``), ``off`` and every mode through
``LossFixSchedule`` (``self_check=False``: plain steps), ``token_mean-per-token``,
``token_mean-first-step`` (each step checked as the first step is by default, against plain
``token_mean`` steps), and masks decided in the loss (``token_mean+zeroed``,
``token_mean+kept``, ``sequence_mean+kept``, ``token_mean+counting``: a filter on the loss, or
an importance-ratio band and off-policy sequence masking; compared with ``token_mean`` without
masks; ``benchmark_step.KEPT``). Workloads: ``sft`` (``weighted_loss`` of the
per-token cross entropy) and ``rl`` (``megatron_lossfix.rl.objective.rl_loss`` on the logits:
PPO-clip and a k3 KL term against fixed rollout log-probs). A step: zero the grads, the schedule
(``fwd-bwd``: with DDP's all-reduce and ``finalize_model_grads``), ``optimizer.step()`` and the
step's metrics (stock: Megatron-LM's all-reduce of ``lm loss``; plugin: ``step_metrics()``).

Timing alternates the variants in one process per world size, round-robin (order rotated each
round), a few steps each. Per round each variant's median step time is divided by its
baseline's median of the same round, so drift from other work on the machine cancels; tables
give the median of these ratios and their range; the CPU-time ratio (this process's CPU seconds
per step, rank 0) moves less than wall time when other work shares the CPU. Memory: the step's
tensor peak above what was allocated before it (GPU: ``max_memory_allocated``; CPU: the
allocator's running total in torch.profiler's allocation records) and, unless ``--no-memory``,
the peak of a fresh process per variant running both workloads (GPU: ``max_memory_allocated``;
CPU: ``ru_maxrss``).

Launch (CPU/gloo; the driver starts ``torchrun --standalone`` per world size, then one per
variant for the fresh-process peak)::

    python examples/benchmark.py --ranks 1,2,4 --rounds 9 --steps-per-round 2 \\
        --json-out out/benchmark.json

One world size by hand (timing only, rank 0 prints the tables)::

    torchrun --standalone --nproc-per-node 2 examples/benchmark.py --phase time

The first step's self-check (``token_mean-first-step``: every step checked as the first one is,
against plain ``token_mean`` steps, the check off) on a model whose gradients dominate memory,
38 M parameters on 2 data-parallel ranks, micro-batch 2 (the check's re-split cuts it in two)::

    python examples/benchmark.py --ranks 2 --workloads sft --variants token_mean-first-step \\
        --num-layers 3 --hidden-size 1024 --num-attention-heads 8 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 8 --rounds 3 --steps-per-round 1 \\
        --warmup 1 --memory-steps 1

On GPUs the workers use NCCL. The GPU runs of docs/benchmarks.md (one H100, steps over 100 ms)::

    python examples/benchmark.py --ranks 1 --num-layers 8 --hidden-size 1024 \\
        --num-attention-heads 16 --seq-length 1024 --global-batch-size 8 --rounds 5 \\
        --steps-per-round 2
    python examples/benchmark.py --ranks 1 --bf16 --num-layers 4 --hidden-size 2048 \\
        --num-attention-heads 16 --seq-length 2048 --global-batch-size 8 --rounds 4 \\
        --steps-per-round 2 --no-memory --variants \\
        stock,stock-repeat,stock-per-token,off,token_mean,sequence_mean,sum,token_mean-per-token
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from benchmark_report import parameters, tables
from benchmark_step import CUDA, VARIANTS, Bench, baseline, max_over_ranks, start, sync
from gpt_model import add_model_args

from megatron_lossfix.args import non_negative_float, non_negative_int, positive_int

WORKLOADS = ("sft", "rl")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add, pos = p.add_argument, positive_int
    add("--num-layers", type=pos, default=4, help="transformer layers")
    add("--hidden-size", type=pos, default=256, help="hidden size")
    add("--num-attention-heads", type=pos, default=4, help="attention heads")
    add("--seq-length", type=pos, default=256, help="tokens per sequence")
    add("--micro-batch-size", type=pos, default=1, help="sequences per micro-batch")
    add("--global-batch-size", type=pos, default=8, help="sequences per step")
    add("--lr", type=non_negative_float, default=1e-4, help="Adam learning rate")
    add("--seed", type=non_negative_int, default=1234, help="seed of weights and data")
    add("--bf16", action="store_true", help="Megatron-LM's --bf16 (default fp32)")
    add("--num-experts", type=pos, default=None, help="MoE experts per layer (default: dense)")
    add("--ranks", default="1,2,4", help="comma-separated world sizes (data-parallel ranks)")
    add("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}")
    every = ", ".join(VARIANTS)
    add("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {every}")
    add("--rounds", type=pos, default=5, help="round-robin rounds over the variants")
    add("--steps-per-round", type=pos, default=3, help="timed steps per variant and round")
    add("--warmup", type=non_negative_int, default=2, help="untimed steps a variant, before rounds")
    add("--memory-steps", type=pos, default=3, help="steps per workload in a memory process")
    add("--no-memory", action="store_true", help="skip the fresh-process peak memory runs")
    add("--json-out", default=None, help="also write all results as JSON to this file")
    phases = ("driver", "time", "memory")  # driver: without torchrun; time: under it
    add("--phase", choices=phases, help="internal: what this process does (default: driver)")
    add("--variant", default=None, help="internal: the memory phase's variant")
    add("--result-out", default=None, help="internal: where a worker writes its JSON result")
    args = p.parse_args(argv)
    # build_model reads more model flags than these: the others at their defaults.
    model = argparse.ArgumentParser()
    add_model_args(model)
    args = argparse.Namespace(**{**vars(model.parse_args([])), **vars(args)})
    args.phase = args.phase or ("time" if "LOCAL_RANK" in os.environ else "driver")
    names = [n for n in args.variants.split(",") if n]
    if set(names) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(names) - set(VARIANTS))}; from {list(VARIANTS)}")
    wanted = {"stock", *names, *map(baseline, names)}
    args.variant_list = [n for n in VARIANTS if n in wanted]  # canonical order, baselines added
    args.workload_list = [w for w in args.workloads.split(",") if w]
    if set(args.workload_list) - set(WORKLOADS):
        p.error(f"--workloads: choose from {WORKLOADS}")
    return args


def _time_phase(args: argparse.Namespace) -> dict:
    bench, rounds, names = Bench(args, args.variant_list), {}, args.variant_list
    for workload in args.workload_list:
        for name in names:  # warm-up: lazy optimizer state, allocator, caches
            for i in range(args.warmup):
                bench.step(name, workload, i)
        rounds[workload] = []
        for r in range(args.rounds):
            per_variant = {}
            for name in names[r % len(names) :] + names[: r % len(names)]:
                dist.barrier()  # every variant's block starts together on all ranks
                times = [bench.step(name, workload, i) for i in range(args.steps_per_round)]
                per_variant[name] = {key: [t[key] for t in times] for key in times[0]}
            rounds[workload].append(per_variant)
    peaks = {w: {n: bench.tensor_peak(n, w) for n in names} for w in rounds}
    chunks = next(iter(bench.models.values()))[0]  # this rank's model
    params = sum(p.numel() for c in chunks for p in c.parameters())
    return {"rounds": rounds, "tensor_peak": peaks, "parameters": params}


def _memory_phase(args: argparse.Namespace) -> dict:
    """Peak memory of a whole fresh process running one variant (max over ranks)."""
    bench = Bench(args, [args.variant])
    for workload in args.workload_list:
        for i in range(1 + args.memory_steps):
            bench.step(args.variant, workload, i)
    sync()
    # ru_maxrss (KiB on Linux) only ever rises: hence a fresh process per variant.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak": max_over_ranks(torch.cuda.max_memory_allocated() if CUDA else rss)}


def _torchrun(world: int, argv: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", __file__, *argv, "--result-out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    from importlib.metadata import version

    worlds = [int(w) for w in args.ranks.split(",") if w]
    for world in worlds:
        if args.global_batch_size % (world * args.micro_batch_size):
            sys.exit(f"--global-batch-size {args.global_batch_size} is not divisible by "
                     f"{world} ranks x --micro-batch-size {args.micro_batch_size}")  # fmt: skip
    device = torch.cuda.get_device_name(0) + ", NCCL" if CUDA else "CPU/gloo"
    machine = (f"{os.cpu_count()} cores, {device}; torch {torch.__version__}, megatron-core "
               f"{version('megatron-core')}; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"Machine: {machine}", flush=True)
    timing, memory, started = {}, {}, time.time()
    with tempfile.TemporaryDirectory(prefix="lossfix-bench-") as tmp:
        for world in worlds:
            timing[world] = _torchrun(world, [*argv, "--phase", "time"], Path(tmp) / "t.json")
            print(f"timing, {world} rank(s): done after {time.time() - started:.0f} s", flush=True)
            for name in [] if args.no_memory else args.variant_list:
                argv_mem = [*argv, "--phase", "memory", "--variant", name]
                memory[f"{world}/{name}"] = _torchrun(world, argv_mem, Path(tmp) / "m.json")
    print(f"\n## megatron_lossfix overhead vs stock Megatron-Core\n\nMachine: {machine}; load "
          f"at end {os.getloadavg()[0]:.2f}; total {time.time() - started:.0f} s. Model: GPT, "
          f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
          f"heads, {parameters(timing) / 1e6:.1f} M parameters, seq {args.seq_length}, "
          f"{'bf16' if args.bf16 else 'fp32'}, global batch "
          f"{args.global_batch_size}, micro-batch {args.micro_batch_size}, Adam. {args.rounds} "
          f"rounds x {args.steps_per_round} steps per variant after {args.warmup} warm-up steps; "
          "ratio: median over rounds of the per-round ratio of median step times (range).\n"
          + tables(args, timing, memory), flush=True)  # fmt: skip
    if args.json_out:
        result = {"machine": machine, "argv": argv, "timing": timing, "memory": memory}
        Path(args.json_out).write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.phase == "driver":
        return driver(args, argv)
    start()
    result = _time_phase(args) if args.phase == "time" else _memory_phase(args)
    if dist.get_rank() == 0 and args.result_out:
        Path(args.result_out).write_text(json.dumps(result))
    elif dist.get_rank() == 0 and args.phase == "time":
        print(tables(args, {dist.get_world_size(): result}, {}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
