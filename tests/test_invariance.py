"""Gradient oracle over the layout matrix: real Megatron-Core schedules, DDP and
finalize_model_grads on CPU/gloo, versus the one-rank one-micro-batch reference.

Every plugin mode must match to relative L2 <= 1e-5 under every layout; ``off`` (stock
Megatron) must miss on this variable-length data whenever the step has more than one
micro-batch in total, which shows that the check can fail. The layouts are the shared matrix
(``megatron_lossfix.audit.matrix``), which the audit command runs too.
"""

from __future__ import annotations

import pytest

from megatron_lossfix import REDUCTIONS
from megatron_lossfix.audit.matrix import (
    INVARIANCE_LAYOUTS,
    check_layout,
    compute_references,
    parse_layout,
    reference_jobs,
)
from megatron_lossfix.audit.oracle import OracleCase

pytestmark = pytest.mark.oracle

TOL = 1e-5
MODES = (*REDUCTIONS, "off")
CASE = OracleCase()
MATRIX = [parse_layout(name) for name in INVARIANCE_LAYOUTS]


@pytest.fixture(scope="module")
def references(dist_pool):
    """Every layout's references, each computed once (token_mean_legacy once per plan)."""
    placements = [(lay, CASE, lay.plan(CASE)) for lay in MATRIX]
    return compute_references(dist_pool, reference_jobs(MODES, placements))


@pytest.mark.parametrize("lay", MATRIX, ids=[lay.name for lay in MATRIX])
def test_gradient_matches_reference(dist_pool, references, lay):
    name = lay.name
    checks = check_layout(
        dist_pool,
        CASE,
        lay.parallel(),
        lay.world_size,
        lay.num_microbatches,
        MODES,
        refs=references,
    )
    errors = {mode: checks[mode]["error"] for mode in MODES}
    for mode in MODES:
        if mode != "off":
            # The reported loss is L of docs/design.md §2, the same global value under every layout.
            got, want = checks[mode]["loss"], checks[mode]["ref_loss"]
            assert got == pytest.approx(want, rel=TOL), f"{name} {mode}: loss {got} != {want}"
    failed = {mode: err for mode, err in errors.items() if mode != "off" and err > TOL}
    assert not failed, f"{name}: relative L2 gradient error above {TOL}: {failed} (all: {errors})"
    if lay.total_microbatches > 1:
        # Stock Megatron's mean of per-micro-batch means is not the token mean here.
        assert errors["off"] > 1e-3, f"{name}: `off` unexpectedly matched token_mean: {errors}"
    else:
        assert errors["off"] <= TOL, f"{name}: one micro-batch in all, off == token_mean: {errors}"
