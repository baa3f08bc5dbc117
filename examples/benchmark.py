"""Overhead of megatron_lossfix against stock Megatron-Core: step time and peak memory.

The same GPT model, data and parallel layout run one training step at a time under every
variant:

* ``stock``: Megatron's own ``get_forward_backward_func()`` called directly, no plugin, with
  Megatron-LM's loss function ``(sum(mask * l), mask.sum(), report)``;
* ``stock-repeat``: stock again, as a separate variant: its ratios show the noise floor;
* ``stock-per-token``: stock with ``calculate_per_token_loss=True``;
* ``off``, ``token_mean``, ``sequence_mean``, ``seq_mean_token_sum_norm``, ``sum``,
  ``token_mean_legacy``: each mode through ``LossFixSchedule`` (``off`` = the plugin disabled);
* ``token_mean-per-token``: the plugin with ``calculate_per_token_loss=True`` (its streaming path).

Two workloads: ``sft`` (per-token cross entropy) and ``rl`` (``rl_objective``: PPO-clip on
``logp = -CE`` with a k3 KL term against fixed reference log-probs). A step is zeroing the
grads, the forward-backward schedule (with DDP's grad all-reduce and ``finalize_model_grads``),
``optimizer.step()`` and the step's reported metrics (stock: Megatron-LM's all-reduce of the
``lm loss`` report; plugin: ``schedule.step_metrics()``). ``fwd-bwd`` is the schedule call alone.

Timing alternates the variants inside one process per world size: round-robin over variants
(rotating the order every round), a few steps each, several rounds; per round every variant's
median step time is divided by its baseline's median in the same round, so slow drift from other
work on a shared machine cancels. Reported: the median of those per-round ratios and their range.
Memory, two ways: the peak RSS of a fresh process per (world size, variant), both workloads in
turn (``_memory_phase``: everything a user sees, percent-level noise from glibc's heap), and the
exact peak of live tensor bytes allocated during one step (``_tensor_peak``, torch.profiler's
allocation records, in the timing process). A cProfile breakdown (``_overhead``) shows the
plugin's own work per step, which wall time on a loaded machine cannot resolve to 1%.
Everything is printed as markdown tables with the machine description.

Launch (CPU/gloo; the driver starts ``torchrun --standalone`` itself for each world size, then
a fresh one per variant for the peak RSS; about 25 minutes on 2 cores)::

    python examples/benchmark.py --ranks 1,2,4 --rounds 9 --steps-per-round 2 \
        --json-out /tmp/benchmark.json

One world size by hand (timing only, table printed by rank 0)::

    torchrun --standalone --nproc-per-node 2 examples/benchmark.py --phase time

On a machine with GPUs the workers use NCCL and peak memory is
``torch.cuda.max_memory_allocated``. The GPU runs in the README (one H100, steps over 100 ms)::

    python examples/benchmark.py --ranks 1 --num-layers 8 --hidden-size 1024 \
        --num-attention-heads 16 --seq-length 1024 --global-batch-size 8 --rounds 5 \
        --steps-per-round 2
    python examples/benchmark.py --ranks 1 --bf16 --num-layers 4 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 2048 --global-batch-size 8 --rounds 4 \
        --steps-per-round 2 --no-memory --variants \
        stock,stock-repeat,stock-per-token,off,token_mean,sequence_mean,sum,token_mean-per-token
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("sft", "rl")


@dataclass(frozen=True)
class Variant:
    """One way to run the step: stock Megatron (``mode is None``) or a plugin mode."""

    name: str
    mode: str | None
    per_token: bool

    @property
    def baseline(self) -> str:
        """The stock variant this one is compared with: same ``calculate_per_token_loss``,
        except the per-token stock itself, which is compared with plain stock."""
        if self.mode is None:
            return "stock"
        return "stock-per-token" if self.per_token else "stock"


VARIANTS = {
    v.name: v
    for v in (
        Variant("stock", None, False),
        # The same as stock, run as a separate variant: its ratios are the noise floor.
        Variant("stock-repeat", None, False),
        Variant("stock-per-token", None, True),
        Variant("off", "off", False),
        Variant("token_mean", "token_mean", False),
        Variant("sequence_mean", "sequence_mean", False),
        Variant("seq_mean_token_sum_norm", "seq_mean_token_sum_norm", False),
        Variant("sum", "sum", False),
        Variant("token_mean_legacy", "token_mean_legacy", False),
        Variant("token_mean-per-token", "token_mean", True),
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model and data (Megatron-LM flag names)")
    model.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    model.add_argument("--hidden-size", type=int, default=256, help="hidden size")
    model.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    model.add_argument("--seq-length", type=int, default=256, help="tokens per sequence")
    model.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    model.add_argument(
        "--global-batch-size",
        type=int,
        default=8,
        help="sequences per step (divisible by every world size x --micro-batch-size)",
    )
    model.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    model.add_argument("--seed", type=int, default=1234, help="seed of weights and data")
    model.add_argument(
        "--bf16",
        action="store_true",
        help="Megatron-LM's --bf16: bf16 weights and activations in Float16Module, fp32 main "
        "params, gradients and Adam state (default fp32)",
    )
    run = parser.add_argument_group("benchmark")
    run.add_argument(
        "--ranks", default="1,2,4", help="comma-separated world sizes (data-parallel ranks)"
    )
    run.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}"
    )
    run.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {tuple(VARIANTS)} (baselines are added as needed)",
    )
    run.add_argument("--rounds", type=int, default=5, help="round-robin rounds over the variants")
    run.add_argument(
        "--steps-per-round", type=int, default=3, help="timed steps per variant and round"
    )
    run.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per variant before the first round"
    )
    run.add_argument(
        "--memory-steps", type=int, default=3, help="steps per fresh memory-measuring process"
    )
    run.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory processes (timing only)"
    )
    run.add_argument("--json-out", default=None, help="also write all results as JSON here")
    run.add_argument(
        "--profile-dir",
        default=None,
        help="after timing, profile one step of each variant with torch.profiler and write "
        "the op tables there (rank 0)",
    )
    internal = parser.add_argument_group("internal (set by the driver for its torchrun workers)")
    internal.add_argument(
        "--phase",
        choices=("driver", "time", "memory"),
        default=None,
        help="driver: launch workers (default without torchrun); time: alternate variants in "
        "this process (default under torchrun); memory: one variant's peak memory",
    )
    internal.add_argument("--variant", default=None, help="memory phase: the variant")
    internal.add_argument("--result-out", default=None, help="worker: write JSON results here")
    args = parser.parse_args(argv)
    if args.phase is None:
        args.phase = "time" if "LOCAL_RANK" in os.environ else "driver"
    args.variant_list = _selected_variants(args.variants)
    args.workload_list = [w for w in args.workloads.split(",") if w]
    if set(args.workload_list) - set(WORKLOADS):
        parser.error(f"--workloads: choose from {WORKLOADS}")
    return args


def _selected_variants(spec: str) -> list[Variant]:
    names = [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {tuple(VARIANTS)}")
    chosen = {n: VARIANTS[n] for n in names}
    for v in list(chosen.values()):
        chosen.setdefault(v.baseline, VARIANTS[v.baseline])
    chosen.setdefault("stock", VARIANTS["stock"])
    return [v for n, v in VARIANTS.items() if n in chosen]  # canonical order


# ------------------------------------------------------------------------------ the workers


class Bench:
    """One rank's models, optimizers, data and step functions for every variant."""

    def __init__(self, args: argparse.Namespace, variants: list[Variant]) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_lossfix import LossFixConfig, LossFixSchedule
        from megatron_lossfix.datasets import ByteTokenizer, global_batch, load_records
        from megatron_lossfix.testing.tiny_gpt import (
            Layout,
            build_tiny_gpt,
            init_layout,
            set_deterministic_params,
        )

        self.args = args
        init_layout(Layout(), seed=args.seed)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        tokenizer = ByteTokenizer()
        # One model per calculate_per_token_loss setting: DDP fixes its gradient scaling
        # (1/D or 1) when it is built. Both start from the same weights.
        self.models: dict[bool, tuple[Any, Any]] = {}
        for per_token in sorted({v.per_token for v in variants}):
            chunks, _ = build_tiny_gpt(
                Layout(dp=self.dp),
                num_layers=args.num_layers,
                hidden=args.hidden_size,
                heads=args.num_attention_heads,
                vocab=tokenizer.padded_vocab_size(8),
                seq_len=args.seq_length,
                calculate_per_token_loss=per_token,
                bf16=args.bf16,
            )
            set_deterministic_params(chunks, args.seed)
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=args.lr, clip_grad=1.0, weight_decay=0.0, bf16=args.bf16
                ),
                chunks,
            )
            self.models[per_token] = (chunks[0], optimizer)
        self.schedules: dict[str, Any] = {}
        for v in variants:
            if v.mode is None:
                self.schedules[v.name] = get_forward_backward_func()
            else:
                norm = float(args.seq_length) if v.mode == "seq_mean_token_sum_norm" else None
                self.schedules[v.name] = LossFixSchedule(
                    LossFixConfig(reduction=v.mode, norm_constant=norm)
                )
        records = load_records(None)
        self.batches = []  # per step index: this rank's micro-batches
        for i in range(max(args.steps_per_round, args.memory_steps, args.warmup, 1)):
            batch = global_batch(
                records,
                i,
                global_batch_size=args.global_batch_size,
                seq_length=args.seq_length,
                seed=args.seed,
                tokenizer=tokenizer,
            )
            self.batches.append(self._microbatches(_add_rl_fields(batch, args.seed + i)))

    def _microbatches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        from megatron_lossfix.datasets import microbatches

        mbs = microbatches(
            batch,
            dp_rank=self.dp_rank,
            dp_size=self.dp,
            micro_batch_size=self.args.micro_batch_size,
        )
        if torch.cuda.is_available():
            mbs = [{k: t.cuda() for k, t in mb.items()} for mb in mbs]
        return mbs

    def step(self, variant: Variant, workload: str, index: int) -> dict[str, float]:
        """One training step; returns this rank's seconds: ``step_s`` (wall), ``fb_s`` (wall,
        the schedule call) and ``cpu_s`` (CPU time of the whole process, all threads)."""
        model, optimizer = self.models[variant.per_token]
        schedule = self.schedules[variant.name]
        forward_step = partial(_forward_step, variant.mode is not None, workload)
        mbs = self.batches[index % len(self.batches)]
        _sync()
        cpu_start = time.process_time()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        fb_start = time.perf_counter()
        reports = schedule(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=model,
            num_microbatches=len(mbs),
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=False,
        )
        _sync()
        fb = time.perf_counter() - fb_start
        optimizer.step()
        if variant.mode is None:
            _stock_metrics(reports, self.dp_group)
        else:
            schedule.step_metrics()
        _sync()
        wall = time.perf_counter() - start
        return {"step_s": wall, "fb_s": fb, "cpu_s": time.process_time() - cpu_start}


def _add_rl_fields(batch: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Fixed rollout data for the RL workload: per-sequence advantages and behaviour/reference
    log-probs near the untrained model's (about -log V), so ratios start close to 1."""
    gen = torch.Generator().manual_seed(seed)
    b, s = batch["tokens"].shape
    return {
        **batch,
        "advantages": torch.randn(b, generator=gen),
        "old_logprobs": -5.5 + 0.1 * torch.randn(b, s, generator=gen),
        "ref_logprobs": -5.5 + 0.1 * torch.randn(b, s, generator=gen),
    }


def _forward_step(plugin: bool, workload: str, data_iterator: Any, model: Any) -> tuple:
    """Megatron forward_step: GPTModel's per-token cross entropy, then the workload's loss.

    Stock: Megatron-LM's ``(sum(mask * l), mask.sum(), report)``; plugin: the weighted sum with
    the weights the plugin put into the micro-batch (Tinker semantics)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"]
    weights = batch["loss_weights"] if plugin else mask
    return output, partial(_loss_func, plugin, workload, batch, weights, mask)


def _loss_func(
    plugin: bool,
    workload: str,
    batch: dict[str, torch.Tensor],
    weights: torch.Tensor,
    mask: torch.Tensor,
    per_token_ce: torch.Tensor,
) -> tuple:
    from megatron_lossfix.losses import weighted_sum
    from megatron_lossfix.rl_losses import rl_objective

    report: dict[str, torch.Tensor] = {}
    if workload == "sft" and not plugin:
        loss = torch.sum(per_token_ce.float() * mask)  # Megatron-LM's pretrain_gpt loss_func
    elif workload == "sft":
        loss = weighted_sum(per_token_ce, weights)
    else:
        loss, report = rl_objective(
            -per_token_ce,
            batch["old_logprobs"],
            batch["advantages"],
            weights,
            mask,
            ref_logprobs=batch["ref_logprobs"],
            kl_coef=0.01,
        )
    num_tokens = (weights != 0).sum(dtype=torch.int) if plugin else mask.sum().to(torch.int)
    if not plugin:
        # Megatron-LM's report: [loss sum, tokens], all-reduced over DP after the step.
        report = {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}
    return loss, num_tokens, report


def _stock_metrics(reports: list, group: Any) -> float:
    """Megatron-LM's ``train_step`` loss reporting: sum the micro-batches' [loss, tokens] and
    all-reduce over DP x CP."""
    import torch.distributed as dist

    if not reports:
        return 0.0
    val = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
    dist.all_reduce(val, group=group)
    return float(val[0] / val[1].clamp(min=1))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _init_worker() -> None:
    import warnings

    import torch.distributed as dist

    from megatron_lossfix.cpu_compat import enable_cpu_megatron

    for message in (
        ".*(Apex|Transformer Engine).*not installed",
        "full scope is deprecated",
        ".*is deprecated. Please use `torch.distributed",
    ):
        warnings.filterwarnings("ignore", message=message)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    enable_cpu_megatron()
    # Ranks share the cores: more intra-op threads than cores per rank only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))


def _time_phase(args: argparse.Namespace) -> dict | None:
    """Alternate all variants in this process; rank 0 returns the per-round step times."""
    import torch.distributed as dist

    bench = Bench(args, args.variant_list)
    results: dict[str, Any] = {}
    for workload in args.workload_list:
        for v in args.variant_list:  # warm-up: lazy optimizer state, allocator, caches
            for i in range(args.warmup):
                bench.step(v, workload, i)
        rounds = []
        for r in range(args.rounds):
            order = args.variant_list[r % len(args.variant_list) :]
            order = order + args.variant_list[: r % len(args.variant_list)]
            per_variant = {}
            for v in order:
                dist.barrier()  # start every variant's block together on all ranks
                times = [bench.step(v, workload, i) for i in range(args.steps_per_round)]
                per_variant[v.name] = {key: [t[key] for t in times] for key in times[0]}
            rounds.append(per_variant)
        results[workload] = rounds
    overhead = {w: _overhead(bench, args, w) for w in args.workload_list}
    tensor_peak = {
        w: {v.name: _tensor_peak(bench, v, w) for v in args.variant_list}
        for w in args.workload_list
    }
    if args.profile_dir:
        _profile(bench, args)
    if dist.get_rank() != 0:
        return None
    return {"rounds": results, "overhead": overhead, "tensor_peak": tensor_peak}


def _tensor_peak(bench: Bench, variant: Variant, workload: str) -> float:
    """Peak bytes of live tensors allocated during one step (max over ranks).

    CPU: torch.profiler with ``profile_memory=True`` reports every allocation and free of
    torch's CPU allocator together with the allocator's running total of allocated bytes; the
    maximum of that total over the step, above its value before the step, is the step's tensor
    peak above what was live before it -- activations, gradients in flight, the plugin's
    weights and counts -- exact and independent of glibc's heap behaviour (unlike RSS, which
    also moves with fragmentation and mmap thresholds). The model, gradient buffers and Adam
    state exist before the step and are the same for every variant. CUDA:
    ``max_memory_allocated`` above the pre-step ``memory_allocated``, after
    ``reset_peak_memory_stats``.
    """
    import torch.distributed as dist
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    bench.step(variant, workload, 0)  # same state before the measured step for every variant
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        bench.step(variant, workload, 0)
        peak = float(torch.cuda.max_memory_allocated() - base)
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            bench.step(variant, workload, 0)
        allocs = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                allocs.append((event.start_time_ns, event.extra_fields))
        allocs.sort(key=lambda item: item[0])
        # The allocator's running total carries over from earlier profiling sessions (blocks
        # they allocated and that were freed while no profiler ran are never subtracted), so
        # the peak is taken above the total just before this step's first record.
        first = allocs[0][1] if allocs else None
        base = float(first.total_allocated - first.alloc_size) if first is not None else 0.0
        peak = max((float(f.total_allocated) for _, f in allocs), default=base) - base
    value = torch.tensor([peak], dtype=torch.float64)
    if torch.cuda.is_available():
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])


_SCHEDULE_FILE = "megatron_lossfix/schedule.py"
_INNER_SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


# Code whose collectives count as the plugin's (or, for stock, as its metrics').
_OWN_CODE = (
    "megatron_lossfix/schedule.py",
    "megatron_lossfix/reduction.py",
    "megatron_lossfix/metrics.py",
)


@contextlib.contextmanager
def _timed_collectives() -> Iterator[list[float]]:
    """Seconds spent in ``torch.distributed`` calls made directly by the plugin's own code or
    by the stock metrics, summed into the yielded one-element list.

    Only the immediate caller counts: Megatron's own collectives (DDP, finalize_model_grads)
    run inside the plugin's call too, deeper in the stack. The plugin calls them as
    ``dist.<op>``, so patching the module attributes sees them all.
    """
    import torch.distributed as dist

    total = [0.0]
    names = ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object")
    originals = {name: getattr(dist, name) for name in names}

    def wrap(fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code
            own = caller.co_filename.endswith(_OWN_CODE) or caller.co_name == "_stock_metrics"
            if not own:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start

        return timed

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield total
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _overhead(bench: Bench, args: argparse.Namespace, workload: str) -> dict:
    """The plugin's own work per step, from cProfile on rank 0 (ms per step).

    Wall-time ratios on a loaded machine scatter by several percent; this breakdown does not:
    ``prepass_ms``: the plugin's call minus Megatron's schedule inside it (pre-read,
    validation, counts, weights); ``wrappers_ms``: its forward-step and loss wrappers minus
    the user's functions, and its micro-batch iterator; ``metrics_ms``: ``step_metrics()``
    (stock: Megatron-LM's loss all-reduce); ``collectives_ms``: time inside torch.distributed
    calls made by that code (plugin or stock metrics), mostly waiting for the slowest peer,
    which stock spends at its gradient all-reduce instead. cProfile slows Python code, so the
    shares are upper bounds, taken relative to the profiled step.
    """
    import cProfile
    import pstats

    import torch.distributed as dist

    steps = max(2, args.steps_per_round)
    out: dict[str, dict[str, float]] = {}
    for v in args.variant_list:
        prof = cProfile.Profile() if dist.get_rank() == 0 else None
        wall = 0.0
        with _timed_collectives() as collectives:
            for i in range(steps):
                dist.barrier()
                if prof is not None:
                    prof.enable()
                wall += bench.step(v, workload, i)["step_s"]
                if prof is not None:
                    prof.disable()
        if prof is None:
            continue
        cum: dict[str, float] = {}
        for (path, _, func), (_, _, _, ct, _) in pstats.Stats(prof).stats.items():
            where = "plugin" if path.endswith(_SCHEDULE_FILE) else Path(path).name
            cum[f"{where}:{func}"] = cum.get(f"{where}:{func}", 0.0) + ct
        inner = sum(cum.get(f"schedules.py:{name}", 0.0) for name in _INNER_SCHEDULES)
        plugin = v.mode is not None
        parts = {
            "step_ms": wall,
            "prepass_ms": cum.get("plugin:__call__", 0.0) - inner if plugin else 0.0,
            "wrappers_ms": (
                cum.get("plugin:forward_step", 0.0)
                - cum.get("benchmark.py:_forward_step", 0.0)
                + cum.get("plugin:loss", 0.0)
                - cum.get("benchmark.py:_loss_func", 0.0)
                + cum.get("plugin:__next__", 0.0)
            )
            if plugin
            else 0.0,
            "metrics_ms": cum.get("plugin:step_metrics", 0.0)
            + cum.get("benchmark.py:_stock_metrics", 0.0),
            "collectives_ms": collectives[0],
        }
        out[v.name] = {k: 1000 * x / steps for k, x in parts.items()}
    return out


def _profile(bench: Bench, args: argparse.Namespace) -> None:
    """One profiled step per (workload, variant): torch.profiler op tables on rank 0."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    out = Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    for workload in args.workload_list:
        for v in args.variant_list:
            bench.step(v, workload, 0)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                bench.step(v, workload, 0)
            if dist.get_rank() == 0:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
                name = f"w{dist.get_world_size()}-{workload}-{v.name}.txt"
                (out / name).write_text(table)


def _memory_phase(args: argparse.Namespace) -> dict | None:
    """Peak memory of a whole training process for one variant (max over ranks).

    CPU: ``ru_maxrss``, the kernel's resident-set high-water mark of this process (KiB on
    Linux): imports, model, optimizer state and the steps, everything a user would see. It
    only ever rises, hence a fresh process per variant; both workloads run in it, one after
    the other (1 + ``--memory-steps`` steps each), so the number is per variant. RSS also moves
    with glibc's heap behaviour (fragmentation, mmap thresholds), which makes it a coarse,
    percent-level measure; the exact per-step tensor peak comes from ``_tensor_peak``.
    CUDA: ``torch.cuda.max_memory_allocated``.
    """
    import torch.distributed as dist

    variant = VARIANTS[args.variant]
    bench = Bench(args, [variant])
    for workload in args.workload_list:
        for i in range(1 + args.memory_steps):
            bench.step(variant, workload, i)
    _sync()
    if torch.cuda.is_available():
        peak = torch.tensor([float(torch.cuda.max_memory_allocated())], device="cuda")
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = torch.tensor([float(rss)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return None
    return {workload: {"peak_bytes": float(peak[0])} for workload in args.workload_list}


def worker_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    _init_worker()
    if args.phase == "time":
        result = _time_phase(args)
    else:
        result = _memory_phase(args)
    if dist.get_rank() == 0:
        payload = {"world": dist.get_world_size(), "result": result, "load": os.getloadavg()}
        if args.result_out:
            Path(args.result_out).write_text(json.dumps(payload))
        elif args.phase == "time":
            print(_time_table(args, {dist.get_world_size(): result}, {}), flush=True)
        else:
            print(json.dumps(payload), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the driver


def _torchrun(world: int, argv: list[str], result: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", str(Path(__file__).resolve()),
        *argv, "--result-out", str(result),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    # Idle OpenMP threads sleep instead of spinning, so that the CPU-time column counts work,
    # not spin-waiting, which grows with the load from other processes on a shared machine.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-5000:]}"
        )
    return json.loads(result.read_text())


def _model_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size), "--lr", str(args.lr),
        "--seed", str(args.seed), "--workloads", ",".join(args.workload_list),
        *(["--bf16"] if args.bf16 else []),
        "--variants", ",".join(v.name for v in args.variant_list),
        "--rounds", str(args.rounds), "--steps-per-round", str(args.steps_per_round),
        "--warmup", str(args.warmup), "--memory-steps", str(args.memory_steps),
    ]  # fmt: skip


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    from importlib.metadata import version

    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        device = "no GPU, CPU/gloo"
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}; {device}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, megatron-core {version('megatron-core')}; "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )


def _ratios(rounds: list[dict], name: str, base: str, key: str) -> list[float]:
    """Per round: median step time of ``name`` over that of ``base``."""
    return [
        statistics.median(r[name][key]) / statistics.median(r[base][key])
        for r in rounds
        if name in r and base in r
    ]


def _fmt_ratio(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _time_table(args: argparse.Namespace, timing: dict, memory: dict) -> str:
    lines = []
    # What the fresh memory processes measure (see _memory_phase).
    peak_name = "GPU memory" if torch.cuda.is_available() else "RSS"
    for world, result in sorted(timing.items()):
        for workload, rounds in result["rounds"].items():
            lines += [
                "",
                f"### {workload.upper()}, {world} rank(s) (DP={world}), "
                f"{args.global_batch_size // (world * args.micro_batch_size)} micro-batches "
                f"per rank",
                "",
                "| variant | vs | step ms (median) | step time ratio | fwd-bwd time ratio "
                f"| step CPU-time ratio | peak {peak_name} ratio | step tensor peak ratio "
                "| step time vs off | step tensor peak vs off |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for v in args.variant_list:
                if v.name not in rounds[0]:
                    continue
                base = "stock" if v.name == "stock" else v.baseline
                all_steps = [t for r in rounds for t in r[v.name]["step_s"]]
                mem = memory.get((world, workload, v.name))
                mem_base = memory.get((world, workload, base))
                peak_s = tensor_s = "-"
                if mem and mem_base:
                    peak = mem["peak_bytes"] / mem_base["peak_bytes"]
                    peak_s = f"{peak:.3f} ({mem['peak_bytes'] / 2**20:.0f} MiB)"
                tensor = result.get("tensor_peak", {}).get(workload, {})
                if v.name in tensor and base in tensor:
                    ratio = tensor[v.name] / max(tensor[base], 1.0)
                    tensor_s = f"{ratio:.4f} ({tensor[v.name] / 2**20:.2f} MiB)"
                vs_off = tensor_off = "-"
                if v.mode is not None and not v.per_token and "off" in rounds[0]:
                    vs_off = _fmt_ratio(_ratios(rounds, v.name, "off", "step_s"))
                    if v.name in tensor and "off" in tensor:
                        tensor_off = f"{tensor[v.name] / max(tensor['off'], 1.0):.4f}"
                lines.append(
                    f"| {v.name} | {base} | {1000 * statistics.median(all_steps):.0f} "
                    f"| {_fmt_ratio(_ratios(rounds, v.name, base, 'step_s'))} "
                    f"| {_fmt_ratio(_ratios(rounds, v.name, base, 'fb_s'))} "
                    f"| {_fmt_ratio(_ratios(rounds, v.name, base, 'cpu_s'))} "
                    f"| {peak_s} | {tensor_s} | {vs_off} | {tensor_off} |"
                )
            lines += _overhead_table(args, result.get("overhead", {}).get(workload, {}))
    return "\n".join(lines)


def _overhead_table(args: argparse.Namespace, overhead: dict) -> list[str]:
    """The cProfile breakdown of ``_overhead`` for the plugin variants (ms per step)."""
    rows = [v for v in args.variant_list if v.mode is not None and v.name in overhead]
    if not rows:
        return []
    lines = [
        "",
        "Plugin work per step (cProfile, rank 0, ms): compute = pre-pass + wrappers + metrics, "
        "without time inside collectives, minus stock's metrics compute; collectives = time in "
        "the plugin's all-reduces (pre-pass and metrics) minus stock's metrics all-reduce, "
        "mostly waiting for the slowest rank.",
        "",
        "| variant | pre-pass | wrappers | metrics | extra compute | share of step "
        "| extra collective time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in rows:
        o, base = overhead[v.name], overhead.get(v.baseline)
        if base is None:
            continue
        base_compute = base["metrics_ms"] - base["collectives_ms"]
        compute = o["prepass_ms"] + o["wrappers_ms"] + o["metrics_ms"] - o["collectives_ms"]
        extra = compute - base_compute
        lines.append(
            f"| {v.name} | {o['prepass_ms']:.2f} | {o['wrappers_ms']:.2f} "
            f"| {o['metrics_ms']:.2f} | {extra:.2f} | {extra / o['step_ms']:.2%} "
            f"| {o['collectives_ms'] - base['collectives_ms']:.2f} |"
        )
    return lines


def driver_main(args: argparse.Namespace) -> None:
    worlds = [int(w) for w in args.ranks.split(",") if w]
    for world in worlds:
        if args.global_batch_size % (world * args.micro_batch_size):
            raise SystemExit(
                f"--global-batch-size {args.global_batch_size} is not divisible by world size "
                f"{world} x --micro-batch-size {args.micro_batch_size}"
            )
    machine = _machine()
    print(f"Machine: {machine}", flush=True)
    base_argv = _model_argv(args)
    timing, memory, loads = {}, {}, []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="lossfix-bench-") as tmp:
        for world in worlds:
            t0 = time.time()
            argv = [*base_argv, "--phase", "time"]
            if args.profile_dir:
                argv += ["--profile-dir", args.profile_dir]
            out = _torchrun(world, argv, Path(tmp) / f"time-{world}.json")
            timing[world] = out["result"]
            loads.append(out["load"][0])
            print(f"timing, {world} rank(s): {time.time() - t0:.0f} s", flush=True)
            if args.no_memory:
                continue
            t0 = time.time()
            for v in args.variant_list:
                argv = [*base_argv, "--phase", "memory", "--variant", v.name]
                path = Path(tmp) / f"mem-{world}-{v.name}.json"
                for workload, mem in _torchrun(world, argv, path)["result"].items():
                    memory[(world, workload, v.name)] = mem
            print(f"memory, {world} rank(s): {time.time() - t0:.0f} s", flush=True)
    report = [
        "",
        "## megatron_lossfix overhead vs stock Megatron-Core",
        "",
        f"Machine: {machine}; load average at end {os.getloadavg()[0]:.2f} "
        f"(in the timing workers: {', '.join(f'{x:.2f}' for x in loads)}).",
        f"Model: GPT, {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_attention_heads} heads, seq {args.seq_length}, "
        f"{'bf16' if args.bf16 else 'fp32'}, global batch "
        f"{args.global_batch_size}, micro-batch {args.micro_batch_size}; Adam, clip 1.0.",
        f"Timing: {args.rounds} rounds x {args.steps_per_round} steps per variant, round-robin "
        f"(order rotated each round), after {args.warmup} warm-up steps; ratio = per-round "
        f"median step time / baseline's in the same round; CPU time = the process's, all threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}). Peak RSS: a fresh "
        f"process per variant running both workloads, 1 + {args.memory_steps} steps each, max "
        f"over ranks. Step tensor peak: bytes of live tensors allocated during one step "
        f"(torch.profiler allocation records), max over ranks.",
        f"Total wall time {time.time() - started:.0f} s.",
        _time_table(args, timing, memory),
    ]
    print("\n".join(report), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "machine": machine,
                    "args": {k: v for k, v in vars(args).items() if k != "variant_list"},
                    "timing": timing,
                    "memory": {"/".join(map(str, k)): v for k, v in memory.items()},
                },
                indent=1,
            )
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.phase == "driver":
        driver_main(args)
    else:
        worker_main(args)


if __name__ == "__main__":
    main()
