"""slime's own Megatron loss path under the audit (``--stack slime``), the adapter, and slime's
own loss tests with the adapter switched on.

The e2e tests run slime's ``loss_function`` and ``get_batch`` from the installed slime (installed
from its source: docs/slime.md) on the tiny GPT over two ranks and compare the gradient with
the one-rank reference of the exact objective (with slime's TIS rejection and OPSM, which drop
tokens inside its loss, under both meanings of a dropped token); they skip where slime is not
installed. slime's
own tests run from its source tree, which ``SLIME_SOURCE`` names (a clone or its ``git archive``
``.tar.gz``; CI sets it); they skip without it, and fail under CI (``helpers.inputs``). The unit
tests need neither.
"""

from __future__ import annotations

import importlib.util
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import own_tests
from helpers.inputs import needs_stack

from megatron_lossfix.audit.matrix import parse_layout
from megatron_lossfix.audit.options import AuditOptions
from megatron_lossfix.audit.oracle import relative_error
from megatron_lossfix.audit.stacks.slime import stack
from megatron_lossfix.audit.stacks.slime.objective import slime_references
from megatron_lossfix.audit.stacks.slime.ranks import EXCLUDED_ROW
from megatron_lossfix.integrations.slime import adapter

ROOT = Path(__file__).resolve().parents[1]
HAVE_SLIME = importlib.util.find_spec("slime") is not None
needs_slime = needs_stack(
    HAVE_SLIME,
    "slime",
    "slime is not installed (pip install --no-deps <slime source>, see docs/slime.md)",
)
TOL = 1e-5
#: slime's CPU loss tests (its tests/ folder), run unchanged with the adapter switched on.
SLIME_TESTS = ("test_loss_cp_invariance.py", "test_policy_loss.py", "test_cp_utils.py")
#: How many of them passed at slime's commit 624b824 (docs/slime.md): at least these must pass.
SLIME_TESTS_PASSING = 13


# ------------------------------------------------------------------------------ unit


@pytest.mark.unit
@pytest.mark.parametrize("per_token, mode", [(True, "token_mean"), (False, "group_mean")])
def test_slime_settings_map_to_the_plugin_modes(per_token, mode):
    config = adapter.lossfix_config_for(Namespace(calculate_per_token_loss=per_token))
    assert config.reduction == mode and config.self_check is False
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        adapter.lossfix_config_for(Namespace())


@pytest.mark.unit
def test_micro_batches_carry_response_masks_and_rollouts():
    masks = [torch.tensor([1, 1, 0]), torch.tensor([0, 0]), torch.tensor([1])]
    data = {"loss_masks": masks, "rollout_ids": [7, 7, 9]}
    it = SimpleNamespace(rollout_data=data, micro_batch_indices=[[0, 1], [2], [0]], offset=0)
    batches = list(adapter.plugin_micro_batches(it, 2, grouped=True))
    assert it.offset == 2  # slime's iterator moves past the step, as its own step moves it
    first, second = batches
    assert first["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]
    assert first["cu_seqlens"].tolist() == [0, 3, 5] and second["cu_seqlens"].tolist() == [0, 1]
    # Rollout ids shifted to start at 0 over the step; the range covers them all.
    assert first["group_ids"].tolist() == [0, 0] and second["group_ids"].tolist() == [2]
    assert first["num_groups"] == second["num_groups"] == 3
    assert "group_ids" not in next(adapter.plugin_micro_batches(it, 1, grouped=False))
    it.rollout_data = {"loss_masks": masks}
    with pytest.raises(ValueError, match="no 'rollout_ids'"):
        adapter.plugin_micro_batches(it, 1, grouped=True)


@pytest.mark.unit
def test_phantom_tokens_are_one_per_fully_masked_sample():
    case = stack.stack_case(AuditOptions(), parse_layout("dp2-m3"))
    data = stack.slime_rollout(case, 264, "per_token")
    empty = sum(int(m.sum() == 0) for m in data["loss_masks"])
    real = sum(int(m.sum()) for m in data["loss_masks"])
    figure = stack.phantom_tokens(case)
    assert empty == len(stack.MASKED_SAMPLES) and figure["phantom_tokens"] == empty
    assert figure["loss_tokens"] == real and figure["gradient_scale"] == real / (real + empty)


@pytest.mark.unit
def test_cp_layouts_also_run_in_slimes_allgather_layout():
    columns = stack._columns([parse_layout("dp2-m3"), parse_layout("cp2-m3")])
    assert [(lay.name, ag) for lay, ag in columns] == [
        ("dp2-m3", False),
        ("cp2-m3", False),
        ("cp2-m3" + stack.ALLGATHER, True),
    ]


@pytest.mark.unit
@needs_slime
def test_the_switch_answers_slimes_schedule_lookup():
    from slime.backends.megatron_utils import model as slime_model

    own = slime_model.get_forward_backward_func
    try:
        fbf = adapter.enable(Namespace(calculate_per_token_loss=True))
        assert slime_model.get_forward_backward_func() is fbf
        assert fbf.config.reduction == "token_mean"
    finally:
        slime_model.get_forward_backward_func = own


@pytest.mark.unit
def test_every_setting_runs_and_the_mask_in_loss_row_only_where_tokens_drop():
    plan = stack.runs(tuple(stack.MODES), tuple(stack.SETTINGS))
    assert {s for _, _, s in plan} == {"ppo", "tis", "opsm", "gspo"}
    assert {m for _, m, s in plan if s == "ppo"} == set(stack.MODES)
    assert {(m, s) for r, m, s in plan if r == EXCLUDED_ROW} == {
        (m, s) for m in ("per_rollout", "per_token") for s in ("tis", "opsm")
    }
    assert stack.row_name("slime", "per_token", "opsm") == "slime:per_token+opsm"
    assert stack.row_name("slime", "per_token", "ppo") == "slime:per_token"


@pytest.mark.unit
def test_mask_in_loss_switch_sets_the_plugins_excluded_meaning():
    args = Namespace(calculate_per_token_loss=True)
    assert adapter.lossfix_config_for(args, mask_in_loss=True).mask_in_loss is True
    assert adapter.lossfix_config_for(args).mask_in_loss is False
    args.lossfix_mask_in_loss = True  # the plugin's flag, where slime's parser has it
    assert adapter.lossfix_config_for(args).mask_in_loss is True


@pytest.mark.unit
@needs_slime
def test_custom_pg_loss_reducer_is_refused_in_one_line():
    from functools import partial

    args = Namespace(custom_pg_loss_reducer_function_path="my.reducer")
    slime_loss = partial(lambda *a: None, args, {})
    with pytest.raises(ValueError, match="drop --custom-pg-loss-reducer-function-path"):
        adapter.weighted_loss_function(slime_loss, torch.zeros(1, 1), torch.zeros(1))


@pytest.mark.unit
@needs_slime
def test_recomputed_loss_with_tis_is_refused_in_one_line():
    from functools import partial

    args = Namespace(recompute_loss_function=True, use_tis=True)
    slime_loss = partial(lambda *a: None, args, {})
    with pytest.raises(ValueError, match="drop --recompute-loss-function"):
        adapter.weighted_loss_function(slime_loss, torch.zeros(1, 1), torch.zeros(1))


# ------------------------------------------------------------------------------ e2e


@pytest.fixture(scope="module")
def slime_pool():
    from megatron_lossfix.audit.pool import DistPool

    pool = DistPool(max_ranks=2, timeout_s=180)
    yield pool
    pool.close()


def _errors(
    pool, worker, layout: str, allgather: bool, modes: tuple[str, ...], settings=("ppo",)
) -> dict:
    """Each run's error against its target: slime's rows against the zeroed objective (times
    slime's share), the adapter's against the zeroed one, the mask-in-loss rows against the
    excluded one; ``(row, mode, setting, "zeroed")`` also holds each adapted run against the
    other meaning (the two must differ where the loss drops tokens)."""
    lay = parse_layout(layout)
    case = stack.stack_case(AuditOptions(), lay)
    got = pool.run(
        worker, 2, lay.parallel(), case, modes, lay.num_microbatches, allgather,
        stack.ROWS, settings,
    )[0]  # fmt: skip
    wanted = sorted({(m, s, e) for _, m, s in got for e in (False, True)})
    refs = pool.run(slime_references, 1, case, wanted)[0]
    out = {}
    for (row, mode, setting), grads in got.items():
        excluded = row == EXCLUDED_ROW
        share = stack.slime_share(case, mode) if row == "slime" else 1.0
        ref = refs[(mode, setting, excluded)]
        out[(row, mode)] = out[(row, mode, setting)] = relative_error(
            grads, {k: v * share for k, v in ref.items()}
        )
        out[(row, mode, setting, "other")] = relative_error(
            grads, refs[(mode, setting, not excluded)]
        )
    return out


@needs_slime
@pytest.mark.e2e
@pytest.mark.parametrize("layout, allgather", [("dp2-m3", False), ("cp2-m3", True)])
def test_adapter_is_exact_and_slimes_per_token_count_is_not(slime_pool, layout, allgather):
    modes = ("per_rollout", "per_token")
    errors = _errors(slime_pool, stack.slime_layout_grads, layout, allgather, modes)
    for mode in modes:
        assert errors[("slime+lossfix", mode)] <= TOL, errors
    # slime's default setting is exact for what it means (every rollout counted) ...
    assert errors[("slime", "per_rollout")] <= TOL, errors
    # ... its per-token setting misses by its phantom tokens, one per fully masked sample.
    case = stack.stack_case(AuditOptions(), parse_layout(layout))
    phantom = 1 - stack.phantom_tokens(case)["gradient_scale"]
    assert abs(errors[("slime", "per_token")] - phantom) < 1e-4, (errors, phantom)


@needs_slime
@pytest.mark.e2e
def test_bypassing_the_adapter_fails_the_check(slime_pool):
    from helpers.slime_stack import bypassed_layout_grads

    errors = _errors(slime_pool, bypassed_layout_grads, "dp2-m3", False, ("per_token",))
    assert errors[("slime+lossfix", "per_token")] > 100 * TOL, errors


@needs_slime
@pytest.mark.e2e
def test_masks_decided_in_slimes_loss_are_exact_through_the_adapter(slime_pool):
    # slime's TIS rejection and OPSM drop tokens inside its loss; under ring CP (each rank a
    # zigzag shard of every sequence) with 3 micro-batches, in both of slime's settings.
    settings, modes = ("tis", "opsm"), ("per_rollout", "per_token")
    errors = _errors(slime_pool, stack.slime_layout_grads, "cp2-m3", False, modes, settings)
    for mode in modes:
        for setting in settings:
            for row in ("slime+lossfix", EXCLUDED_ROW):
                assert errors[(row, mode, setting)] <= TOL, errors
                # The two meanings of a dropped token differ by far more than rounding here.
                assert errors[(row, mode, setting, "other")] > 0.1, errors


@needs_slime
@pytest.mark.e2e
def test_mask_in_loss_switch_without_its_normalization_fails_the_check(slime_pool):
    from helpers.slime_stack import zeroed_mask_in_loss_grads

    modes = ("per_rollout", "per_token")
    errors = _errors(slime_pool, zeroed_mask_in_loss_grads, "dp2-m3", False, modes, ("opsm",))
    for mode in modes:
        assert errors[(EXCLUDED_ROW, mode, "opsm")] > 0.1, errors


@needs_slime
@pytest.mark.e2e
def test_slimes_own_loss_tests_pass_with_the_adapter_on(tmp_path):
    tree = own_tests.source_tree("SLIME_SOURCE", "slime's source: a clone, or its git archive",
                                 tmp_path)  # fmt: skip
    run = own_tests.run_own_tests(tree / "tests", SLIME_TESTS, "helpers.slime_stack")
    run.check(at_least=SLIME_TESTS_PASSING)
    report = run.report
    assert report["adapter"] == "LossFixForwardBackward (group_mean)", report
    assert report["still_on"], report
