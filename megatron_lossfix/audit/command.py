"""``python -m megatron_lossfix audit``: the invariance matrix as a command (docs/design.md §5, §8).

For every chosen parallel layout and reduction mode it runs one real Megatron-Core training step
of a tiny GPT through the plugin's schedule (DDP, pipeline schedules, ``finalize_model_grads``),
gathers the full gradient, and compares it with a one-rank, one-micro-batch reference of the same
model, data and mode (relative L2). The stock baseline ``off`` is compared with the exact
``token_mean`` gradient: it is expected to miss whenever a step has more than one micro-batch in
all, which shows that the check can fail. The run prints a table, writes ``audit.json`` and
``audit.png`` (when matplotlib is installed) into the ``--out`` folder, and exits 1 when any
plugin mode misses the tolerance.

The ranks are CPU worker processes talking over gloo (``megatron_lossfix.audit.pool``), on any
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
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import IO, Any

from megatron_lossfix.audit.matrix import (
    LAYOUT_PRESETS,
    check_layout,
    compute_references,
    parse_layout,
    reference_jobs,
)
from megatron_lossfix.audit.options import (
    DEFAULT_LAYOUTS,
    MODEL_SIZES,
    AuditLayout,
    AuditOptions,
    add_audit_args,
    default_out,
    options_from_args,
    options_json,
    validate_options,
)
from megatron_lossfix.audit.oracle import OracleCase, layout_grads
from megatron_lossfix.audit.oracle_case import COUNTED_BEFORE
from megatron_lossfix.audit.pool import DistPool
from megatron_lossfix.audit.report import (
    AuditReport,
    Progress,
    each_layout,
    format_table,
    plot_report,
)
from megatron_lossfix.audit.stacks import load_stack

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


def run_audit(
    opts: AuditOptions,
    *,
    pool: Any = None,
    progress: IO[str] | None = sys.stderr,
    worker: Callable[..., Any] = layout_grads,
    stack_worker: Callable[..., Any] | None = None,
) -> AuditReport:
    """Run the matrix; ``pool`` is a ``DistPool`` with enough ranks (else one is started);
    ``worker`` is what every rank runs for a layout (tests inject faults through it), and
    ``stack_worker`` the same for ``--stack`` (default: the stack's own)."""
    validate_options(opts)
    if opts.stack is not None:
        return _run_stack(opts, pool, progress, stack_worker)
    started = time.perf_counter()
    rows = opts.rows
    report = AuditReport(
        options=options_json(opts),
        modes=list(rows),
        layouts=[{**asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
        baselines=("off", *(r for r in rows if r.endswith(COUNTED_BEFORE))),
    )
    cases = [opts.case(lay) for lay in opts.layouts]
    placements = [(lay, c, lay.plan(c)) for lay, c in zip(opts.layouts, cases, strict=True)]
    jobs = reference_jobs(rows, placements)
    bar = Progress(len(jobs) + len(opts.layouts), progress)
    world = max(lay.world_size for lay in opts.layouts)
    own_pool = pool is None
    if own_pool:
        pool = DistPool(max_ranks=world, timeout_s=opts.timeout_s)
    elif pool.max_ranks < world:
        raise ValueError(f"the pool has {pool.max_ranks} ranks; the layouts need {world}")

    def measure(lay: AuditLayout, case: OracleCase) -> None:
        checks = check_layout(pool, case, lay.parallel(), lay.world_size, lay.num_microbatches,
                              opts.rows, refs=refs, worker=worker)  # fmt: skip
        for mode in opts.rows:
            report.add_result(mode, lay, checks[mode], opts.tolerance)

    try:
        refs = compute_references(pool, jobs, on_job=bar.reference)
        each_layout(report, bar, [(lay, case) for lay, case, _ in placements], measure)
    finally:
        if own_pool:
            pool.close()
    report.elapsed_s = time.perf_counter() - started
    return report


def _run_stack(
    opts: AuditOptions, pool: Any, progress: IO[str] | None, worker: Callable[..., Any] | None
) -> AuditReport:
    """``--stack``: the framework's own loss path (``megatron_lossfix.audit.stacks``)."""
    stack = load_stack(opts.stack)
    run = partial(stack.run_stack, opts, options_json(opts), progress=progress)
    if worker is not None:
        run = partial(run, worker=worker)
    world = max(lay.world_size for lay in opts.layouts)
    if pool is None:
        with DistPool(max_ranks=world, timeout_s=opts.timeout_s) as own:
            return run(pool=own)
    if pool.max_ranks < world:
        raise ValueError(f"the pool has {pool.max_ranks} ranks; the layouts need {world}")
    return run(pool=pool)


def _require_stack(name: str) -> None:
    """Exit with one line naming the extra when the framework is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    stack = load_stack(name)
    distribution, oldest = stack.DISTRIBUTION, getattr(stack, "MIN_VERSION", None)
    try:
        installed = version(distribution)
    except PackageNotFoundError:
        installed = None
    if installed is None or (oldest is not None and Version(installed) < Version(oldest)):
        # 2, as for a bad flag: 1 means an adapted row missed.
        have = "" if installed is None else f" >= {oldest} (installed: {installed})"
        install = getattr(stack, "INSTALL", f"pip install -e .[{name}] (from this clone)")
        print(f"--stack {name} needs {distribution}{have}: {install}", file=sys.stderr)
        sys.exit(2)


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
    stack_worker: Callable[..., Any] | None = None,
) -> int:
    """Run the audit command; returns the exit status (0: every plugin mode within tolerance).

    ``pool``: an already started ``DistPool`` to run in (tests share theirs); ``worker`` and
    ``stack_worker``: see :func:`run_audit`.
    """
    parser = add_audit_args(
        argparse.ArgumentParser(
            prog="python -m megatron_lossfix audit",
            description="\n\n".join(__doc__.split("\n\n")[1:3]).replace("``", ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    args = parser.parse_args(argv)
    try:
        opts = options_from_args(args)
        validate_options(opts)
    except ValueError as exc:
        parser.error(str(exc))
    if opts.stack is not None:
        _require_stack(opts.stack)
    if pool is None:  # workers started later inherit the filters
        _quiet_known_warnings()
    progress = None if args.no_progress else sys.stderr
    report = run_audit(opts, pool=pool, progress=progress, worker=worker, stack_worker=stack_worker)
    out = Path(args.out or default_out(opts))
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
