"""``--stack roll``: ROLL's own Megatron training step under the audit's layouts.

What runs is ROLL's code, unchanged, from the installed ``roll`` and ``mcore_adapter``
(docs/roll.md): ``MegatronTrainStrategy.train_step`` with its counts, micro-batching (static,
dynamic, packed) and loss scaling, and the RLVR actor's ``loss_func`` (``agg_loss`` in every
``loss_agg_mode``, train-infer filters, sample weights) or the DPO worker's, on the audit's tiny
GPT under Megatron-Core's schedules.

The modules beside this one: ``batch`` (the step's data, ROLL's settings and batchings),
``ranks`` (what each rank runs: the strategy, the switch), ``objective`` (the exact objective of
each setting, on one rank).

Rows per ``mode`` and ``setting@batching``: ``roll`` (as released) against the exact objective
(the plugin's weights of the mode's counterpart, filtered tokens zeroed and counted),
``roll-vs-1rank`` (against ROLL's own one-rank, statically batched, one-micro-batch gradient: its
layout and batching dependence alone), ``roll+lossfix`` (:mod:`megatron_lossfix.integrations.roll`,
its default switch) against the same objective, and, for the settings that drop tokens,
``roll+lossfix+mask-in-loss`` (``enable(mask_in_loss=True)``) against the excluded one. Row
names carry the mode and setting (``roll+lossfix:token-mean+filter@dynamic``); the rows without
one are the worst over them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from megatron_lossfix.audit.matrix import MatrixLayout, parse_layout
from megatron_lossfix.audit.report import AuditReport, Progress, each_layout
from megatron_lossfix.audit.stacks.modes import record_runs
from megatron_lossfix.audit.stacks.roll.batch import (
    BATCHINGS,
    DROPPING,
    MASKED_SAMPLES,
    MODES,
    SETTINGS,
    roll_batch,
    stack_case,
)
from megatron_lossfix.audit.stacks.roll.objective import kept_tokens, roll_references
from megatron_lossfix.audit.stacks.roll.ranks import (
    ADAPTED_ROW,
    EXCLUDED_ROW,
    ROLL_ROW,
    ROWS,
    roll_layout_grads,
    runs,
)

__all__ = [
    "ADAPTED_ROW",
    "BATCHINGS",
    "DISTRIBUTION",
    "DROPPING",
    "EXCLUDED_ROW",
    "LAYOUTS",
    "MASKED_SAMPLES",
    "MODES",
    "ROLL_ROW",
    "ROWS",
    "SELF_ROW",
    "SETTINGS",
    "roll_batch",
    "roll_layout_grads",
    "row_name",
    "run_stack",
    "stack_case",
]

DISTRIBUTION = "roll"
#: The ROLL release whose Megatron step this stack was measured on (8eb27cc).
MIN_VERSION = "0.3.0"
INSTALL = "the install line of docs/roll.md (ROLL from its source, ROLL_SOURCE)"
SELF_ROW = "roll-vs-1rank"
#: ``--stack roll`` without ``--layouts``: one rank, odd micro-batch counts, DP, PP, TP, CP.
LAYOUTS: tuple[str, ...] = ("dp1-m1", "dp1-m3", "dp2-m3", "pp2-m3", "tp2-m3", "cp2-m3")


def row_name(row: str, mode: str, setting: str) -> str:
    """The report's row of one run: ``row:mode+setting@batching`` (DPO: ``row:dpo@static``)."""
    if setting.startswith("dpo@"):
        return f"{row}:{setting}"
    return f"{row}:{mode}+{setting}"


def _excluded(row: str) -> bool:
    """Whether ``row``'s target is the excluded objective (else the zeroed)."""
    return row == EXCLUDED_ROW


def _targets(pool: Any, case: Any, plan: list, cache: dict) -> dict:
    """Each run's target gradient, and ROLL's own one-rank (static, one micro-batch) gradient
    of each mode and setting, computed once per case."""
    if repr(case) in cache:
        return cache[repr(case)]
    wanted = sorted({(m, key.split("@")[0], _excluded(row)) for row, m, key in plan})
    refs = pool.run(roll_references, 1, case, wanted)[0]
    one_rank = parse_layout("dp1-m1").parallel()
    modes = tuple(dict.fromkeys(m for _, m, _ in plan))
    settings = tuple(dict.fromkeys(key.split("@")[0] for _, _, key in plan))
    own = pool.run(
        roll_layout_grads, 1, one_rank, case, modes, 1, (ROLL_ROW,), settings, ("static",)
    )[0]
    targets = {}
    for row, mode, key in plan:
        setting = key.split("@")[0]
        targets[(row, mode, key)] = refs[(mode, setting, _excluded(row))]
        if row == ROLL_ROW:
            targets[(SELF_ROW, mode, key)] = own[(ROLL_ROW, mode, f"{setting}@static")]
    cache[repr(case)] = targets
    return targets


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = roll_layout_grads,
    settings: Sequence[str] = tuple(SETTINGS),
    batchings: Sequence[str] = tuple(BATCHINGS),
) -> AuditReport:
    """Rows ``roll``, ``roll+lossfix`` and ``roll+lossfix+mask-in-loss`` (worst run per
    layout), one row per run (:func:`row_name`) and ``roll-vs-1rank:<run>``; ``worker`` runs on
    every rank (tests bypass the adapter through it)."""
    started = time.perf_counter()
    modes, settings, batchings = tuple(opts.modes), tuple(settings), tuple(batchings)
    plan = runs(modes, settings, batchings)
    worst_rows = [r for r in ROWS if any(row == r for row, _, _ in plan)]
    per_run = [row_name(*run) for run in plan]
    own = [row_name(SELF_ROW, m, s) for row, m, s in plan if row == ROLL_ROW]
    first = stack_case(opts, opts.layouts[0])
    options = {
        **options,
        "settings": {name: sorted(SETTINGS[name]) for name in settings},
        "batchings": list(batchings),
        "kept_tokens": {name: kept_tokens(first, name) for name in settings},
    }
    report = AuditReport(
        options=options,
        modes=[*worst_rows, *per_run, *own],
        layouts=[{**dataclasses.asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
        baselines=(ROLL_ROW, *(r for r in per_run if r.startswith(ROLL_ROW + ":")), *own),
    )
    bar = Progress(len(opts.layouts), progress)
    cache: dict[str, dict] = {}

    def measure(lay: MatrixLayout) -> None:
        case = stack_case(opts, lay)
        got = pool.run(
            worker, lay.world_size, lay.parallel(), case, modes, lay.num_microbatches,
            ROWS, settings, batchings,
        )[0]  # fmt: skip
        targets = _targets(pool, case, plan, cache)
        record_runs(report, opts.tolerance, lay, got, targets, released=ROLL_ROW, own=SELF_ROW,
                    name=row_name)  # fmt: skip

    each_layout(report, bar, [(lay,) for lay in opts.layouts], measure)
    report.elapsed_s = time.perf_counter() - started
    return report
