"""``--stack ms-swift``: ms-swift's own Megatron training steps under the audit's layouts.

What runs is ms-swift's code, unchanged, from the installed ``ms-swift`` (docs/ms_swift.md):
``BaseMegatronTrainer.train_step`` of ``MegatronTrainer`` (SFT), ``MegatronDPOTrainer`` and
``MegatronKTOTrainer``, with their own ``forward_step`` and ``loss_func`` (``swift/megatron/
trainers/``), on the audit's tiny GPT under Megatron-Core's schedules. The modules beside this
one: ``batch`` (the step's data, ms-swift's settings, unpacked and packed), ``ranks`` (what each
rank runs: the trainer, the switch), ``objective`` (the exact objective of each setting, on one
rank).

Rows per setting (``row:setting``): ``ms-swift`` (as released) against the setting's exact
objective (``objective``), ``ms-swift-vs-1rank`` (against ms-swift's own one-rank,
one-micro-batch gradient, unpacked: its layout dependence alone) and ``ms-swift+lossfix``
(:mod:`megatron_lossfix.integrations.ms_swift`, its default switch) against the exact objective.
The rows without a setting are the worst over the settings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from megatron_lossfix.audit.matrix import MatrixLayout, parse_layout
from megatron_lossfix.audit.report import AuditReport, Progress, each_layout
from megatron_lossfix.audit.stacks.modes import record_runs
from megatron_lossfix.audit.stacks.ms_swift.batch import MODES, SETTINGS, stack_case
from megatron_lossfix.audit.stacks.ms_swift.objective import swift_references
from megatron_lossfix.audit.stacks.ms_swift.ranks import (
    ADAPTED_ROW,
    ROWS,
    SWIFT_ROW,
    swift_layout_grads,
)

__all__ = [
    "ADAPTED_ROW",
    "DISTRIBUTION",
    "LAYOUTS",
    "MODES",
    "ROWS",
    "SELF_ROW",
    "SETTINGS",
    "SWIFT_ROW",
    "row_name",
    "run_stack",
    "settings_of",
]

DISTRIBUTION = "ms-swift"
#: The ms-swift release whose Megatron trainers this stack was measured on.
MIN_VERSION = "4.6.0"
INSTALL = 'pip install -e ".[ms-swift]" (from this clone; docs/ms_swift.md)'
SELF_ROW = "ms-swift-vs-1rank"
#: ``--stack ms-swift`` without ``--layouts``: one rank, micro-batches, DP, PP, TP, CP.
LAYOUTS: tuple[str, ...] = ("dp1-m1", "dp1-m3", "dp2-m3", "pp2-m4", "tp2-m3", "cp2-m3")


def row_name(row: str, mode: str, setting: str) -> str:
    """The report's row of one run: ``row:setting``."""
    return f"{row}:{setting}"


def settings_of(modes: Sequence[str]) -> tuple[str, ...]:
    """The settings whose normalization is among ``modes`` (SFT: ``token_mean``; DPO, KTO:
    ``pair_mean``)."""
    return tuple(
        name
        for name, s in SETTINGS.items()
        if ("token_mean" if s.kind == "sft" else "pair_mean") in modes
    )


def _mode(setting: str) -> str:
    return "token_mean" if SETTINGS[setting].kind == "sft" else "pair_mean"


def _targets(pool: Any, case: Any, settings: tuple[str, ...], cache: dict) -> dict:
    """Each run's target gradient: the exact objective, and ms-swift's own one-rank,
    one-micro-batch gradient (unpacked) of each setting; computed once per case."""
    if repr(case) in cache:
        return cache[repr(case)]
    exact = pool.run(swift_references, 1, case, list(settings))[0]
    unpacked = tuple(dict.fromkeys(s.removesuffix("-packed") for s in settings))
    one_rank = parse_layout("dp1-m1").parallel()
    own = pool.run(swift_layout_grads, 1, one_rank, case, 1, (SWIFT_ROW,), unpacked)[0]
    targets = {}
    for setting in settings:
        mode = _mode(setting)
        for row in ROWS:
            targets[(row, mode, setting)] = exact[setting]
        targets[(SELF_ROW, mode, setting)] = own[(SWIFT_ROW, setting.removesuffix("-packed"))]
    cache[repr(case)] = targets
    return targets


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = swift_layout_grads,
    settings: Sequence[str] | None = None,
) -> AuditReport:
    """Rows ``ms-swift`` and ``ms-swift+lossfix`` (worst setting per layout), one row per run
    (:func:`row_name`) and ``ms-swift-vs-1rank:<setting>``; ``worker`` runs on every rank
    (tests bypass the adapter through it)."""
    started = time.perf_counter()
    settings = tuple(settings) if settings is not None else settings_of(opts.modes)
    per_run = [row_name(row, _mode(s), s) for s in settings for row in ROWS]
    own = [row_name(SELF_ROW, _mode(s), s) for s in settings]
    options = {
        **options,
        "settings": {name: dataclasses.asdict(SETTINGS[name]) for name in settings},
    }
    report = AuditReport(
        options=options,
        modes=[*ROWS, *per_run, *own],
        layouts=[{**dataclasses.asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
        baselines=(SWIFT_ROW, *(r for r in per_run if r.startswith(SWIFT_ROW + ":")), *own),
    )
    bar = Progress(len(opts.layouts), progress)
    cache: dict[str, dict] = {}

    def measure(lay: MatrixLayout) -> None:
        case = stack_case(opts, lay)
        got = pool.run(worker, lay.world_size, lay.parallel(), case, lay.num_microbatches, ROWS,
                       settings)[0]  # fmt: skip
        runs = {(row, _mode(s), s): grads for (row, s), grads in got.items()}
        targets = {  # the runs ms-swift cannot make here (ranks.runs_on) stay empty
            (row, mode, s): want
            for (row, mode, s), want in _targets(pool, case, settings, cache).items()
            if (SWIFT_ROW if row == SELF_ROW else row, mode, s) in runs
        }
        record_runs(report, opts.tolerance, lay, runs, targets, released=SWIFT_ROW, own=SELF_ROW,
                    name=row_name)  # fmt: skip

    each_layout(report, bar, [(lay,) for lay in opts.layouts], measure)
    report.elapsed_s = time.perf_counter() - started
    return report
