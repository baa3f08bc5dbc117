"""``--stack areal``: AReaL's own Megatron training step under the audit's layouts.

What runs is AReaL's code, unchanged, from the installed ``areal`` (docs/areal.md):
``MegatronEngine.train_batch`` (``areal/engine/megatron_engine.py``: ``_prepare_mb_list``,
``compute_total_loss_weight`` from ``engine/core/train_engine.py``, ``forward_backward_batch``,
``_compute_logprobs_and_loss`` with its scaling ``local / total x DP x micro-batches``) and the
PPO actor's loss ``grpo_loss_fn`` (``trainer/ppo/actor.py``, with ``ppo_actor_loss_fn`` and
rejection sampling from ``utils/functional``), weighted as AReaL's ``ppo_update`` weighs it
(``loss_mask.count_nonzero()``), on the audit's tiny GPT under Megatron-Core's schedules.

The modules beside this one: ``batch`` (the step's data and AReaL's settings ``grpo``,
``decoupled``, ``m2po``), ``ranks`` (what each rank runs: the engine, the switch),
``objective`` (the exact objective of each setting, on one rank).

Rows per setting: ``areal`` (as released) against the exact objective in AReaL's meaning
(``objective.MEANING``: M2PO's mean over the tokens it keeps, chosen over the step),
``areal-vs-1rank`` (against AReaL's own one-rank, one-micro-batch gradient: its layout
dependence alone), ``areal+lossfix`` (:mod:`megatron_lossfix.integrations.areal`, its default
switch) against the zeroed objective, and, for the settings that drop tokens inside the loss,
``areal+lossfix+mask-in-loss`` (``enable(mask_in_loss=True)``) against the excluded one. Row
names carry the setting (``areal+lossfix:m2po``); the rows without one are the worst over them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from megatron_lossfix.audit.matrix import MatrixLayout, parse_layout
from megatron_lossfix.audit.report import AuditReport, Progress, each_layout
from megatron_lossfix.audit.stacks.areal.batch import (
    DROPPING,
    MASKED_SAMPLES,
    MODES,
    SETTINGS,
    areal_batch,
    stack_case,
)
from megatron_lossfix.audit.stacks.areal.objective import (
    MEANING,
    areal_references,
    kept_tokens,
)
from megatron_lossfix.audit.stacks.areal.ranks import (
    ADAPTED_ROW,
    AREAL_ROW,
    EXCLUDED_ROW,
    ROWS,
    areal_layout_grads,
    runs,
)
from megatron_lossfix.audit.stacks.modes import record_runs

__all__ = [
    "ADAPTED_ROW",
    "AREAL_ROW",
    "DISTRIBUTION",
    "DROPPING",
    "EXCLUDED_ROW",
    "LAYOUTS",
    "MASKED_SAMPLES",
    "MODES",
    "ROWS",
    "SELF_ROW",
    "SETTINGS",
    "areal_batch",
    "areal_layout_grads",
    "row_name",
    "run_stack",
    "stack_case",
    "target_of",
]

DISTRIBUTION = "areal"
#: The AReaL release whose Megatron step this stack was measured on.
MIN_VERSION = "1.0.4"
INSTALL = 'pip install -e ".[areal]" (from this clone; docs/areal.md)'
SELF_ROW = "areal-vs-1rank"
#: ``--stack areal`` without ``--layouts``: one rank, odd micro-batch counts, DP, PP, TP, CP.
#: (AReaL rounds the micro-batch count up to a multiple of PP, at least 2 x PP.)
LAYOUTS: tuple[str, ...] = ("dp1-m1", "dp1-m3", "dp2-m3", "pp2-m4", "tp2-m3", "cp2-m3")


def row_name(row: str, mode: str, setting: str) -> str:
    """The report's row of one run: ``row:setting`` (AReaL has one mode, ``token_mean``)."""
    return f"{row}:{setting}"


def target_of(row: str, setting: str) -> bool:
    """Whether ``row``'s target in ``setting`` is the excluded objective (else the zeroed)."""
    if row == AREAL_ROW:
        return MEANING[setting]
    return row == EXCLUDED_ROW


def _targets(pool: Any, case: Any, plan: list, cache: dict) -> dict:
    """Each run's target gradient, and AReaL's own one-rank gradient of each setting, computed
    once per case."""
    if repr(case) in cache:
        return cache[repr(case)]
    settings = tuple(dict.fromkeys(s for _, _, s in plan))
    modes = tuple(dict.fromkeys(m for _, m, _ in plan))
    wanted = sorted({(s, target_of(row, s)) for row, _, s in plan})
    refs = pool.run(areal_references, 1, case, wanted)[0]
    one_rank = parse_layout("dp1-m1").parallel()
    own = pool.run(areal_layout_grads, 1, one_rank, case, modes, 1, (AREAL_ROW,), settings)[0]
    targets = {}
    for row, mode, setting in plan:
        targets[(row, mode, setting)] = refs[(setting, target_of(row, setting))]
        if row == AREAL_ROW:
            targets[(SELF_ROW, mode, setting)] = own[(AREAL_ROW, mode, setting)]
    cache[repr(case)] = targets
    return targets


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = areal_layout_grads,
    settings: Sequence[str] = tuple(SETTINGS),
) -> AuditReport:
    """Rows ``areal``, ``areal+lossfix`` and ``areal+lossfix+mask-in-loss`` (worst run per
    layout), one row per run (:func:`row_name`) and ``areal-vs-1rank:<run>``; ``worker`` runs
    on every rank (tests bypass the adapter through it)."""
    started = time.perf_counter()
    modes, settings = tuple(opts.modes), tuple(settings)
    plan = runs(modes, settings)
    worst_rows = [r for r in ROWS if any(row == r for row, _, _ in plan)]
    per_run = [row_name(*run) for run in plan]
    own = [row_name(SELF_ROW, m, s) for row, m, s in plan if row == AREAL_ROW]
    first = stack_case(opts, opts.layouts[0])
    options = {
        **options,
        "settings": {name: sorted(SETTINGS[name]) for name in settings},
        "kept_tokens": {name: kept_tokens(first, name) for name in settings},
    }
    report = AuditReport(
        options=options,
        modes=[*worst_rows, *per_run, *own],
        layouts=[{**dataclasses.asdict(lay), "world_size": lay.world_size} for lay in opts.layouts],
        baselines=(AREAL_ROW, *(r for r in per_run if r.startswith(AREAL_ROW + ":")), *own),
    )
    bar = Progress(len(opts.layouts), progress)
    cache: dict[str, dict] = {}

    def measure(lay: MatrixLayout) -> None:
        case = stack_case(opts, lay)
        got = pool.run(
            worker, lay.world_size, lay.parallel(), case, modes, lay.num_microbatches,
            ROWS, settings,
        )[0]  # fmt: skip
        targets = _targets(pool, case, plan, cache)
        record_runs(report, opts.tolerance, lay, got, targets, released=AREAL_ROW, own=SELF_ROW,
                    name=row_name)  # fmt: skip

    each_layout(report, bar, [(lay,) for lay in opts.layouts], measure)
    report.elapsed_s = time.perf_counter() - started
    return report
