"""``python -m megatron_lossfix audit``: the invariance matrix as a command (docs/design.md §5, §8).

For every chosen parallel layout and reduction mode it runs one real Megatron-Core training step
of a tiny GPT through the plugin's schedule (DDP, pipeline schedules, ``finalize_model_grads``),
gathers the full gradient, and compares it with a one-rank, one-micro-batch reference of the same
model, data and mode (relative L2). The stock baseline ``off`` is compared with the exact
``token_mean`` gradient: it is expected to miss whenever a step has more than one micro-batch in
all, which shows that the check can fail. The run prints a table, writes ``DIR/audit.json`` and
``DIR/audit.png`` (when matplotlib is installed), and exits 1 when any plugin mode misses the
tolerance.

The ranks are CPU worker processes talking over gloo (``megatron_lossfix.testing.pool``), on any
machine: no GPU is needed, and a GPU present is not used, so results do not depend on hardware.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import megatron_lossfix
from megatron_lossfix.config import MODES
from megatron_lossfix.testing.oracle import (
    OracleCase,
    layout_grads,
    microbatch_plan,
    reference_grads,
    relative_error,
)
from megatron_lossfix.testing.pool import DistPool
from megatron_lossfix.testing.tiny_gpt import Layout

__all__ = [
    "DEFAULT_LAYOUTS",
    "LAYOUT_PRESETS",
    "MODEL_SIZES",
    "AuditLayout",
    "AuditReport",
    "add_audit_args",
    "format_table",
    "main",
    "parse_layout",
    "plot_report",
    "run_audit",
]

TOLERANCE = 1e-5

#: Named layouts shown in ``--help``; any name of the same grammar is accepted (see parse_layout).
LAYOUT_PRESETS: tuple[str, ...] = (
    "dp1-m1",
    "dp1-m4",
    "dp2-m1",
    "dp2-m3",
    "dp3-m4",
    "tp2-m3",
    "pp2-m4",
    "pp2-vpp2-m4",
    "cp2-m3",
    "tp2-pp2-dp2-m3",
)
#: DP (2 and 3 ranks), TP, CP, 1F1B and interleaved PP and a 3-D layout: under a minute on 2 cores.
DEFAULT_LAYOUTS: tuple[str, ...] = (
    "dp2-m3",
    "dp3-m4",
    "tp2-m3",
    "pp2-m4",
    "pp2-vpp2-m4",
    "cp2-m3",
    "tp2-pp2-dp2-m3",
)

#: ``build_tiny_gpt`` arguments of each ``--model-size``.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 4, "hidden": 32, "heads": 4},
    "small": {"num_layers": 8, "hidden": 128, "heads": 8},
}

_LAYOUT_PART = re.compile(r"(vpp|tp|pp|cp|dp|m)(\d+)")


@dataclass(frozen=True)
class AuditLayout:
    """One column of the matrix: a parallel layout and the micro-batches per DP rank."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dp: int = 1
    num_microbatches: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def total_microbatches(self) -> int:
        """Micro-batches in the whole step (all DP ranks): with 1, stock Megatron is exact."""
        return self.dp * self.num_microbatches


def parse_layout(name: str) -> AuditLayout:
    """``tp2-pp2-dp2-m3`` -> TP=2, PP=2, DP=2, 3 micro-batches per DP rank.

    Parts, joined by ``-`` in any order: ``tp<N>``, ``pp<N>``, ``vpp<N>`` (virtual stages per PP
    rank, interleaved 1F1B), ``cp<N>``, ``dp<N>`` (default 1) and ``m<N>`` (required).
    Raises ``ValueError`` for anything else.
    """
    values: dict[str, int] = {}
    for part in name.strip().split("-"):
        match = _LAYOUT_PART.fullmatch(part)
        if not match or match[1] in values or int(match[2]) < 1:
            raise ValueError(
                f"bad layout {name!r}: expected parts like tp2, pp2, vpp2, cp2, dp2 and m3 "
                f"(micro-batches per DP rank), each once and >= 1, joined by '-'"
            )
        values[match[1]] = int(match[2])
    if "m" not in values:
        raise ValueError(f"bad layout {name!r}: the micro-batch count m<N> is required")
    if "vpp" in values and values.get("pp", 1) < 2:
        raise ValueError(f"bad layout {name!r}: vpp needs pp >= 2")
    return AuditLayout(
        name=name.strip(),
        tp=values.get("tp", 1),
        pp=values.get("pp", 1),
        vpp=values.get("vpp"),
        cp=values.get("cp", 1),
        dp=values.get("dp", 1),
        num_microbatches=values["m"],
    )


@dataclass
class AuditOptions:
    """Everything a run depends on (the parsed command line)."""

    modes: tuple[str, ...] = MODES
    layouts: tuple[AuditLayout, ...] = ()
    num_layers: int = 4
    hidden: int = 32
    heads: int = 4
    global_batch_size: int = 24
    seq_length: int = 16
    seed: int = 1234
    per_token_loss: bool = False
    tolerance: float = TOLERANCE
    timeout_s: float = 300.0

    def model_kwargs(self, layout: AuditLayout) -> dict[str, Any]:
        # Without Transformer Engine, context parallelism needs layers that mix no tokens
        # (docs/design.md §7): CP layouts use the same model with attention replaced by identity.
        kwargs: dict[str, Any] = {
            "num_layers": self.num_layers,
            "hidden": self.hidden,
            "heads": self.heads,
        }
        if layout.cp > 1:
            kwargs["no_attention"] = True
        return kwargs


@dataclass
class AuditReport:
    """The outcome: ``errors[mode][layout]`` relative L2 gradient errors, and the verdict."""

    options: dict[str, Any]
    modes: list[str]
    layouts: list[dict[str, Any]]
    results: list[dict[str, Any]] = field(default_factory=list)
    layout_errors: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def errors(self) -> dict[str, dict[str, float | None]]:
        table: dict[str, dict[str, float | None]] = {m: {} for m in self.modes}
        for row in self.results:
            table[row["mode"]][row["layout"]] = row["grad_rel_error"]
        return table

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Plugin modes that missed (``off`` may miss: it is stock Megatron)."""
        return [r for r in self.results if r["mode"] != "off" and not r["passed"]]

    @property
    def passed(self) -> bool:
        return not self.failures and not self.layout_errors

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "tolerance": self.options["tolerance"],
            "modes": self.modes,
            "layouts": self.layouts,
            "errors": self.errors,
            "results": self.results,
            "failures": self.failures,
            "layout_errors": self.layout_errors,
            "options": self.options,
            "elapsed_s": round(self.elapsed_s, 3),
            "environment": _environment(),
        }


def _environment() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        mcore = version("megatron-core")
    except PackageNotFoundError:
        mcore = "unknown"
    return {
        "megatron_lossfix": megatron_lossfix.__version__,
        "megatron_core": mcore,
        "torch": torch.__version__,
        "backend": "cpu/gloo (DistPool worker processes)",
        "python": sys.version.split()[0],
    }


# ------------------------------------------------------------------------------ running


class _Progress:
    """A one-line progress bar on a terminal; one line per finished item elsewhere (logs)."""

    def __init__(self, total: int, stream: IO[str] | None, width: int = 28) -> None:
        self.total, self.done, self.width = total, 0, width
        self.stream = stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def show(self, label: str) -> None:
        """Show that ``label`` is running now."""
        if self.tty:
            self._draw(f"{label} ...")

    def advance(self, label: str) -> None:
        """Mark ``label`` as finished."""
        self.done += 1
        if self.stream is None:
            return
        if self.tty:
            self._draw(f"{label} done")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            elapsed = time.perf_counter() - self.start
            self.stream.write(f"audit [{self.done}/{self.total}] {label} ({elapsed:.0f} s)\n")
        self.stream.flush()

    def _draw(self, text: str) -> None:
        filled = round(self.width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"\raudit [{bar}] {self.done}/{self.total} {elapsed:5.0f} s  {text}"
        self.stream.write(f"{line:<100.100}")
        self.stream.flush()


def _layout_worker() -> Callable[..., Any]:
    """The function every pool rank runs for one layout (tests swap it to inject faults)."""
    return layout_grads


def _plan(layout: AuditLayout, opts: AuditOptions) -> tuple[tuple[int, ...], ...]:
    """Each DP rank's micro-batch sizes, as the oracle cuts the global batch."""
    plan = microbatch_plan(_case(opts, layout), layout.dp, layout.num_microbatches)
    return tuple(tuple(sizes) for sizes in plan)


def _reference_key(mode: str, layout: AuditLayout, opts: AuditOptions) -> tuple:
    """References differ by model variant and, for ``token_mean_legacy``, by the split."""
    no_attention = layout.cp > 1
    if mode == "token_mean_legacy":
        return (no_attention, mode, _plan(layout, opts))
    return (no_attention, "token_mean" if mode == "off" else mode, None)


def _case(opts: AuditOptions, layout: AuditLayout) -> OracleCase:
    return OracleCase(
        global_batch_size=opts.global_batch_size,
        seq_length=opts.seq_length,
        seed=opts.seed,
        per_token=opts.per_token_loss,
        model_kwargs=opts.model_kwargs(layout),
    )


def _validate(opts: AuditOptions) -> None:
    for lay in opts.layouts:
        if lay.world_size > 8:
            raise ValueError(f"layout {lay.name} needs {lay.world_size} ranks; at most 8")
        if opts.global_batch_size % lay.dp:
            raise ValueError(
                f"layout {lay.name}: --global-batch-size {opts.global_batch_size} is not "
                f"divisible by dp={lay.dp}"
            )
        if lay.num_microbatches > opts.global_batch_size // lay.dp:
            raise ValueError(
                f"layout {lay.name}: {lay.num_microbatches} micro-batches but only "
                f"{opts.global_batch_size // lay.dp} sequences per DP rank"
            )
        stages = lay.pp * (lay.vpp or 1)
        if opts.num_layers % stages:
            raise ValueError(
                f"layout {lay.name}: --num-layers {opts.num_layers} is not divisible by "
                f"pp x vpp = {stages}"
            )
        if opts.heads % lay.tp or opts.hidden % opts.heads:
            raise ValueError(
                f"layout {lay.name}: attention heads ({opts.heads}) must divide the hidden size "
                f"({opts.hidden}) and be divisible by tp={lay.tp}"
            )
        if opts.seq_length % (2 * lay.cp):
            raise ValueError(f"layout {lay.name}: --seq-length must be divisible by 2 x cp")


def run_audit(
    opts: AuditOptions, *, pool: Any = None, progress: IO[str] | None = sys.stderr
) -> AuditReport:
    """Run the matrix; ``pool`` is a ``DistPool`` with enough ranks (else one is started)."""
    _validate(opts)
    started = time.perf_counter()
    report = AuditReport(
        options=_options_json(opts),
        modes=list(opts.modes),
        layouts=[{**asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
    )
    refs_needed: dict[tuple, AuditLayout] = {}
    for lay in opts.layouts:
        for mode in opts.modes:
            refs_needed.setdefault(_reference_key(mode, lay, opts), lay)
    bar = _Progress(len(refs_needed) + len(opts.layouts), progress)

    world = max(lay.world_size for lay in opts.layouts)
    own_pool = pool is None
    if own_pool:
        pool = DistPool(max_ranks=world, timeout_s=opts.timeout_s)
    elif pool.max_ranks < world:
        raise ValueError(f"the pool has {pool.max_ranks} ranks; the layouts need {world}")
    try:
        refs: dict[tuple, dict[str, Any]] = {}
        for key, lay in refs_needed.items():
            _, mode, plan = key
            label = f"reference {mode}" + (" (no attention)" if key[0] else "")
            if plan is not None:
                label += f" for {lay.name}"
            bar.show(label)
            refs[key] = pool.run(reference_grads, 1, _case(opts, lay), mode, plan)[0]
            bar.advance(label)
        worker = _layout_worker()
        for lay in opts.layouts:
            bar.show(lay.name)
            try:
                got = pool.run(
                    worker,
                    lay.world_size,
                    _oracle_layout(lay),
                    _case(opts, lay),
                    tuple(opts.modes),
                    lay.num_microbatches,
                )[0]
            except Exception as exc:  # noqa: BLE001 - recorded, reported, and fails the run
                report.layout_errors[lay.name] = f"{type(exc).__name__}: {exc}"
                bar.advance(f"{lay.name} FAILED")
                continue
            for mode in opts.modes:
                ref = refs[_reference_key(mode, lay, opts)]
                report.results.append(
                    _result_row(mode, lay, got[mode], ref, opts.tolerance, relative_error)
                )
            bar.advance(lay.name)
    finally:
        if own_pool:
            pool.close()
    report.elapsed_s = time.perf_counter() - started
    return report


def _oracle_layout(lay: AuditLayout) -> Layout:
    return Layout(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, cp=lay.cp, dp=lay.dp)


def _result_row(
    mode: str,
    lay: AuditLayout,
    got: dict[str, Any],
    ref: dict[str, Any],
    tol: float,
    relative_error: Callable[..., float],
) -> dict[str, Any]:
    grad_err = relative_error(got["grads"], ref["grads"])
    loss, ref_loss = float(got["metrics"]["loss"]), float(ref["loss"])
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    # `off` reports Megatron's own mean of means, not L: only its gradient is compared.
    passed = grad_err <= tol and (mode == "off" or loss_err <= tol)
    return {
        "mode": mode,
        "layout": lay.name,
        "grad_rel_error": grad_err,
        "loss": loss,
        "reference_loss": ref_loss,
        "loss_rel_error": None if mode == "off" else loss_err,
        "passed": passed,
        # With one micro-batch in the whole step stock Megatron is exact too.
        "expected_to_pass": mode != "off" or lay.total_microbatches == 1,
    }


def _options_json(opts: AuditOptions) -> dict[str, Any]:
    out = asdict(opts)
    out["layouts"] = [lay.name for lay in opts.layouts]
    out["modes"] = list(opts.modes)
    return out


# ------------------------------------------------------------------------------ output


def _plot_floor(errors: dict[str, dict[str, float | None]]) -> float:
    """Bottom of the log axis: a decade below the smallest non-zero error (exact zeros, as
    with one micro-batch in all, are drawn at it)."""
    positive = [e for row in errors.values() for e in row.values() if e]
    if not positive:
        return 1e-9
    return max(1e-14, 10 ** (math.floor(math.log10(min(positive))) - 1))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _mode_order(modes: Sequence[str]) -> list[str]:
    """The stock baseline first, then the plugin modes in the order given."""
    return (["off"] if "off" in modes else []) + [m for m in modes if m != "off"]


def _mode_label(mode: str) -> str:
    return "off (stock Megatron)" if mode == "off" else mode


def format_table(report: AuditReport) -> str:
    """The mode x layout table of relative gradient errors, with a verdict per mode."""
    tol = report.options["tolerance"]
    names = [lay["name"] for lay in report.layouts]
    order = _mode_order(report.modes)
    errors = report.errors
    passed = {(r["mode"], r["layout"]): r["passed"] for r in report.results}
    first = max(len(_mode_label(m)) for m in order) + 2
    widths = [max(len(n), 9) + 2 for n in names]
    lines = [
        f"relative L2 error of the full gradient vs. the one-rank reference "
        f"(tolerance {tol:.0e}; * = above it)",
        "mode".ljust(first)
        + "".join(n.rjust(w) for n, w in zip(names, widths, strict=True))
        + "  verdict",
    ]
    for mode in order:
        cells, misses = [], 0
        for name, width in zip(names, widths, strict=True):
            err = errors[mode].get(name)
            if err is None:
                cells.append("error".rjust(width))
                continue
            ok = passed[(mode, name)]
            misses += not ok
            cells.append((f"{err:.1e}" + (" " if ok else "*")).rjust(width))
        if mode == "off":
            verdict = (
                f"stock baseline: misses {misses}/{len(names)} (allowed)"
                if misses
                else "stock baseline: exact here"
            )
        else:
            verdict = "pass" if misses == 0 else f"FAIL ({_count(misses, 'layout')})"
        lines.append(_mode_label(mode).ljust(first) + "".join(cells) + "  " + verdict)
    for name, err in report.layout_errors.items():
        lines.append(f"layout {name} did not run: {err}")
    verdict = "PASS" if report.passed else "FAIL"
    lines.append(
        f"{verdict}: {_count(len(report.failures), 'plugin result')} above tolerance, "
        f"{_count(len(report.layout_errors), 'layout')} failed to run "
        f"({report.elapsed_s:.0f} s)"
    )
    return "\n".join(lines)


def plot_report(report: AuditReport, path: Path) -> None:
    """Grouped bars per layout, one per mode, log scale, with the tolerance line."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    tol = report.options["tolerance"]
    names = [lay["name"] for lay in report.layouts]
    modes = _mode_order(report.modes)
    errors = report.errors
    passed = {(r["mode"], r["layout"]): r["passed"] for r in report.results}
    finite = [e for row in errors.values() for e in row.values() if e]
    top = 10 ** math.ceil(math.log10(max(finite + [1.0]) * 3))

    # No red or grey among the modes: red marks misses, grey is the stock baseline.
    colors = [plt.get_cmap("tab10").colors[k] for k in (0, 1, 2, 4, 5, 9, 6, 8)]
    floor = _plot_floor(errors)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.5 * len(names) + 3.5), 5.2), layout="constrained")
    width = 0.8 / len(modes)
    plugin_modes = [m for m in modes if m != "off"]
    for i, mode in enumerate(modes):
        xs, hs, edge = [], [], []
        for j, name in enumerate(names):
            err = errors[mode].get(name)
            if err is None:
                continue
            x = j - 0.4 + (i + 0.5) * width
            xs.append(x)
            # Bars start at the floor; their top is the error itself.
            hs.append(max(err, floor) - floor)
            edge.append("red" if mode != "off" and not passed[(mode, name)] else "none")
            if err == 0:
                ax.text(x, floor * 1.5, "0", ha="center", va="bottom", fontsize=8)
        stock = mode == "off"
        ax.bar(
            xs,
            hs,
            width * 0.92,
            bottom=floor,
            color="0.65" if stock else colors[plugin_modes.index(mode) % len(colors)],
            hatch="//" if stock else None,
            edgecolor=edge,
            linewidth=2,
            label=_mode_label(mode),
        )
    ax.axhspan(tol, top, color="crimson", alpha=0.05, linewidth=0)
    ax.axhline(
        tol,
        color="crimson",
        linestyle="--",
        linewidth=1.5,
        label=f"tolerance {tol:.0e} (miss above)",
    )
    for j, name in enumerate(names):
        if name in report.layout_errors:
            ax.text(j, floor * 10, "did not run", ha="center", color="crimson", rotation=90)
    ax.set_yscale("log")
    ax.set_ylim(floor, top)
    ax.set_xlim(-0.5, len(names) - 0.5)
    cp_layouts = {lay["name"] for lay in report.layouts if lay["cp"] > 1}
    ax.set_xticks(
        range(len(names)), [f"{n}\n(no attention)" if n in cp_layouts else n for n in names]
    )
    ax.set_xlabel("layout (tp/pp/vpp/cp/dp sizes, m = micro-batches per DP rank)")
    ax.set_ylabel("relative L2 gradient error vs. 1-rank reference")
    ax.grid(axis="y", which="major", alpha=0.3)
    opts = report.options
    verdict = (
        "all plugin modes within tolerance"
        if report.passed
        else f"{_count(len(report.failures), 'plugin result')} above tolerance"
    )
    ax.set_title(
        f"megatron_lossfix audit: {verdict}\n"
        f"GPT {opts['num_layers']} layers, hidden {opts['hidden']}, "
        f"{opts['global_batch_size']} sequences x {opts['seq_length']} tokens, "
        f"{'per-token' if opts['per_token_loss'] else 'per-micro-batch'} loss path",
        fontsize=11,
    )
    handles, labels = ax.get_legend_handles_labels()
    if report.failures:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="white", edgecolor="red", linewidth=2))
        labels.append("plugin mode above tolerance")
    ax.legend(
        handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False
    )
    fig.savefig(path, dpi=150)
    plt.close(fig)


# ------------------------------------------------------------------------------ command line


def _csv(choices: Sequence[str] | None) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        if not items:
            raise argparse.ArgumentTypeError("give at least one name")
        bad = [s for s in items if choices is not None and s not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items

    return parse


def _layouts(text: str) -> tuple[AuditLayout, ...]:
    try:
        return tuple(parse_layout(name) for name in _csv(None)(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_audit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the audit's flags to ``parser`` (the ``audit`` subcommand) and return it."""
    parser.add_argument(
        "--modes",
        type=_csv(MODES),
        default=MODES,
        help=f"comma-separated reduction modes to check (default: all: {','.join(MODES)}); "
        "`off` is stock Megatron, the baseline, allowed to miss",
    )
    parser.add_argument(
        "--layouts",
        type=_layouts,
        default=tuple(parse_layout(n) for n in DEFAULT_LAYOUTS),
        help=f"comma-separated layouts (default: {','.join(DEFAULT_LAYOUTS)}). A layout joins "
        "tp<N>, pp<N>, vpp<N>, cp<N>, dp<N> and m<N> (micro-batches per DP rank, required) "
        f"with '-', at most 8 ranks; e.g. {', '.join(LAYOUT_PRESETS)}. CP layouts replace "
        "attention by identity (no Transformer Engine on CPU)",
    )
    parser.add_argument(
        "--out",
        default="audit-out",
        help="directory for audit.json and audit.png (created; default: ./audit-out)",
    )
    parser.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default="tiny",
        help="GPT size: "
        + "; ".join(
            f"{k}: {v['num_layers']} layers, hidden {v['hidden']}, {v['heads']} heads"
            for k, v in MODEL_SIZES.items()
        )
        + " (default: tiny)",
    )
    parser.add_argument("--num-layers", type=int, help="override the model size's layer count")
    parser.add_argument("--hidden-size", type=int, help="override the model size's hidden size")
    parser.add_argument(
        "--num-attention-heads", type=int, help="override the model size's attention heads"
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=24,
        help="sequences in the step (default 24; variable lengths, some with no loss tokens)",
    )
    parser.add_argument(
        "--seq-length", type=int, default=16, help="tokens per sequence (default 16)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="seed of data and weights")
    parser.add_argument(
        "--per-token-loss",
        action="store_true",
        help="run Megatron's calculate_per_token_loss=True path instead of the default one",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"largest relative L2 gradient (and loss) error a plugin mode may have "
        f"(default {TOLERANCE:.0e}, fp32)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a rank may wait in a collective before the run is declared hung",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    parser.add_argument(
        "--no-plot",
        action="store_true",
        help="skip audit.png (also skipped, with a note, when matplotlib is not installed)",
    )
    return parser


def options_from_args(args: argparse.Namespace) -> AuditOptions:
    """The run's options from parsed flags (model size first, explicit sizes override it)."""
    size = MODEL_SIZES[args.model_size]
    return AuditOptions(
        modes=tuple(args.modes),
        layouts=tuple(args.layouts),
        num_layers=args.num_layers or size["num_layers"],
        hidden=args.hidden_size or size["hidden"],
        heads=args.num_attention_heads or size["heads"],
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        seed=args.seed,
        per_token_loss=args.per_token_loss,
        tolerance=args.tolerance,
        timeout_s=args.timeout,
    )


# Harmless on CPU and repeated by every rank (docs/design.md §7); they would bury the progress
# output.
_KNOWN_WARNINGS = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "When using async grad allreduce",
    "Converting a tensor with requires_grad=True to a scalar",
    "CPU RNG state changed within GPU RNG context",
)


def _quiet_known_warnings() -> None:
    """Silence the known warnings here and in worker processes started from now on."""
    import os
    import warnings

    for message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message))
    if "PYTHONWARNINGS" not in os.environ:  # the user's own choice wins
        os.environ["PYTHONWARNINGS"] = ",".join(f"ignore:{m}" for m in _KNOWN_WARNINGS)


def main(argv: Sequence[str] | None = None, *, pool: Any = None) -> int:
    """Run the audit command; returns the exit status (0: every plugin mode within tolerance).

    ``pool``: an already started ``DistPool`` to run in (tests share theirs).
    """
    parser = add_audit_args(
        argparse.ArgumentParser(
            prog="python -m megatron_lossfix audit",
            description="\n\n".join(__doc__.split("\n\n")[1:3]).replace("``", ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    args = parser.parse_args(argv)
    opts = options_from_args(args)
    try:
        _validate(opts)
    except ValueError as exc:
        parser.error(str(exc))
    if pool is None:  # workers started later inherit the filters
        _quiet_known_warnings()
    report = run_audit(opts, pool=pool, progress=None if args.no_progress else sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(format_table(report))
    written = [out / "audit.json"]
    note = ""
    if not args.no_plot:
        # The plot is the only thing that needs matplotlib, which the plain install lacks: the
        # table and audit.json carry every number, so a missing plotter is not a failure.
        if importlib.util.find_spec("matplotlib") is None:
            note = " (no audit.png: matplotlib is not installed; pip install matplotlib)"
        else:
            plot_report(report, out / "audit.png")
            written.append(out / "audit.png")
    print("wrote " + ", ".join(str(p) for p in written) + note)
    return 0 if report.passed else 1
