"""AReaL's own Megatron training step under the audit (``--stack areal``), the adapter, and
AReaL's own loss tests with the adapter switched on.

The e2e tests run AReaL's ``MegatronEngine.train_batch`` and ``grpo_loss_fn`` from the installed
areal (docs/areal.md) on the tiny GPT over two ranks and compare the gradient with the one-rank
reference of the exact objective; they skip where areal is not installed. AReaL's own tests run
from its source tree, which ``AREAL_TESTS`` names (a clone or the ``git archive`` ``.tar.gz`` of
its tests; CI sets it); they skip without it, and fail under CI (``helpers.inputs``). The unit
tests need neither.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import own_tests
from helpers.inputs import needs_stack

from megatron_lossfix.audit.matrix import parse_layout
from megatron_lossfix.audit.options import AuditOptions
from megatron_lossfix.audit.oracle import relative_error
from megatron_lossfix.audit.stacks.areal import objective, ranks, stack

ROOT = Path(__file__).resolve().parents[1]
HAVE_AREAL = importlib.util.find_spec("areal") is not None
needs_areal = needs_stack(
    HAVE_AREAL,
    "areal",
    "areal is not installed (docs/areal.md: the [areal] extra, then areal --no-deps)",
)
TOL = 1e-5
#: AReaL's CPU loss tests (its tests/ folder), run unchanged with the adapter switched on.
AREAL_TESTS = (
    "test_functional.py",
    "test_rejection_sampling.py",
    "test_ppo_stats.py",
    "test_reassemble_cp_logprobs.py",
    "test_prox_approx.py",
)
#: How many of them passed at AReaL's commit 4aef98d (docs/areal.md): at least these must pass.
AREAL_TESTS_PASSING = 149


# ------------------------------------------------------------------------------ unit


@pytest.mark.unit
def test_m2po_keep_drops_the_largest_second_moments_until_the_rest_is_below_the_threshold():
    old = torch.zeros(6)
    prox = torch.tensor([0.0, 0.1, 0.5, 0.05, 0.4, 0.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    keep = objective.m2po_keep(old, prox, mask)
    # m2 = 0, .01, .25, .0025, .16: all five average .0845, without .25 they average .043.
    assert keep.tolist() == [True, True, False, True, True, False]
    assert not objective.m2po_keep(old, prox, torch.zeros(6)).any()


@pytest.mark.unit
def test_the_batch_has_uneven_responses_and_fully_masked_samples():
    case = stack.stack_case(AuditOptions(), parse_layout("dp2-m3"))
    batch = stack.areal_batch(case, 264, "m2po")
    per_sample = batch["loss_mask"].sum(1)
    assert all(per_sample[i] == 0 for i in stack.MASKED_SAMPLES)
    assert len(set(per_sample.tolist())) > 5
    assert not torch.equal(batch["prox_logp"], batch["logprobs"])
    grpo = stack.areal_batch(case, 264, "grpo")
    assert torch.equal(grpo["prox_logp"], grpo["logprobs"])


@pytest.mark.unit
def test_mask_in_loss_row_only_for_the_settings_that_drop_tokens():
    plan = ranks.runs(("token_mean",), tuple(stack.SETTINGS))
    excluded = {s for row, _, s in plan if row == ranks.EXCLUDED_ROW}
    assert excluded == set(stack.DROPPING) == {"decoupled", "m2po"}
    assert stack.target_of("areal", "m2po") and not stack.target_of("areal", "decoupled")
    assert stack.target_of(ranks.EXCLUDED_ROW, "grpo")
    assert not stack.target_of(ranks.ADAPTED_ROW, "m2po")


@pytest.mark.unit
def test_kept_tokens_differ_where_the_loss_drops_tokens():
    case = stack.stack_case(AuditOptions(), parse_layout("dp1-m1"))
    counts = {s: objective.kept_tokens(case, s) for s in stack.SETTINGS}
    assert counts["grpo"]["kept_tokens"] == counts["grpo"]["loss_tokens"]
    for setting in stack.DROPPING:
        assert 0 < counts[setting]["kept_tokens"] < counts[setting]["loss_tokens"]


@pytest.mark.unit
def test_ci_runs_the_pages_install_line():
    """CI runs docs/areal.md's install line as printed (``noxfile.py``'s ``STACK_PAGES``; the
    line itself is read from the page: tests/test_readme_stacks.py), at AReaL's release."""
    from helpers import doc_pages

    (line,) = {ln for ln in doc_pages.bash_lines() if ".venv-areal/bin/pip install" in ln}
    assert '"docs/areal.md"' in ROOT.joinpath("noxfile.py").read_text()
    assert f"areal=={stack.MIN_VERSION}" in line


# ------------------------------------------------------------------------------ e2e


@pytest.fixture(scope="module")
def areal_pool():
    from megatron_lossfix.audit.pool import DistPool

    pool = DistPool(max_ranks=2, timeout_s=600)
    yield pool
    pool.close()


def _errors(pool, worker, layout: str, rows, settings) -> dict:
    """Each run's error against the zeroed and the excluded objective."""
    lay = parse_layout(layout)
    case = stack.stack_case(AuditOptions(), lay)
    got = pool.run(worker, lay.world_size, lay.parallel(), case, ("token_mean",),
                   lay.num_microbatches, rows, settings)[0]  # fmt: skip
    wanted = [(s, e) for s in settings for e in (False, True)]
    refs = pool.run(objective.areal_references, 1, case, wanted)[0]
    return {
        (row, setting, excluded): relative_error(grads, refs[(setting, excluded)])
        for (row, _, setting), grads in got.items()
        for excluded in (False, True)
    }


@needs_areal
@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["dp2-m3", "cp2-m3"])
def test_adapter_is_exact_and_areals_m2po_is_not(areal_pool, layout):
    settings = ("grpo", "m2po")
    err = _errors(areal_pool, ranks.areal_layout_grads, layout, ranks.ROWS, settings)
    assert err[("areal", "grpo", False)] < TOL  # AReaL's token mean is exact as released
    assert err[("areal", "m2po", True)] > 1e-2  # M2PO: per micro-batch choice and weight
    assert err[(ranks.ADAPTED_ROW, "grpo", False)] < TOL
    assert err[(ranks.ADAPTED_ROW, "m2po", False)] < TOL
    assert err[(ranks.EXCLUDED_ROW, "m2po", True)] < TOL
    # The two meanings differ: each row meets its own objective only.
    assert err[(ranks.EXCLUDED_ROW, "m2po", False)] > 1e-2


@needs_areal
@pytest.mark.e2e
def test_bypassing_the_adapter_fails_the_check(areal_pool):
    from helpers.areal_stack import bypassed_layout_grads

    err = _errors(areal_pool, bypassed_layout_grads, "dp2-m3", ranks.ROWS, ("m2po",))
    assert err[(ranks.ADAPTED_ROW, "m2po", False)] > 1e-2


@needs_areal
@pytest.mark.e2e
def test_mask_in_loss_switch_without_its_normalization_fails_the_check(areal_pool):
    from helpers.areal_stack import zeroed_mask_in_loss_grads

    err = _errors(areal_pool, zeroed_mask_in_loss_grads, "dp2-m3", ranks.ROWS, ("decoupled",))
    assert err[(ranks.EXCLUDED_ROW, "decoupled", True)] > 1e-2


@needs_areal
@pytest.mark.e2e
def test_areals_own_loss_tests_pass_with_the_adapter_on(tmp_path):
    tree = own_tests.source_tree("AREAL_TESTS", "AReaL's tests: a clone, or the git archive",
                                 tmp_path)  # fmt: skip
    # --noconftest: AReaL's conftest probes a network route this machine may not have.
    run = own_tests.run_own_tests(tree / "tests", AREAL_TESTS, "helpers.areal_stack",
                                  options=["--noconftest"])  # fmt: skip
    run.check(at_least=AREAL_TESTS_PASSING)
    report = run.report
    assert report["adapter"] == "train_batch (token_mean)" and report["still_on"], report
    # The adapter's rejection-sampling hook ran, through AReaL's own ppo_actor_loss_fn, and
    # recorded its mask. (None of these tests sets M2PO's threshold: the M2PO hook runs in the
    # stack audit above.)
    assert report["hook_calls"]["rejection"] >= 1, report
    assert "rejected" in report["hooks_recorded"], report
