"""SkyRL's own Megatron loss path under the audit (``--stack skyrl``) and the adapter.

The e2e tests run SkyRL 0.4.0's ``MegatronModelWrapper`` from its package on the tiny GPT over
two DP ranks with three micro-batches each, KL and entropy on, and compare the gradient with the
one-rank reference of the exact objective. They skip where SkyRL is not installed
(``pip install -e .[skyrl]``). The unit tests check the mapping and the report without SkyRL.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from helpers.inputs import needs_stack

from megatron_lossfix.audit.matrix import parse_layout
from megatron_lossfix.audit.options import AuditOptions
from megatron_lossfix.audit.oracle import microbatch_plan, relative_error
from megatron_lossfix.integrations.skyrl.adapter import SKYRL_MODES, lossfix_config_for

HAVE_SKYRL = importlib.util.find_spec("skyrl") is not None
needs_skyrl = needs_stack(HAVE_SKYRL, "skyrl", "SkyRL is not installed (pip install -e .[skyrl])")
TOL = 1e-5


# ------------------------------------------------------------------------------ unit


@pytest.mark.unit
@pytest.mark.parametrize("mode", sorted(SKYRL_MODES))
def test_every_skyrl_mode_maps_to_the_plugin_mode_of_its_name(mode):
    config = lossfix_config_for(SimpleNamespace(loss_reduction=mode, max_seq_len=16))
    # prompt_mean is the alias of group_mean.
    assert config.reduction == {"prompt_mean": "group_mean"}.get(mode, mode)
    assert config.norm_constant == (16 if mode == "seq_mean_token_sum_norm" else None)


@pytest.mark.unit
def test_unknown_skyrl_mode_and_missing_max_seq_len_are_refused():
    with pytest.raises(ValueError, match="batch_mean"):
        lossfix_config_for(SimpleNamespace(loss_reduction="batch_mean", max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        lossfix_config_for(
            SimpleNamespace(loss_reduction="seq_mean_token_sum_norm", max_seq_len=None)
        )


@pytest.mark.unit
def test_group_ids_follow_skyrl_prompt_boundaries():
    from megatron_lossfix.integrations.skyrl.adapter import group_ids_from_boundaries

    ids = group_ids_from_boundaries([(0, 2), (2, 5), (5, 6)], 6)
    assert ids.tolist() == [0, 0, 1, 1, 1, 2] and ids.dtype == torch.long
    with pytest.raises(ValueError, match="row 5 of the mini-batch belongs to no prompt"):
        group_ids_from_boundaries([(0, 2), (2, 5)], 6)
    with pytest.raises(ValueError, match="overlaps"):
        group_ids_from_boundaries([(0, 3), (2, 6)], 6)


@pytest.mark.unit
def test_ep_layouts_parse_and_audit_a_moe_model():
    lay = parse_layout("ep2-dp2-m3")
    assert (lay.ep, lay.dp, lay.world_size) == (2, 2, 2)
    assert lay.parallel().ep == 2
    assert AuditOptions().case(lay).model_kwargs["num_experts"] == 4


@pytest.mark.unit
def test_stack_report_fails_on_an_adapted_miss_only():
    from megatron_lossfix.audit.report import AuditReport

    lay = parse_layout("dp2-m3")
    report = AuditReport(
        options={"tolerance": TOL},
        modes=["skyrl", "skyrl+lossfix"],
        layouts=[lay.name],
        baselines=("skyrl",),
    )
    report.add_result("skyrl", lay, {"error": 0.3}, TOL)
    report.add_result("skyrl+lossfix", lay, {"error": 1e-7}, TOL)
    assert report.passed and report.errors["skyrl"]["dp2-m3"] == 0.3
    report.add_result("skyrl+lossfix", lay, {"error": 2e-5}, TOL)
    assert not report.passed


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, says",
    [
        (["--stack", "skyrl", "--modes", "off"], "unknown ['off']"),
        (["--stack", "skyrl", "--terms", "sft", "--modes", "sequence_mean"], "sequence_mean"),
        (["--stack", "verl", "--terms", "kl_entropy"], "--stack verl audits --terms all"),
        (["--terms", "sft"], "--terms sft needs --stack"),
    ],
)
def test_stack_settings_it_cannot_run_are_refused_in_one_line(capsys, argv, says):
    from megatron_lossfix.audit.command import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and err[-1].startswith("usage") is False, err


@pytest.mark.unit
@pytest.mark.skipif(HAVE_SKYRL, reason="checks the message shown where SkyRL is missing")
def test_stack_without_skyrl_says_how_to_install(capsys):
    from megatron_lossfix.audit.command import main

    with pytest.raises(SystemExit) as exit_:
        main(["--stack", "skyrl", "--no-progress"])
    assert exit_.value.code == 2
    assert "pip install -e .[skyrl]" in capsys.readouterr().err


@pytest.mark.unit
def test_stack_on_an_older_skyrl_says_which_it_needs(capsys, monkeypatch):
    import importlib.metadata

    from megatron_lossfix.audit.command import main

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.0")
    with pytest.raises(SystemExit) as exit_:
        main(["--stack", "skyrl", "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "needs skyrl >= 0.4 (installed: 0.3.0): pip install -e .[skyrl]" in err, err


@pytest.mark.unit
@needs_skyrl
@pytest.mark.parametrize("masked_prompt", [None, 2])
def test_skyrl_prompt_mean_is_the_plugins_group_mean_but_for_all_masked_prompts(masked_prompt):
    """SkyRL's own prompt_mean (its advantage pre-scaling, as released) against the plugin's
    group_mean weights on the same mini-batch: the same per-token weights while every prompt
    has a loss token; with one prompt all masked SkyRL still counts it, so its weights are the
    plugin's times (prompts with a loss token) / (all prompts) (docs/design.md §2)."""
    from helpers.prompt_groups import PROMPT_ROWS, global_batch
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        apply_loss_reduction_to_advantages_minibatch,
    )

    from megatron_lossfix import loss_weights
    from megatron_lossfix.integrations.skyrl.adapter import group_ids_from_boundaries

    mask, _, _ = global_batch(masked_prompt)
    ones = torch.ones_like(mask)
    skyrl = (
        apply_loss_reduction_to_advantages_minibatch(
            advantages=ones,
            loss_mask=mask,
            loss_reduction="prompt_mean",
            micro_batch_size=2,
            max_seq_len=mask.shape[1],
            prompt_boundaries=list(PROMPT_ROWS),
        )
        * mask
    )
    ids = group_ids_from_boundaries(PROMPT_ROWS, mask.shape[0])
    (ours,) = loss_weights([mask], "prompt_mean", group_ids=[ids], num_groups=len(PROMPT_ROWS))
    kept = len(PROMPT_ROWS) - (masked_prompt is not None)
    torch.testing.assert_close(skyrl, ours * kept / len(PROMPT_ROWS), rtol=1e-6, atol=0)
    if masked_prompt is not None:
        assert not torch.allclose(skyrl, ours)


# ------------------------------------------------------------------------------ e2e


@pytest.fixture(scope="module")
def skyrl_pool():
    from megatron_lossfix.audit.pool import DistPool

    # Two ranks: the whole file needs no more, and a small pool starts fast.
    pool = DistPool(max_ranks=2, timeout_s=120)
    yield pool
    pool.close()


def _errors(pool, worker, mode: str, terms: str = "all") -> dict[str, float]:
    from megatron_lossfix.audit.stacks.skyrl.stack import skyrl_reference, stack_case

    lay = parse_layout("dp2-m3")
    case = stack_case(AuditOptions(), lay)
    plan = microbatch_plan(case, lay.dp, lay.num_microbatches)
    ref = pool.run(skyrl_reference, 1, case, mode, plan, terms)[0]
    got = pool.run(worker, 2, lay.parallel(), case, (mode,), 3, terms)[0]
    return {row: relative_error(grads, ref) for (row, _), grads in got.items()}


@needs_skyrl
@pytest.mark.e2e
@pytest.mark.parametrize(
    "terms, mode",
    [("all", "token_mean"), ("kl_entropy", "token_mean"), ("all", "prompt_mean")],
)
def test_adapter_is_exact_and_skyrl_as_released_is_not(skyrl_pool, terms, mode):
    from megatron_lossfix.audit.stacks.skyrl.stack import skyrl_layout_grads

    errors = _errors(skyrl_pool, skyrl_layout_grads, mode, terms)
    assert errors["skyrl+lossfix"] <= TOL, errors
    # SkyRL's per-micro-batch KL and entropy means: far from the exact objective.
    assert errors["skyrl"] > 100 * TOL, errors


@needs_skyrl
@pytest.mark.e2e
def test_sft_path_is_exact_as_released_and_through_the_adapter(skyrl_pool):
    from megatron_lossfix.audit.stacks.skyrl.stack import skyrl_layout_grads

    # SkyRL 0.3.0 divides the SFT loss mask by the mini-batch's token count on the driver and
    # undoes Megatron's averaging: exact for token_mean (measured; see docs/skyrl.md).
    errors = _errors(skyrl_pool, skyrl_layout_grads, "token_mean", "sft")
    assert max(errors.values()) <= TOL, errors


@needs_skyrl
@pytest.mark.e2e
def test_bypassing_the_adapter_fails_the_check(skyrl_pool):
    from helpers.skyrl_stack import bypassed_layout_grads

    errors = _errors(skyrl_pool, bypassed_layout_grads, "token_mean")
    assert errors["skyrl+lossfix"] > 100 * TOL, errors
