"""``--stack slime``: slime's own Megatron loss path under the audit's layouts.

What runs is slime's code, unchanged, from the installed package (slime is installed from its
source: docs/slime.md):

* ``slime.backends.megatron_utils.data``: ``DataIterator`` (each DP rank's micro-batches by
  sample index) and ``get_batch`` (packing into one THD row, both context-parallel layouts:
  the zigzag ring slicing and ``--allgather-cp``, the loss masks);
* ``slime.backends.megatron_utils.loss.loss_function``: ``policy_loss_function`` (PPO clip,
  entropy bonus, ``low_var_kl`` KL loss), the reducer ``get_sum_of_sample_mean`` with the
  step's ``rollout_mask_sums``, and its normalization: ``num_microbatches /
  step_global_batch_size x (DP x CP)`` by default, ``x CP`` with ``num_tokens =
  sum(clamp_min(loss_mask.sum(), 1))`` under ``--calculate-per-token-loss``.

The modules beside this one: ``batch`` (the step's data and slime's settings: modes, ``ppo``,
``tis``, ``opsm``, ``gspo``), ``ranks`` (what each rank runs: slime's ``forward_step`` restated,
the schedule slime looks up, the switch), ``objective`` (the exact objective of each setting, on
one rank).

Rows per mode and setting: ``slime`` (as released) against the exact objective of its setting
(the plugin's weights of the loss masks, tokens the loss drops zeroed; for the default setting
times (rollouts with a loss token / all rollouts), since slime divides by every rollout of the
step), ``slime-vs-1rank`` (against slime's own one-rank, one-micro-batch gradient: its layout
dependence alone), ``slime+lossfix`` (:mod:`megatron_lossfix.integrations.slime`, its default
switch) against the plugin's exact objective, and, for the settings that drop tokens inside the
loss (``tis``, ``opsm``), ``slime+lossfix+mask-in-loss`` (the switch ``enable_mask_in_loss``)
against the objective whose weights count only the kept tokens. Row names carry the mode and,
beyond ``ppo``, the setting (``slime+lossfix:per_token+opsm``); the rows without one are the
worst over them. Context parallel layouts run in both of slime's CP layouts: ``cp2-m3`` (ring,
zigzag) and ``cp2-m3+allgather``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from megatron_lossfix.audit.matrix import MatrixLayout, parse_layout
from megatron_lossfix.audit.report import AuditReport, Progress, each_layout
from megatron_lossfix.audit.stacks.modes import record_runs
from megatron_lossfix.audit.stacks.slime.batch import (
    MASKED_SAMPLES,
    MODES,
    SETTINGS,
    phantom_tokens,
    slime_args,
    slime_rollout,
    stack_case,
)
from megatron_lossfix.audit.stacks.slime.objective import (
    slime_reference,
    slime_references,
    slime_share,
)
from megatron_lossfix.audit.stacks.slime.ranks import (
    EXCLUDED_ROW,
    ROWS,
    SLIME_ROW,
    runs,
    slime_layout_grads,
)

__all__ = [
    "ALLGATHER",
    "DISTRIBUTION",
    "LAYOUTS",
    "MASKED_SAMPLES",
    "MODES",
    "ROWS",
    "SETTINGS",
    "phantom_tokens",
    "row_name",
    "run_stack",
    "slime_args",
    "slime_layout_grads",
    "slime_reference",
    "slime_rollout",
    "slime_share",
    "stack_case",
]

DISTRIBUTION = "slime"
#: The slime release whose loss path this stack was measured on (its source at 624b824).
MIN_VERSION = "0.3.1"
#: How to install what the stack runs (slime is not on the package index).
INSTALL = (
    "pip install -e .[slime] (from this clone), then slime from its source: "
    'pip install --no-deps "$SLIME_SOURCE" (a clone of THUDM/slime; docs/slime.md)'
)
SELF_ROW = "slime-vs-1rank"
#: The suffix of a CP layout run in slime's ``--allgather-cp`` layout.
ALLGATHER = "+allgather"
#: ``--stack slime`` without ``--layouts``: one rank, DP, PP, TP and CP (both CP layouts).
LAYOUTS: tuple[str, ...] = ("dp1-m1", "dp2-m3", "pp2-m3", "tp2-m3", "cp2-m3")


def row_name(row: str, mode: str, setting: str) -> str:
    """The report's row of one run: ``row:mode``, and ``+setting`` beyond ``ppo``."""
    return f"{row}:{mode}" + ("" if setting == "ppo" else f"+{setting}")


def _columns(layouts: Sequence[MatrixLayout]) -> list[tuple[MatrixLayout, bool]]:
    """Each layout, and CP layouts once more in slime's ``--allgather-cp`` layout."""
    out = []
    for lay in layouts:
        out.append((lay, False))
        if lay.cp > 1:
            out.append((dataclasses.replace(lay, name=lay.name + ALLGATHER), True))
    return out


def _targets(pool: Any, case: Any, plan: list, cache: dict) -> dict:
    """Each run's target gradient (module docstring), and slime's own one-rank gradient of
    each (mode, setting), computed once per case."""
    if repr(case) in cache:
        return cache[repr(case)]
    modes = tuple(dict.fromkeys(m for _, m, _ in plan))
    settings = tuple(dict.fromkeys(s for _, _, s in plan))
    wanted = sorted({(m, s, row == EXCLUDED_ROW) for row, m, s in plan})
    refs = pool.run(slime_references, 1, case, wanted)[0]
    one_rank = parse_layout("dp1-m1").parallel()
    own = pool.run(slime_layout_grads, 1, one_rank, case, modes, 1, False, (SLIME_ROW,), settings)
    targets = {}
    for row, mode, setting in plan:
        ref = refs[(mode, setting, row == EXCLUDED_ROW)]
        share = slime_share(case, mode) if row == SLIME_ROW else 1.0
        targets[(row, mode, setting)] = {k: v * share for k, v in ref.items()}
        if row == SLIME_ROW:
            targets[(SELF_ROW, mode, setting)] = own[0][(SLIME_ROW, mode, setting)]
    cache[repr(case)] = targets
    return targets


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = slime_layout_grads,
) -> AuditReport:
    """Rows ``slime``, ``slime+lossfix`` and ``slime+lossfix+mask-in-loss`` (worst run per
    layout), one row per run (:func:`row_name`) and ``slime-vs-1rank:<run>``; ``worker`` runs
    on every rank (tests bypass the adapter through it)."""
    started = time.perf_counter()
    modes, settings = tuple(opts.modes), tuple(SETTINGS)
    plan = runs(modes, settings)
    columns = _columns(opts.layouts)
    worst_rows = [r for r in ROWS if any(row == r for row, _, _ in plan)]
    per_run = [row_name(*run) for run in plan]
    own = [row_name(SELF_ROW, m, s) for row, m, s in plan if row == SLIME_ROW]
    options = {
        **options,
        "phantom_tokens": phantom_tokens(stack_case(opts, opts.layouts[0])),
        "settings": {name: sorted(SETTINGS[name]) for name in settings},
    }
    report = AuditReport(
        options=options,
        modes=[*worst_rows, *per_run, *own],
        layouts=[
            {**dataclasses.asdict(lay), "world_size": lay.world_size, "allgather_cp": ag}
            for lay, ag in columns
        ],
        baselines=(SLIME_ROW, *(r for r in per_run if r.startswith(SLIME_ROW + ":")), *own),
    )
    bar = Progress(len(columns), progress)
    cache: dict[str, dict] = {}

    def measure(lay: MatrixLayout, allgather: bool) -> None:
        case = stack_case(opts, lay)
        got = pool.run(
            worker, lay.world_size, lay.parallel(), case, modes, lay.num_microbatches,
            allgather, ROWS, settings,
        )[0]  # fmt: skip
        targets = _targets(pool, case, plan, cache)
        record_runs(report, opts.tolerance, lay, got, targets, released=SLIME_ROW, own=SELF_ROW,
                    name=row_name)  # fmt: skip

    each_layout(report, bar, columns, measure)
    report.elapsed_s = time.perf_counter() - started
    return report
