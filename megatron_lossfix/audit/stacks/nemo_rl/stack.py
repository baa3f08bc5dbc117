"""``--stack nemo-rl``: NeMo-RL's own Megatron policy worker under the audit's layouts.

What runs is NeMo-RL's code, unchanged, from its source (docs/nemo_rl.md):
``MegatronPolicyWorkerImpl.train`` (its step counts from ``process_global_batch``, its
micro-batches from ``get_microbatch_iterator``, ``megatron_forward_backward`` with its
``LossPostProcessor``: the loss divided by CP and multiplied by ``num_microbatches / CP``), its
loss functions (``batch``: the settings), and the split path ``begin_train_step`` /
``train_microbatch`` / ``finish_train_step`` (``ranks``), on megatron-core 0.20.0 (the
Megatron-LM tree at NeMo-RL's pin).

Rows per setting (``modes`` of the audit: ``--modes pg,vapo``): ``nemo-rl`` (as released)
against the exact objective (``objective``: the plugin's counts, one forward pass on one rank),
``nemo-rl-vs-1rank`` (against NeMo-RL's own one-rank, one-micro-batch gradient: its layout
dependence alone) and ``nemo-rl+lossfix`` (through :mod:`megatron_lossfix.integrations.nemo_rl`)
against the exact objective. Each setting runs through ``train()`` and, as ``<setting>+split``,
through the split path with three ``train_microbatch`` calls per DP rank (the adapter refuses
``vapo`` there: no adapted row). CP layouts, and those of :data:`ALSO_PACKED` once more, run
with NeMo-RL's sequence packing (``+packed``; ``train()`` only, DPO not: NeMo-RL refuses it).
The rows without a setting are the worst over them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from megatron_lossfix.audit.matrix import MatrixLayout, parse_layout
from megatron_lossfix.audit.report import AuditReport, Progress, each_layout
from megatron_lossfix.audit.stacks.modes import StackMode, record_runs
from megatron_lossfix.audit.stacks.nemo_rl.batch import LENGTHS, SETTINGS
from megatron_lossfix.audit.stacks.nemo_rl.objective import nemo_rl_reference
from megatron_lossfix.audit.stacks.nemo_rl.ranks import (
    ADAPTED_ROW,
    NEMO_RL_ROW,
    ROWS,
    nemo_rl_layout_grads,
)

__all__ = [
    "DISTRIBUTION", "LAYOUTS", "MODES", "PACKED", "SPLIT_CALLS", "columns", "row_name",
    "run_stack", "runs",
]  # fmt: skip

DISTRIBUTION = "nemo-rl"
#: How to install what the stack runs (NeMo-RL and its pins are not on the package index).
INSTALL = (
    'pip install -e ".[nemo-rl]" (from this clone), then python -m megatron_lossfix '
    'install-nemo-rl "$NEMO_RL_SOURCE" "$MEGATRON_BRIDGE_SOURCE" "$MEGATRON_LM_SOURCE" '
    "(docs/nemo_rl.md)"
)
SELF_ROW = "nemo-rl-vs-1rank"
#: Each setting and the plugin mode whose weights it means.
MODES: dict[str, StackMode] = {
    "pg": StackMode(plugin_mode="token_mean"),
    "gspo": StackMode(plugin_mode="sequence_mean"),
    "vapo": StackMode(plugin_mode="token_mean"),
    "nll": StackMode(plugin_mode="token_mean"),
    "dpo": StackMode(plugin_mode="pair_mean"),
    "distillation": StackMode(plugin_mode="token_mean"),
}
assert tuple(MODES) == SETTINGS
#: ``train_microbatch`` calls per DP rank on the split path.
SPLIT_CALLS = 3
#: Rows per micro-batch on the split path (DPO needs whole pairs in a micro-batch).
SPLIT_MBS = 2
#: Without ``--layouts``: one rank in one and three micro-batches, DP2, TP2, PP2, CP2.
LAYOUTS: tuple[str, ...] = (
    "dp1-m1", "dp1-m3", "dp2-m1", "dp2-m3", "tp2-m3", "pp2-m3", "cp2-m3",
)  # fmt: skip
#: The suffix of a column run with NeMo-RL's sequence packing (each micro-batch one THD row).
PACKED = "+packed"
#: Layouts that also run packed; a CP layout runs packed only (NeMo-RL shards a packed row).
ALSO_PACKED: tuple[str, ...] = ("dp1-m3",)
#: Settings that do not run packed: NeMo-RL's DPO refuses sequence packing (its #719).
NOT_PACKED: tuple[str, ...] = ("dpo",)
ROWS_OF_STEP = len(LENGTHS)


def row_name(row: str, path: str, setting: str) -> str:
    """``row:setting``, and ``+split`` for the split path."""
    return f"{row}:{setting}" + ("+split" if path == "split" else "")


def runs(settings: Sequence[str]) -> list[tuple[str, str, str]]:
    """Every ``(row, path, setting)`` a layout runs (``path``: ``train`` or ``split``)."""
    out = []
    for path in ("train", "split"):
        for setting in settings:
            for row in ROWS:
                if path == "split" and row == ADAPTED_ROW and setting == "vapo":
                    continue  # refused by the adapter (its module docstring)
                out.append((row, path, setting))
    return out


def columns(layouts: Sequence[MatrixLayout]) -> list[tuple[MatrixLayout, bool]]:
    """``(layout, packed)`` of each column: every layout without CP as it is, a CP layout and
    those of :data:`ALSO_PACKED` packed (named ``+packed``)."""
    out = []
    for lay in layouts:
        if lay.cp == 1:
            out.append((lay, False))
        if lay.cp > 1 or lay.name in ALSO_PACKED:
            out.append((dataclasses.replace(lay, name=lay.name + PACKED), True))
    return out


def _mbs(lay: MatrixLayout) -> int:
    per_rank = ROWS_OF_STEP // lay.dp
    if per_rank % lay.num_microbatches or (per_rank // lay.num_microbatches) % 2:
        raise ValueError(
            f"layout {lay.name}: the step's {ROWS_OF_STEP} rows give {per_rank} per DP rank; "
            f"m{lay.num_microbatches} must cut them into micro-batches of an even size (DPO pairs)"
        )
    return per_rank // lay.num_microbatches


def run_stack(
    opts: Any,
    options: dict[str, Any],
    *,
    pool: Any,
    progress: IO[str] | None,
    worker: Callable[..., Any] = nemo_rl_layout_grads,
) -> AuditReport:
    """Rows ``nemo-rl`` and ``nemo-rl+lossfix`` (worst run per layout), one row per run
    (:func:`row_name`) and ``nemo-rl-vs-1rank:<run>``; ``worker`` runs on every rank (tests
    bypass the adapter through it)."""
    started = time.perf_counter()
    settings = tuple(opts.modes)
    plan = runs(settings)
    per_run = [row_name(*run) for run in plan]
    own = [row_name(SELF_ROW, p, s) for row, p, s in plan if row == NEMO_RL_ROW]
    cols = columns(opts.layouts)
    report = AuditReport(
        options={**options, "rows_per_step": ROWS_OF_STEP, "split_calls": SPLIT_CALLS},
        modes=[*ROWS, *per_run, *own],
        layouts=[
            {**dataclasses.asdict(lay), "world_size": lay.world_size, "packed": packed}
            for lay, packed in cols
        ],  # fmt: skip
        baselines=(NEMO_RL_ROW, *(r for r in per_run if r.startswith(NEMO_RL_ROW + ":")), *own),
    )
    for lay, packed in cols:
        if not packed:
            continue
        for row in report.modes:
            if row.endswith("+split"):
                report.not_applicable[f"{row}@{lay.name}"] = "the split path runs unpacked"
            elif any(row.endswith(f":{s}") for s in NOT_PACKED):
                report.not_applicable[f"{row}@{lay.name}"] = "NeMo-RL's DPO refuses packing"
    bar = Progress(len(cols), progress)
    exact = pool.run(nemo_rl_reference, 1, settings)[0]
    one_rank = parse_layout("dp1-m1")
    train_runs = [(row, s) for row, p, s in plan if p == "train"]
    split_runs = [(row, s) for row, p, s in plan if p == "split"]
    mine = pool.run(
        worker, 1, one_rank.parallel(), [(NEMO_RL_ROW, s) for s in settings], ROWS_OF_STEP, 0
    )[0]
    targets: dict[tuple[str, str, str], Any] = {}
    for row, path, setting in plan:
        targets[(row, path, setting)] = exact[setting]
        if row == NEMO_RL_ROW:
            targets[(SELF_ROW, path, setting)] = mine[(NEMO_RL_ROW, setting)]

    def measure(lay: MatrixLayout, packed: bool) -> None:
        mine = [(row, s) for row, s in train_runs if not (packed and s in NOT_PACKED)]
        got = pool.run(worker, lay.world_size, lay.parallel(), mine, _mbs(lay), 0, packed)[0]
        results = {(row, "train", s): g for (row, s), g in got.items()}
        if not packed:  # the split path runs unpacked
            split = pool.run(worker, lay.world_size, lay.parallel(), split_runs, SPLIT_MBS,
                             SPLIT_CALLS)[0]  # fmt: skip
            results.update({(row, "split", s): g for (row, s), g in split.items()})
        wanted = {k: v for k, v in targets.items()
                  if (NEMO_RL_ROW if k[0] == SELF_ROW else k[0], *k[1:]) in results}  # fmt: skip
        record_runs(report, opts.tolerance, lay, results, wanted, released=NEMO_RL_ROW,
                    own=SELF_ROW, name=row_name)  # fmt: skip

    each_layout(report, bar, cols, measure)
    report.elapsed_s = time.perf_counter() - started
    return report
