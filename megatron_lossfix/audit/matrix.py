"""The layout matrix and its one driver, shared by the audit and the tests (docs/design.md §8).

A matrix layout is named by a small grammar, ``tp2-pp2-dp2-m3`` (see :func:`parse_layout`);
``INVARIANCE_LAYOUTS`` is the matrix the tests run, and the audit's defaults are a subset of it.

The driver runs a layout's training step in a :class:`~megatron_lossfix.audit.pool.DistPool`
(``oracle.layout_grads``) and compares every mode with its one-rank reference
(``oracle.reference_grads``). References are computed once per distinct (case, mode, plan) and
reused by every layout that needs them: only ``token_mean_legacy`` depends on how the step is cut
into micro-batches (its plan), and ``off`` is compared with the ``token_mean`` reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_lossfix.audit.oracle import (
    OracleCase,
    layout_grads,
    microbatch_plan,
    reference_grads,
    relative_error,
    row_settings,
)
from megatron_lossfix.audit.tiny_gpt import Layout
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.weights import canonical_mode

__all__ = [
    "AUDIT_LAYOUTS",
    "INVARIANCE_LAYOUTS",
    "LAYOUT_PRESETS",
    "MatrixLayout",
    "Plan",
    "ReferenceJob",
    "check_layout",
    "compute_references",
    "parse_layout",
    "plan_of",
    "reference_jobs",
    "reference_key",
]

#: Each DP rank's micro-batch sizes (``oracle.microbatch_plan``), hashable.
Plan = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class MatrixLayout:
    """One column of the matrix: a parallel layout and the micro-batches per DP rank."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dp: int = 1
    num_microbatches: int = 1
    ep: int = 1
    """Expert parallelism: a MoE model whose experts are split over the stage's DP ranks
    (Megatron's expert grid); it does not enter the world size."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def total_microbatches(self) -> int:
        """Micro-batches in the whole step (all DP ranks): with 1, stock Megatron is exact."""
        return self.dp * self.num_microbatches

    def parallel(self) -> Layout:
        """The tiny GPT's layout (the DP size follows from the world size)."""
        return Layout(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, dp=self.dp, ep=self.ep)

    def plan(self, case: OracleCase) -> Plan:
        """How this layout cuts ``case``'s step (:func:`plan_of`)."""
        return plan_of(case, self.parallel(), self.world_size, self.num_microbatches)


_LAYOUT_PART = re.compile(r"(vpp|tp|pp|cp|ep|dp|m)(\d+)")


def parse_layout(name: str) -> MatrixLayout:
    """``tp2-pp2-dp2-m3`` -> TP=2, PP=2, DP=2, 3 micro-batches per DP rank.

    Parts, joined by ``-`` in any order: ``tp<N>``, ``pp<N>``, ``vpp<N>`` (virtual stages per PP
    rank, interleaved 1F1B), ``cp<N>``, ``ep<N>`` (a MoE model, experts over the DP ranks),
    ``dp<N>`` (default 1) and ``m<N>`` (required).
    Raises ``ValueError`` for anything else.
    """
    values: dict[str, int] = {}
    for part in name.strip().split("-"):
        match = _LAYOUT_PART.fullmatch(part)
        if not match or match[1] in values or int(match[2]) < 1:
            raise ValueError(
                f"bad layout {name!r}: expected parts like tp2, pp2, vpp2, cp2, ep2, dp2 and m3 "
                f"(micro-batches per DP rank), each once and >= 1, joined by '-'"
            )
        values[match[1]] = int(match[2])
    if "m" not in values:
        raise ValueError(f"bad layout {name!r}: the micro-batch count m<N> is required")
    if "vpp" in values and values.get("pp", 1) < 2:
        raise ValueError(f"bad layout {name!r}: vpp needs pp >= 2")
    if values.get("ep", 1) > 1 and values.get("dp", 1) % values["ep"]:
        # Megatron's expert grid splits the experts over the stage's DP x CP ranks.
        raise ValueError(f"bad layout {name!r}: ep must divide dp (experts split over DP ranks)")
    return MatrixLayout(
        name=name.strip(),
        tp=values.get("tp", 1),
        pp=values.get("pp", 1),
        vpp=values.get("vpp"),
        cp=values.get("cp", 1),
        dp=values.get("dp", 1),
        num_microbatches=values["m"],
        ep=values.get("ep", 1),
    )


#: The matrix of docs/design.md §8 that ``tests/test_invariance.py`` runs: micro-batch counts
#: 1, 3, 4 under DP 1, 2, 3, then TP2, PP2 (1F1B and interleaved) and TP2 x PP2 x DP2. CP, EP and
#: the uneven and empty cases need other data or models: ``tests/test_hard_layouts.py``.
INVARIANCE_LAYOUTS: tuple[str, ...] = (
    "dp1-m1",
    "dp1-m3",
    "dp1-m4",
    "dp2-m1",
    "dp2-m3",
    "dp2-m4",
    "dp3-m1",
    "dp3-m4",
    "tp2-m3",
    "pp2-m4",
    "pp2-vpp2-m4",
    "tp2-pp2-dp2-m3",
)
#: The audit's default: DP (2 and 3 ranks), TP, CP, 1F1B and interleaved PP and a 3-D layout,
#: under a minute on 2 cores.
AUDIT_LAYOUTS: tuple[str, ...] = (
    "dp2-m3",
    "dp3-m4",
    "tp2-m3",
    "pp2-m4",
    "pp2-vpp2-m4",
    "cp2-m3",
    "tp2-pp2-dp2-m3",
)
#: Named layouts the audit shows in ``--help`` (any name of the grammar is accepted): the
#: one-rank and one-micro-batch layouts, where stock Megatron is exact or nearly, then the
#: defaults.
LAYOUT_PRESETS: tuple[str, ...] = ("dp1-m1", "dp1-m4", "dp2-m1", *AUDIT_LAYOUTS)


# ------------------------------------------------------------------------------ the driver


def plan_of(case: OracleCase, layout: Layout, world: int, num_microbatches: int) -> Plan:
    """How ``layout`` on ``world`` ranks cuts the step: each DP rank's micro-batch sizes."""
    dp = world // (layout.tp * layout.pp * layout.cp)
    return tuple(tuple(sizes) for sizes in microbatch_plan(case, dp, num_microbatches))


@dataclass(frozen=True)
class ReferenceJob:
    """One reference to compute; ``label`` names the first layout that needed it."""

    label: Hashable
    case: OracleCase
    mode: str
    plan: Plan | None


def reference_key(case: OracleCase, mode: str, plan: Plan) -> tuple[str, str, Plan | None]:
    """The key of ``case``'s reference for ``mode`` (a matrix row: its variants share their
    mode's reference) under ``plan`` in :func:`compute_references`."""
    mode = row_settings(mode)[0]
    # OracleCase holds dicts (unhashable); its repr lists every field, so it identifies the case.
    if mode != "off" and mode_of(mode).split_dependent:  # its weights depend on the plan
        return (repr(case), mode, plan)
    return (repr(case), "token_mean" if mode == "off" else canonical_mode(mode), None)


def reference_jobs(
    modes: Sequence[str], placements: Iterable[tuple[Hashable, OracleCase, Plan]]
) -> dict[tuple, ReferenceJob]:
    """The distinct references that ``modes`` need over ``(label, case, plan)`` placements."""
    jobs: dict[tuple, ReferenceJob] = {}
    for label, case, plan in placements:
        for mode in modes:
            key = reference_key(case, mode, plan)
            jobs.setdefault(key, ReferenceJob(label, case, key[1], key[2]))
    return jobs


def compute_references(
    pool: Any,
    jobs: dict[tuple, ReferenceJob],
    on_job: Callable[[ReferenceJob, bool], None] | None = None,
) -> dict[tuple, dict[str, Any]]:
    """Compute every job on one rank of ``pool``; ``on_job(job, done)`` hears before and after
    each (the audit's progress)."""
    refs = {}
    for key, job in jobs.items():
        if on_job is not None:
            on_job(job, False)
        refs[key] = pool.run(reference_grads, 1, job.case, job.mode, job.plan)[0]
        if on_job is not None:
            on_job(job, True)
    return refs


def check_layout(
    pool: Any,
    case: OracleCase,
    layout: Layout,
    world: int,
    num_microbatches: int,
    modes: Sequence[str],
    *,
    refs: dict[tuple, dict[str, Any]] | None = None,
    worker: Callable[..., Any] = layout_grads,
) -> dict[str, dict[str, Any]]:
    """Run ``layout`` on ``world`` ranks of ``pool`` (``worker`` on every rank) and compare each
    mode with its reference: per mode the gradient's relative error, the reported and reference
    loss, and the raw result and reference for further checks.

    ``refs``: references shared by several layouts (:func:`compute_references`); without them
    this layout's own are computed first.
    """
    plan = plan_of(case, layout, world, num_microbatches)
    if refs is None:
        refs = compute_references(pool, reference_jobs(modes, [(None, case, plan)]))
    results = pool.run(worker, world, layout, case, tuple(modes), num_microbatches)[0]
    checks = {}
    for mode in modes:
        ref = refs[reference_key(case, mode, plan)]
        checks[mode] = {
            "error": relative_error(results[mode]["grads"], ref["grads"]),
            "loss": results[mode]["metrics"]["loss"],
            "ref_loss": ref["loss"],
            "result": results[mode],
            "reference": ref,
        }
    return checks
