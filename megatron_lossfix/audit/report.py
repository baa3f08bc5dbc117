"""The audit's report: its numbers, the table it prints and the plot it draws (docs/design.md §5).

``AuditReport`` holds every mode's result under every layout and becomes ``audit.json``;
``Progress`` is what a run prints on stderr while it goes; ``format_table`` is the mode x
layout table the command prints; ``plot_report`` draws ``audit.png`` (grouped bars, log scale,
the tolerance line) and is the only part that needs matplotlib. The formats are part of the
public contract: change them only with their checks.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import megatron_lossfix
from megatron_lossfix.audit.oracle_case import COUNTED_BEFORE

if TYPE_CHECKING:
    from megatron_lossfix.audit.matrix import MatrixLayout, ReferenceJob

__all__ = ["AuditReport", "Progress", "each_layout", "format_table", "plot_report"]


@dataclass
class AuditReport:
    """The outcome: ``errors[mode][layout]`` relative L2 gradient errors, and the verdict."""

    options: dict[str, Any]
    modes: list[str]
    layouts: list[dict[str, Any]]
    results: list[dict[str, Any]] = field(default_factory=list)
    layout_errors: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    baselines: tuple[str, ...] = ("off",)
    """Rows allowed to miss: stock Megatron, or a framework as released (``--stack``)."""
    not_applicable: dict[str, str] = field(default_factory=dict)
    """``"row@layout"`` -> why that row does not run under that layout (a stack's setting the
    framework refuses there): not a missing result."""

    def add_result(self, mode: str, lay: MatrixLayout, check: dict[str, Any], tol: float) -> None:
        """Record ``mode`` under ``lay`` from the driver's ``check`` (``run_layout``); a check
        without ``loss`` compares the gradient only (the stack rows)."""
        grad_err = check["error"]
        baseline = mode in self.baselines
        loss = ref_loss = loss_err = None
        if "loss" in check:
            loss, ref_loss = float(check["loss"]), float(check["ref_loss"])
            loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
        # `off` reports Megatron's own mean of means, not L: only its gradient is compared.
        passed = grad_err <= tol and (baseline or loss_err is None or loss_err <= tol)
        kept = check.get("reference", {}).get("kept_token_fraction")
        row = {
            "mode": mode,
            "layout": lay.name,
            "grad_rel_error": grad_err,
            "loss": loss,
            "reference_loss": ref_loss,
            "loss_rel_error": None if baseline else loss_err,
            "passed": passed,
            "expected_to_pass": _expected_to_pass(mode, baseline, lay),
        }
        if kept is not None:  # a mask decided in the loss: the share of loss tokens it kept
            row["kept_token_fraction"] = kept
        self.results.append(row)

    @property
    def errors(self) -> dict[str, dict[str, float | None]]:
        table: dict[str, dict[str, float | None]] = {m: {} for m in self.modes}
        for row in self.results:
            table[row["mode"]][row["layout"]] = row["grad_rel_error"]
        return table

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Plugin modes that missed (``off`` may miss: it is stock Megatron)."""
        return [r for r in self.results if r["mode"] not in self.baselines and not r["passed"]]

    @property
    def did_not_run(self) -> list[tuple[str, str]]:
        """``(row, layout)`` pairs with no result: the layout raised, or the row was never
        measured there. Each one fails the audit, whatever the row (a baseline included)."""
        names = [lay["name"] if isinstance(lay, dict) else lay for lay in self.layouts]
        ran = {(r["mode"], r["layout"]) for r in self.results}
        return [(m, n) for m in self.modes for n in names
                if (m, n) not in ran and f"{m}@{n}" not in self.not_applicable]  # fmt: skip

    @property
    def passed(self) -> bool:
        return not self.failures and not self.layout_errors and not self.did_not_run

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
            "did_not_run": [list(pair) for pair in self.did_not_run],
            "not_applicable": self.not_applicable,
            "baselines": list(self.baselines),
            "options": self.options,
            "elapsed_s": round(self.elapsed_s, 3),
            "environment": _environment(),
        }


def _expected_to_pass(mode: str, baseline: bool, lay: MatrixLayout) -> bool:
    """Plugin rows must pass; stock Megatron passes with one micro-batch in the whole step; a
    mask counted before the forward (zeroed, still counted) only where nothing is normalized."""
    if not baseline:
        return True
    if mode.endswith(COUNTED_BEFORE):
        return mode.removesuffix(COUNTED_BEFORE) == "sum"
    return lay.total_microbatches == 1


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


class Progress:
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

    def reference(self, job: ReferenceJob, done: bool) -> None:
        """``compute_references``' callback: the same lines as for a layout."""
        label = f"reference {job.mode}" + (" (no attention)" if job.label.cp > 1 else "")
        if job.plan is not None:
            label += f" for {job.label.name}"
        if done:
            self.advance(label)
        else:
            self.show(label)

    def _draw(self, text: str) -> None:
        filled = round(self.width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"\raudit [{bar}] {self.done}/{self.total} {elapsed:5.0f} s  {text}"
        self.stream.write(f"{line:<100.100}")
        self.stream.flush()


def each_layout(
    report: AuditReport, bar: Progress, layouts: Sequence[tuple[Any, ...]], measure: Callable
) -> None:
    """``measure(*item)`` for each item of ``layouts`` (a layout, then what else its run
    takes), shown on ``bar``: it runs the layout on the pool and records its rows in
    ``report``. A layout that fails is recorded in ``report.layout_errors`` (which fails the
    audit, every row of it), and the next one goes on."""
    for item in layouts:
        name = item[0].name
        bar.show(name)
        try:
            measure(*item)
        except Exception as exc:  # noqa: BLE001 - recorded, reported, and fails the run
            report.layout_errors[name] = f"{type(exc).__name__}: {exc}"
            bar.advance(f"{name} FAILED")
            continue
        bar.advance(name)


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


def _verdict(baseline: str | None, misses: int, errored: int, layouts: int) -> str:
    """A row's verdict: a cell that did not run fails it, baseline or not; a baseline (named
    ``baseline``: what it is) may miss the tolerance."""
    if errored:
        missed = "" if baseline is not None or not misses else f"{_count(misses, 'layout')}, "
        return f"FAIL ({missed}did not run on {errored}/{layouts})"
    if baseline is not None:
        return (
            f"{baseline}: misses {misses}/{layouts} (allowed)"
            if misses
            else f"{baseline}: exact here"
        )
    return "pass" if misses == 0 else f"FAIL ({_count(misses, 'layout')})"


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
        cells, misses, errored = [], 0, 0
        for name, width in zip(names, widths, strict=True):
            err = errors[mode].get(name)
            if err is None and f"{mode}@{name}" in report.not_applicable:
                cells.append("-".rjust(width))
                continue
            if err is None:
                errored += 1
                cells.append("error".rjust(width))
                continue
            ok = passed[(mode, name)]
            misses += not ok
            cells.append((f"{err:.1e}" + (" " if ok else "*")).rjust(width))
        baseline = None
        if mode in report.baselines:
            baseline = "stock baseline" if mode == "off" else "as released"
            if mode.endswith(COUNTED_BEFORE):
                baseline = "baseline"
        verdict = _verdict(baseline, misses, errored, len(names))
        lines.append(_mode_label(mode).ljust(first) + "".join(cells) + "  " + verdict)
    for name, err in report.layout_errors.items():
        lines.append(f"layout {name} did not run: {err}")
    kept = [r for r in report.results if "kept_token_fraction" in r]
    dropped = {r["layout"]: 1 - r["kept_token_fraction"] for r in kept}
    if dropped:
        shares = [f"{share:.1%}" for share in dropped.values()]
        usual = max(set(shares), key=shares.count)
        others = [f"{s} on {name}" for name, s in zip(dropped, shares, strict=True) if s != usual]
        lines.append(
            f"mask decided in the loss: {usual} of the loss tokens dropped"
            + (f" ({', '.join(others)})" if others else "")
            + "; the rows '(counted before)' zero them but keep counting them (token_mean "
            "misses by exactly that fraction)"
        )
    verdict = "PASS" if report.passed else "FAIL"
    lines.append(
        f"{verdict}: {_count(len(report.failures), 'plugin result')} above tolerance, "
        f"{_count(len(report.layout_errors), 'layout')} failed to run, "
        f"{_count(len(report.did_not_run), 'result')} missing ({report.elapsed_s:.0f} s)"
    )
    return "\n".join(lines)


def plot_report(report: AuditReport, path: Path) -> None:
    """Grouped bars per layout, one per mode, log scale, with the tolerance line."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    names = [lay["name"] for lay in report.layouts]
    floor = _plot_floor(report.errors)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.5 * len(names) + 3.5), 5.2), layout="constrained")
    _draw_bars(ax, report, floor, plt.get_cmap("tab10").colors)
    _draw_axes(ax, report, floor)
    _draw_legend(ax, report)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _draw_bars(ax: Any, report: AuditReport, floor: float, palette: Sequence[Any]) -> None:
    """One bar per mode and layout, from the floor up to the error; misses edged in red."""
    names = [lay["name"] for lay in report.layouts]
    modes = _mode_order(report.modes)
    errors = report.errors
    passed = {(r["mode"], r["layout"]): r["passed"] for r in report.results}
    # No red or grey among the modes: red marks misses, grey is the stock baseline.
    colors = [palette[k] for k in (0, 1, 2, 4, 5, 9, 6, 8)]
    width = 0.8 / len(modes)
    plugin_modes = [m for m in modes if m not in report.baselines]
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
            edge.append(
                "red" if mode not in report.baselines and not passed[(mode, name)] else "none"
            )
            if err == 0:
                ax.text(x, floor * 1.5, "0", ha="center", va="bottom", fontsize=8)
        stock = mode in report.baselines
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


def _draw_axes(ax: Any, report: AuditReport, floor: float) -> None:
    """The tolerance line and band, log axis, layout ticks, labels and title."""
    tol = report.options["tolerance"]
    names = [lay["name"] for lay in report.layouts]
    finite = [e for row in report.errors.values() for e in row.values() if e]
    top = 10 ** math.ceil(math.log10(max(finite + [1.0]) * 3))
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
        f"{'per-token' if opts['per_token_loss'] else 'per-micro-batch'} loss path"
        + (", mask decided in the loss" if opts.get("mask_in_loss") else ""),
        fontsize=11,
    )


def _draw_legend(ax: Any, report: AuditReport) -> None:
    """The modes, the tolerance and, when something missed, what a red edge means."""
    handles, labels = ax.get_legend_handles_labels()
    if report.failures:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="white", edgecolor="red", linewidth=2))
        labels.append("plugin mode above tolerance")
    ax.legend(
        handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False
    )
