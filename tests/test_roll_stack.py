"""ROLL's own Megatron training step under the audit (``--stack roll``), the adapter, and ROLL's
own loss tests with the adapter switched on.

The e2e tests run ROLL's ``MegatronTrainStrategy.train_step`` with the RLVR actor's and the DPO
worker's ``loss_func`` from the installed roll (docs/roll.md) on the tiny GPT over two ranks and
compare the gradient with the one-rank reference of the exact objective; they skip where roll is
not installed. ROLL's own tests run from its source tree, which ``ROLL_SOURCE`` names (a clone
or the ``git archive`` ``.tar.gz``; CI sets it); they skip without it, and fail under CI
(``helpers.inputs``). The unit tests need neither.
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
from megatron_lossfix.audit.stacks.roll import batch as rb
from megatron_lossfix.audit.stacks.roll import objective, ranks, stack

ROOT = Path(__file__).resolve().parents[1]
HAVE_ROLL = importlib.util.find_spec("roll") is not None and (
    importlib.util.find_spec("mcore_adapter") is not None
)
needs_roll = needs_stack(
    HAVE_ROLL,
    "roll",
    "roll is not installed (docs/roll.md: the [roll] extra, then ROLL's source --no-deps)",
)
TOL = 1e-5
#: ROLL's CPU tests of its loss functions and micro-batching, run unchanged with the adapter on.
ROLL_TESTS = (
    "utils/test_functionals.py",
    "agentic/test_segment_masked_mean.py",
    "utils/test_dynamic_batching.py",
    "utils/test_sequence_packing.py",
    "utils/test_compute_advantage.py",
)
#: How many of them passed at ROLL's commit 8eb27cc (docs/roll.md): at least these must pass.
ROLL_TESTS_PASSING = 22


# ------------------------------------------------------------------------------ unit


@pytest.mark.unit
def test_the_batch_has_uneven_responses_filtered_tokens_and_pairs():
    case = stack.stack_case(AuditOptions(), parse_layout("dp2-m3"))
    batch = rb.roll_batch(case, 264, "filter")
    per_sample = batch["response_mask"][:, 1:].sum(1)
    assert all(per_sample[i] == 0 for i in stack.MASKED_SAMPLES)
    assert len(set(per_sample.tolist())) > 5
    kept = objective.kept_tokens(case, "filter")
    assert 0.2 < 1 - kept["kept_tokens"] / kept["loss_tokens"] < 0.6, kept
    dpo = rb.roll_batch(case, 264, "dpo")
    lens = dpo["prompt_id_lens"]
    assert torch.equal(lens[0::2], lens[1::2])
    for i in range(0, 24, 2):  # a pair shares its prompt
        assert torch.equal(dpo["input_ids"][i, : lens[i]], dpo["input_ids"][i + 1, : lens[i]])


@pytest.mark.unit
def test_plan_runs_mask_in_loss_for_the_filter_and_dpo_once_statically():
    plan = ranks.runs(tuple(stack.MODES), tuple(stack.SETTINGS), tuple(stack.BATCHINGS))
    excluded = {key.split("@")[0] for row, _, key in plan if row == ranks.EXCLUDED_ROW}
    assert excluded == set(stack.DROPPING) == {"filter"}
    dpo = [run for run in plan if run[2].startswith("dpo")]
    assert {key for _, _, key in dpo} == {"dpo@static"} and len(dpo) == 2


@pytest.mark.unit
def test_adapter_modes_match_the_audits_objective_and_refuse_others():
    from megatron_lossfix.integrations.roll.adapter import plugin_mode

    for name, mode in stack.MODES.items():
        plugin, constant, divisor = plugin_mode(name, rb.STATIC_WIDTH, None)
        assert (plugin, constant) == (mode.plugin_mode, mode.norm_constant), name
        assert divisor == rb.DIVISOR.get(name, 1.0), name
    # Dr. GRPO's constant: the static width, whatever a micro-batch's width, or the user's.
    assert plugin_mode("seq-mean-token-sum-norm", 7, 4096.0)[2] == 4096.0
    with pytest.raises(ValueError, match="loss_agg_mode 'token-sum'.*choose from"):
        plugin_mode("token-sum", 31, None)


@pytest.mark.unit
def test_length_weights_average_one_and_fall_with_length():
    w = objective.length_weights(torch.tensor([0.0, 3.0, 6.0, 12.0]))
    assert torch.allclose(w.mean(), torch.tensor(1.0))
    assert torch.all(w[:-1] > w[1:])


@pytest.mark.unit
def test_ci_runs_the_pages_install_line():
    """CI runs docs/roll.md's install line as printed (``noxfile.py``'s ``STACK_PAGES``; the
    line itself is read from the page: tests/test_readme_stacks.py), from ROLL's source."""
    from helpers import doc_pages

    (line,) = {ln for ln in doc_pages.bash_lines() if ".venv-roll/bin/pip install" in ln}
    assert '"docs/roll.md"' in ROOT.joinpath("noxfile.py").read_text()
    assert "ROLL_SOURCE=" in ROOT.joinpath(".ci", "run").read_text()
    assert "--no-deps" in line and "$ROLL_SOURCE" in line and "megatron-core==0.18." in line


# ------------------------------------------------------------------------------ e2e


@pytest.fixture(scope="module")
def roll_pool():
    from megatron_lossfix.audit.pool import DistPool

    pool = DistPool(max_ranks=2, timeout_s=600)
    yield pool
    pool.close()


def _errors(pool, worker, layout: str, modes, settings, batchings, rows=ranks.ROWS) -> dict:
    """Each run's error against the zeroed and the excluded objective."""
    lay = parse_layout(layout)
    case = stack.stack_case(AuditOptions(), lay)
    got = pool.run(worker, lay.world_size, lay.parallel(), case, modes, lay.num_microbatches,
                   rows, settings, batchings)[0]  # fmt: skip
    wanted = sorted({(m, key.split("@")[0], e) for _, m, key in got for e in (False, True)})
    refs = pool.run(objective.roll_references, 1, case, wanted)[0]
    return {
        (row, mode, key, excluded): relative_error(grads, refs[(mode, key.split("@")[0], excluded)])
        for (row, mode, key), grads in got.items()
        for excluded in (False, True)
    }


@needs_roll
@pytest.mark.e2e
def test_adapter_is_exact_where_roll_is_not_under_cp(roll_pool):
    """CP2 (ROLL's ring slicing of whole rows, and packing's per-sample slicing), static and
    packed. (DP2 runs every mode, setting and batching in tests/test_readme_stacks.py: the
    page's audit command at dp2-m3, whose adapted rows must pass.)"""
    modes = ("token-mean", "seq-mean-token-sum-norm")
    batchings = ("static", "packed")
    err = _errors(roll_pool, ranks.roll_layout_grads, "cp2-m3", modes, ("filter", "length", "dpo"),
                  batchings)  # fmt: skip
    for (row, mode, key, excluded), e in err.items():
        if row == ranks.ADAPTED_ROW and not excluded:
            assert e < TOL, (row, mode, key, e)
        if row == ranks.EXCLUDED_ROW and excluded:
            assert e < TOL, (row, mode, key, e)
    for batching in batchings:
        # ROLL #444: the tokens the filter drops keep their token-mean gradient.
        assert err[("roll", "token-mean", f"filter@{batching}", False)] > 0.1
    # Length weights normalized per sample under packing; Dr. GRPO by the sample's padded width.
    assert err[("roll", "token-mean", "length@packed", False)] > 0.1
    assert err[("roll", "seq-mean-token-sum-norm", "filter@packed", False)] > 0.1
    # DPO: the mean of each micro-batch's pairs, x micro-batches x DP.
    assert err[("roll", "token-mean", "dpo@static", False)] > 1.0
    # The two meanings of a filtered token differ: each row meets its own objective only.
    assert err[(ranks.EXCLUDED_ROW, "token-mean", "filter@static", False)] > 0.1


@needs_roll
@pytest.mark.e2e
def test_adapter_is_exact_under_pp_with_dynamic_batching(roll_pool):
    """PP2: Megatron's pipeline schedule with the variable widths of dynamic batching."""
    err = _errors(roll_pool, ranks.roll_layout_grads, "pp2-m3", ("seq-mean-token-sum-norm",),
                  ("length",), ("dynamic",), rows=(ranks.ROLL_ROW, ranks.ADAPTED_ROW))  # fmt: skip
    assert err[(ranks.ADAPTED_ROW, "seq-mean-token-sum-norm", "length@dynamic", False)] < TOL
    assert err[(ranks.ROLL_ROW, "seq-mean-token-sum-norm", "length@dynamic", False)] > 0.1


@needs_roll
@pytest.mark.e2e
def test_bypassing_the_adapter_fails_the_check(roll_pool):
    from helpers.roll_stack import bypassed_layout_grads

    err = _errors(roll_pool, bypassed_layout_grads, "dp2-m3", ("seq-mean-token-sum-norm",),
                  ("filter",), ("dynamic",), rows=(ranks.ADAPTED_ROW,))  # fmt: skip
    assert err[(ranks.ADAPTED_ROW, "seq-mean-token-sum-norm", "filter@dynamic", False)] > 0.1
    err = _errors(roll_pool, bypassed_layout_grads, "dp2-m3", ("token-mean",), ("dpo",),
                  ("static",), rows=(ranks.ADAPTED_ROW,))  # fmt: skip
    assert err[(ranks.ADAPTED_ROW, "token-mean", "dpo@static", False)] > 1.0  # x M x DP


@needs_roll
@pytest.mark.e2e
def test_mask_in_loss_switch_without_its_normalization_fails_the_check(roll_pool):
    from helpers.roll_stack import zeroed_mask_in_loss_grads

    err = _errors(roll_pool, zeroed_mask_in_loss_grads, "dp2-m3", ("token-mean",), ("filter",),
                  ("static",), rows=(ranks.EXCLUDED_ROW,))  # fmt: skip
    assert err[(ranks.EXCLUDED_ROW, "token-mean", "filter@static", True)] > 1e-2


@needs_roll
@pytest.mark.e2e
def test_rolls_own_loss_tests_pass_with_the_adapter_on(tmp_path):
    tree = own_tests.source_tree("ROLL_SOURCE", "ROLL's source: a clone, or the git archive",
                                 tmp_path)  # fmt: skip
    run = own_tests.run_own_tests(tree / "tests", ROLL_TESTS, "helpers.roll_stack")
    run.check(at_least=ROLL_TESTS_PASSING)
    report = run.report
    assert report["still_on"], report
    # None of these tests calls agg_loss or a training step (ROLL's only test that does is a
    # GPU test of FSDP2): they show the switch leaves the rest of ROLL's loss code alone. The
    # adapted functions run in the tests above, through ROLL's own train_step.
    assert report["calls"] == {"agg_loss": 0}, report
