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
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from megatron_lossfix.audit_report import AuditReport, Progress, format_table, plot_report
from megatron_lossfix.config import MODES
from megatron_lossfix.testing.matrix import (
    AUDIT_LAYOUTS,
    LAYOUT_PRESETS,
    MatrixLayout,
    check_layout,
    compute_references,
    parse_layout,
    reference_jobs,
)
from megatron_lossfix.testing.oracle import OracleCase, layout_grads
from megatron_lossfix.testing.pool import DistPool

#: The audit's names for the shared matrix's layout and default layouts.
AuditLayout = MatrixLayout
DEFAULT_LAYOUTS = AUDIT_LAYOUTS

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

#: ``build_tiny_gpt`` arguments of each ``--model-size``.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 4, "hidden": 32, "heads": 4},
    "small": {"num_layers": 8, "hidden": 128, "heads": 8},
}


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

    def case(self, layout: AuditLayout) -> OracleCase:
        """The oracle's model and data for ``layout``."""
        model: dict[str, Any] = {
            "num_layers": self.num_layers,
            "hidden": self.hidden,
            "heads": self.heads,
        }
        # Without Transformer Engine, context parallelism needs layers that mix no tokens
        # (docs/design.md §7): CP layouts use the same model with attention replaced by identity.
        if layout.cp > 1:
            model["no_attention"] = True
        return OracleCase(
            global_batch_size=self.global_batch_size,
            seq_length=self.seq_length,
            seed=self.seed,
            per_token=self.per_token_loss,
            model_kwargs=model,
        )


# ------------------------------------------------------------------------------ running


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
    opts: AuditOptions,
    *,
    pool: Any = None,
    progress: IO[str] | None = sys.stderr,
    worker: Callable[..., Any] = layout_grads,
) -> AuditReport:
    """Run the matrix; ``pool`` is a ``DistPool`` with enough ranks (else one is started);
    ``worker`` is what every rank runs for a layout (tests inject faults through it)."""
    _validate(opts)
    started = time.perf_counter()
    report = AuditReport(
        options=_options_json(opts),
        modes=list(opts.modes),
        layouts=[{**asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
    )
    cases = [opts.case(lay) for lay in opts.layouts]
    placements = [(lay, c, lay.plan(c)) for lay, c in zip(opts.layouts, cases, strict=True)]
    jobs = reference_jobs(opts.modes, placements)
    bar = Progress(len(jobs) + len(opts.layouts), progress)
    world = max(lay.world_size for lay in opts.layouts)
    own_pool = pool is None
    if own_pool:
        pool = DistPool(max_ranks=world, timeout_s=opts.timeout_s)
    elif pool.max_ranks < world:
        raise ValueError(f"the pool has {pool.max_ranks} ranks; the layouts need {world}")
    try:
        refs = compute_references(pool, jobs, on_job=bar.reference)
        for lay, case, _ in placements:
            _run_one(pool, lay, case, opts, refs, report, bar, worker)
    finally:
        if own_pool:
            pool.close()
    report.elapsed_s = time.perf_counter() - started
    return report


def _run_one(
    pool: Any,
    lay: AuditLayout,
    case: OracleCase,
    opts: AuditOptions,
    refs: dict[tuple, dict[str, Any]],
    report: AuditReport,
    bar: Progress,
    worker: Callable[..., Any],
) -> None:
    """One layout: its rows in ``report``, or why it did not run."""
    bar.show(lay.name)
    try:
        checks = check_layout(
            pool,
            case,
            lay.parallel(),
            lay.world_size,
            lay.num_microbatches,
            opts.modes,
            refs=refs,
            worker=worker,
        )
    except Exception as exc:  # noqa: BLE001 - recorded, reported, and fails the run
        report.layout_errors[lay.name] = f"{type(exc).__name__}: {exc}"
        bar.advance(f"{lay.name} FAILED")
        return
    for mode in opts.modes:
        report.add_result(mode, lay, checks[mode], opts.tolerance)
    bar.advance(lay.name)


def _options_json(opts: AuditOptions) -> dict[str, Any]:
    out = asdict(opts)
    out["layouts"] = [lay.name for lay in opts.layouts]
    out["modes"] = list(opts.modes)
    return out


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
    _add_matrix_args(parser)
    _add_model_args(parser)
    _add_run_args(parser)
    return parser


def _add_matrix_args(parser: argparse.ArgumentParser) -> None:
    """What to check and where the files go."""
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


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model and the data of the step."""
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


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    """The verdict's tolerance and how the run behaves."""
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


def main(
    argv: Sequence[str] | None = None,
    *,
    pool: Any = None,
    worker: Callable[..., Any] = layout_grads,
) -> int:
    """Run the audit command; returns the exit status (0: every plugin mode within tolerance).

    ``pool``: an already started ``DistPool`` to run in (tests share theirs); ``worker``: see
    :func:`run_audit`.
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
    progress = None if args.no_progress else sys.stderr
    report = run_audit(opts, pool=pool, progress=progress, worker=worker)
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
