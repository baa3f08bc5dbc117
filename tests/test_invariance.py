"""Gradient oracle over the layout matrix: real Megatron-Core schedules, DDP and
finalize_model_grads on CPU/gloo, versus the one-rank one-micro-batch reference.

Every plugin mode must match to relative L2 <= 1e-5 under every layout; ``off`` (stock
Megatron) must miss on this variable-length data whenever the step has more than one
micro-batch in total, which shows that the check can fail.
"""

from __future__ import annotations

import pytest

from megatron_lossfix import REDUCTIONS
from megatron_lossfix.testing.oracle import (
    OracleCase,
    layout_grads,
    microbatch_plan,
    reference_grads,
    relative_error,
)
from megatron_lossfix.testing.tiny_gpt import Layout

TOL = 1e-5
MODES = (*REDUCTIONS, "off")
CASE = OracleCase()

# (id, layout, world size, micro-batches per DP rank)
MATRIX = [
    ("dp1-m1", Layout(), 1, 1),
    ("dp1-m3", Layout(), 1, 3),
    ("dp1-m4", Layout(), 1, 4),
    ("dp2-m1", Layout(), 2, 1),
    ("dp2-m3", Layout(), 2, 3),
    ("dp2-m4", Layout(), 2, 4),
    ("dp3-m1", Layout(), 3, 1),
    ("dp3-m4", Layout(), 3, 4),
    ("tp2-m3", Layout(tp=2), 2, 3),
    ("pp2-1f1b-m4", Layout(pp=2), 2, 4),
    ("pp2-interleaved-m4", Layout(pp=2, vpp=2), 2, 4),
    ("tp2-pp2-dp2-m3", Layout(tp=2, pp=2), 8, 3),
]


def _references(case: OracleCase, plans: list[tuple[tuple[int, ...], ...]]) -> dict:
    refs = {mode: reference_grads(case, mode) for mode in MODES if mode != "token_mean_legacy"}
    for plan in plans:
        refs[("token_mean_legacy", plan)] = reference_grads(case, "token_mean_legacy", plan)
    return refs


def _plan(world: int, layout: Layout, m: int) -> tuple[tuple[int, ...], ...]:
    dp = world // (layout.tp * layout.pp * layout.cp)
    return tuple(tuple(sizes) for sizes in microbatch_plan(CASE, dp, m))


@pytest.fixture(scope="module")
def references(dist_pool):
    plans = sorted({_plan(w, lay, m) for _, lay, w, m in MATRIX})
    return dist_pool.run(_references, 1, CASE, plans)[0]


@pytest.mark.parametrize("name, layout, world, m", MATRIX, ids=[row[0] for row in MATRIX])
def test_gradient_matches_reference(dist_pool, references, name, layout, world, m):
    results = dist_pool.run(layout_grads, world, layout, CASE, MODES, m)[0]
    errors = {}
    for mode in MODES:
        key = (
            ("token_mean_legacy", _plan(world, layout, m))
            if (mode == "token_mean_legacy")
            else mode
        )
        errors[mode] = relative_error(results[mode]["grads"], references[key]["grads"])
        if mode != "off":
            # The reported loss is L of docs/design.md §2, the same global value under every layout.
            got, want = results[mode]["metrics"]["loss"], references[key]["loss"]
            assert got == pytest.approx(want, rel=TOL), f"{name} {mode}: loss {got} != {want}"
    failed = {mode: err for mode, err in errors.items() if mode != "off" and err > TOL}
    assert not failed, f"{name}: relative L2 gradient error above {TOL}: {failed} (all: {errors})"
    dp = world // (layout.tp * layout.pp * layout.cp)
    if dp * m > 1:
        # Stock Megatron's mean of per-micro-batch means is not the token mean here.
        assert errors["off"] > 1e-3, f"{name}: `off` unexpectedly matched token_mean: {errors}"
    else:
        assert errors["off"] <= TOL, f"{name}: one micro-batch in all, off == token_mean: {errors}"
