"""Where a plugin step's time goes, part by part, against stock Megatron-Core.

The model, data, flags and variants of ``benchmark.py``. A step's phases: ``zero`` (zeroing the
gradients), ``before`` (the plugin's work before Megatron's schedule: reading, agreement,
weights), ``loop`` (the schedule: the micro-batch loop), ``after`` (the plugin's work after it),
``optimizer``, ``metrics`` (stock: Megatron-LM's all-reduce of ``lm loss``; plugin:
``step_metrics()``). Per variant and phase: host ms per step (median of ``--steps-per-round``
steps, nothing counted then); in one more step, counted: host syncs by kind and line
(``.item()``, ``.tolist()``, ``bool()``/``float()``/``int()`` of a tensor, ``nonzero``,
``.cpu()``, and ``torch.tensor``/``torch.as_tensor``: on a GPU a copy from the host that waits
for the stream), collectives (count, bytes), kernels (aten ops other than views: a launch each
on a GPU). Last, alone in the process: the plugin's own Python per micro-batch.

Launch (CPU/gloo, or NCCL on GPUs); rank 0 prints::

    torchrun --standalone --nproc-per-node 2 examples/step_cost.py --global-batch-size 16 \\
        --variants token_mean,sequence_mean --workloads sft,rl --steps-per-round 20
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from benchmark import parse_args
from benchmark_step import Bench, start, sync
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_lossfix.step.megatron_compat as megatron_compat

PHASES = ("zero", "before", "loop", "after", "optimizer", "metrics")
SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero",
         "equal", "cpu", "tensor", "as_tensor")  # fmt: skip
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
               "reduce_scatter_tensor", "all_gather_object", "broadcast_object_list")  # fmt: skip
HERE = str(Path(__file__).resolve().parent.parent)


class Probe:
    """The phase the step is in, the time spent in each, and (while counting) what happened."""

    def __init__(self) -> None:
        self.phase, self.t, self.counting = "zero", 0.0, False
        self.times, self.step_times = collections.defaultdict(list), collections.Counter()
        self.counts, self.where = collections.Counter(), collections.defaultdict(dict)

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        self.step_times[self.phase] += now - self.t
        self.phase, self.t = phase, now

    def run_step(self, bench: Bench, name: str, workload: str, index: int) -> None:
        self.step_times.clear()
        self.phase, self.t = "zero", time.perf_counter()
        bench.step(name, workload, index)
        self.enter("zero")
        for phase in PHASES:
            self.times[phase].append(self.step_times[phase])

    def note(self, kind: str, what: str, amount: int = 1) -> None:
        if self.counting:
            self.counts[(self.phase, kind)] += amount
            if kind == "sync":
                where, line = self.where[self.phase], f"{what} at {_caller()}"
                where[line] = where.get(line, 0) + 1


PROBE = Probe()


def _caller() -> str:
    """``path:line`` of the innermost frame outside torch and this script."""
    skip = ("step_cost.py", "cpu_megatron.py", "/torch/")
    frames = [f for f in traceback.extract_stack()[:-3] if not any(s in f.filename for s in skip)]
    f = frames[-1]
    name = f.filename.split("site-packages/")[-1]
    return f"{name[len(HERE) + 1 :] if name.startswith(HERE) else name}:{f.lineno}"


class _Syncs(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            PROBE.note("sync", func.__name__)
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    """Counts the ops that launch a kernel on a GPU (not views, not collectives)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace == "aten" and "local_scalar" not in func.__name__:
            PROBE.note("kernels", "")
        return func(*args, **(kwargs or {}))


def _patch_collectives() -> None:
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            PROBE.note("collectives", _name)
            nbytes = args[0].nbytes if args and isinstance(args[0], torch.Tensor) else 0
            PROBE.note("collective bytes", _name, nbytes)
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)


def _marked(schedule):
    def run(**call):
        outer = PROBE.phase
        PROBE.enter("loop")
        try:
            return schedule(**call)
        finally:
            PROBE.enter("after" if outer == "before" else outer)

    return run


def _instrument(bench: Bench) -> None:
    _patch_collectives()
    schedule_for = megatron_compat.schedule_for
    megatron_compat.schedule_for = lambda *a, **kw: _marked(schedule_for(*a, **kw))
    for name, schedule in list(bench.schedules.items()):
        plugin = callable(getattr(schedule, "step_metrics", None))
        bench.schedules[name] = _PluginProxy(schedule) if plugin else _marked(schedule)
    for _, optimizer in bench.models.values():
        step = optimizer.step

        def opt_step(*a, _step=step, **kw):
            PROBE.enter("optimizer")
            try:
                return _step(*a, **kw)
            finally:
                PROBE.enter("metrics")

        optimizer.step = opt_step


class _PluginProxy:  # a LossFixSchedule that marks where its step and its metrics begin
    def __init__(self, schedule) -> None:
        self._schedule = schedule

    def __getattr__(self, name):
        return getattr(self._schedule, name)

    def __call__(self, **call):
        PROBE.enter("before")
        return self._schedule(**call)

    def step_metrics(self):
        PROBE.enter("metrics")  # as stock's metrics begin, after the optimizer step
        return self._schedule.step_metrics()


def measure(bench: Bench, name: str, workload: str, steps: int) -> dict:
    for i in range(2):  # warm-up: lazy state of optimizer and allocator
        bench.step(name, workload, i)
    PROBE.times.clear()
    for i in range(steps):
        dist.barrier()
        PROBE.run_step(bench, name, workload, i)
    PROBE.counts.clear(), PROBE.where.clear()
    with _Syncs(), _Ops():
        PROBE.counting = True
        PROBE.run_step(bench, name, workload, 0)
        PROBE.counting = False
    ms = {p: 1000 * statistics.median(PROBE.times[p][:steps]) for p in PHASES}
    return {"ms": ms, "counts": dict(PROBE.counts), "where": dict(PROBE.where)}


def report(name: str, workload: str, got: dict, stock: dict) -> str:
    kinds = ("sync", "collectives", "collective bytes", "kernels")
    lines = [f"\n### {workload.upper()}: {name}\n",
             "| phase | host ms | vs stock | " + " | ".join(kinds) + " |",
             "|---|" + "---:|" * (2 + len(kinds))]  # fmt: skip
    for p in PHASES:
        cells = [str(got["counts"].get((p, k), 0)) for k in kinds]
        lines.append(f"| {p} | {got['ms'][p]:.2f} | {got['ms'][p] - stock['ms'][p]:+.2f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    total, base = sum(got["ms"].values()), sum(stock["ms"].values())
    lines.append(f"| step | {total:.2f} | {total - base:+.2f} ({total / base:.3f}x) |")
    for p, where in got["where"].items():
        lines += [f"* {p}: {n} x {w}" for w, n in sorted(where.items())]
    return "\n".join(lines)


def python_per_microbatch(num: int = 8, repeats: int = 300) -> str:
    """The pass's own time per micro-batch: tiny ``forward_step``s, plain and wrapped."""
    import megatron_lossfix.step.microbatch as mb
    from megatron_lossfix import LossFixConfig, weighted_loss
    from megatron_lossfix.runtime.mask_in_loss import KeptStep, Phase

    config, masks = LossFixConfig(reduction="token_mean"), [torch.ones(1, 256)] * num
    batches = [{"loss_mask": m, "x": torch.randn(1, 256)} for m in masks]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return batch["x"], partial(weighted_loss, batch.get(config.weights_key, masks[0]))

    def run(plugin: bool) -> float:
        times = []
        for _ in range(repeats):
            func, it = forward_step, iter(batches)
            if plugin:  # the pass as the step builds it (token_mean, no kept masks)
                kept = KeptStep("token_mean", Phase.ZERO, [1] * num, torch.device("cpu"), 1, None)
                it = mb.MicroBatches(batches, masks, config)
                settings = mb.PassSettings(config, False, False, float(num), kept, None)
                func = mb.wrap_forward_step(forward_step, it, settings, mb.PassLog())
            t = time.perf_counter()
            for output, loss in (func(it, None) for _ in range(num)):
                loss(output)
            times.append((time.perf_counter() - t) / num)
        return 1e6 * statistics.median(times)

    plain, plugin = run(False), run(True)
    return (
        f"\nPython per micro-batch, alone (token_mean, weighted_loss, {num} micro-batches): "
        f"{plain:.1f} us plain, {plugin:.1f} us through the plugin: {plugin - plain:+.1f} us"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start()
    bench = Bench(args, args.variant_list)
    _instrument(bench)
    out = []
    for workload in args.workload_list:
        results = {n: measure(bench, n, workload, args.steps_per_round) for n in args.variant_list}
        for name in args.variant_list:
            out.append(report(name, workload, results[name], results["stock"]))
    sync()
    if dist.get_rank() == 0:
        print("\n".join(out) + python_per_microbatch(), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
