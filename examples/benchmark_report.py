"""The tables ``benchmark.py`` prints: per variant, its step time against its baseline's (the
median over rounds of the per-round ratio of median step times, and their range), the same for
the schedule call and the CPU time, the step's tensor peak and a fresh process's peak. Kept
apart from the driver, which launches and collects, and from ``benchmark_step.py``, which
measures.
"""

from __future__ import annotations

import argparse
import statistics

from benchmark_step import CUDA, VARIANTS, baseline


def ratio(rounds: list[dict], name: str, base: str, key: str = "step_s") -> str:
    """Median over rounds of (median ``key`` of ``name`` / that of ``base``), then the range."""
    med = statistics.median
    r = [med(x[name][key]) / med(x[base][key]) for x in rounds if name in x and base in x]
    return f"{med(r):.3f} ({min(r):.3f}-{max(r):.3f})" if r else "-"


def tables(args: argparse.Namespace, timing: dict, memory: dict) -> str:
    """One markdown table per world size and workload (``timing``: world -> phase result;
    ``memory``: ``"<world>/<variant>"`` -> fresh-process peak)."""
    peak_kind = "GPU memory" if CUDA else "RSS"
    header = (
        "| variant | vs | step ms | step time ratio | fwd-bwd ratio | CPU time ratio | step tensor "
        f"peak | peak {peak_kind} (fresh process) | step time vs off |\n|---|---|{'---:|' * 7}"
    )
    lines = []
    for world, result in sorted(timing.items()):
        for workload, rounds in result["rounds"].items():
            m = args.global_batch_size // (int(world) * args.micro_batch_size)
            title = f"{workload.upper()}, {world} rank(s) (DP={world}), {m} micro-batches per rank"
            lines += [f"\n### {title}\n", header]
            for name in args.variant_list:
                base, (mode, per_token) = baseline(name), VARIANTS[name]
                peak, peak_base = (result["tensor_peak"][workload][n] for n in (name, base))
                mem, mem_base = (memory.get(f"{world}/{n}", {}).get("peak") for n in (name, base))
                fresh = f"{mem / mem_base:.3f} ({mem / 2**20:.0f} MiB)" if mem and mem_base else "-"
                off = mode not in (None, "off") and not per_token and "off" in rounds[0]
                steps = [t for r in rounds for t in r[name]["step_s"]]
                lines.append(
                    f"| {name} | {base} | {1000 * statistics.median(steps):.0f} "
                    f"| {ratio(rounds, name, base)} | {ratio(rounds, name, base, 'fb_s')} "
                    f"| {ratio(rounds, name, base, 'cpu_s')} "
                    f"| {peak / max(peak_base, 1):.4f} ({peak / 2**20:.2f} MiB) | {fresh} "
                    f"| {ratio(rounds, name, 'off') if off else '-'} |"
                )
    return "\n".join(lines)


def parameters(timing: dict) -> float:
    """The model's parameter count on one rank (the largest the world sizes report)."""
    return max((result.get("parameters", 0) for result in timing.values()), default=0)
