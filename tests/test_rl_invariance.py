"""Gradient oracle for the full RL objective (policy + KL + entropy): PPO with dual clip and
GSPO, every invariant mode (``group_mean`` over prompt groups that straddle ranks and
micro-batches included), micro-batch counts 1 and 3, DP2, TP2, PP2 and CP2."""

from __future__ import annotations

import pytest

from megatron_lossfix.audit.matrix import check_layout
from megatron_lossfix.audit.oracle import OracleCase, layout_grads
from megatron_lossfix.audit.tiny_gpt import Layout

pytestmark = pytest.mark.oracle

TOL = 1e-5
MODES = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "sum", "group_mean", "off")
LAYOUTS = [
    ("dp1-m3", Layout(), 1, 3, {}),
    ("dp2-m1", Layout(), 2, 1, {}),
    ("dp2-m3", Layout(), 2, 3, {}),
    ("tp2-m3", Layout(tp=2), 2, 3, {}),
    ("pp2-m3", Layout(pp=2), 2, 3, {}),
    ("cp2-m3", Layout(cp=2), 2, 3, {"no_attention": True}),
]


@pytest.mark.parametrize("objective", ["ppo", "gspo"])
@pytest.mark.parametrize(
    "name, layout, world, m, model_kwargs", LAYOUTS, ids=[row[0] for row in LAYOUTS]
)
def test_rl_objective_gradient_is_layout_invariant(
    dist_pool, objective, name, layout, world, m, model_kwargs
):
    rl = {"kl_coef": 0.1, "entropy_coef": 0.01}
    if objective == "ppo":
        rl["dual_clip_c"] = 1.5  # low enough that the data triggers it
    case = OracleCase(objective=objective, model_kwargs=model_kwargs, rl_kwargs=rl)
    checks = check_layout(dist_pool, case, layout, world, m, MODES)
    errors = {mode: checks[mode]["error"] for mode in MODES}
    bad = {mode: err for mode, err in errors.items() if mode != "off" and err > TOL}
    assert not bad, f"{objective} {name}: {bad} (all: {errors})"
    for mode in MODES[:-1]:
        assert checks[mode]["loss"] == pytest.approx(checks[mode]["ref_loss"], rel=TOL, abs=1e-9)
    if world * m > 1 and layout.cp == 1:
        assert errors["off"] > 1e-3, f"{objective} {name}: stock unexpectedly exact: {errors}"
    # Every reported metric is a global value: the same as on one rank with one micro-batch.
    baseline = dist_pool.run(layout_grads, 1, Layout(), case, ("token_mean",), 1)[0]
    want = baseline["token_mean"]["metrics"]
    got = checks["token_mean"]["result"]["metrics"]
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (key, got, want)
    if objective == "ppo":
        # The data exercises every branch: both clip sides and the dual clip.
        assert min(want["clip_low_count"], want["clip_high_count"], want["dual_clip_count"]) > 0
