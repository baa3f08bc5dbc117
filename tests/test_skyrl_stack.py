"""SkyRL's own Megatron loss path under the audit (``--stack skyrl``) and the adapter.

The e2e tests run SkyRL 0.3.0's ``MegatronModelWrapper`` from its package on the tiny GPT over
two DP ranks with three micro-batches each, KL and entropy on, and compare the gradient with the
one-rank reference of the exact objective. They skip where SkyRL is not installed
(``pip install -e .[skyrl]``). The unit tests check the mapping and the report without SkyRL.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from megatron_lossfix.audit.matrix import parse_layout
from megatron_lossfix.audit.options import AuditOptions
from megatron_lossfix.audit.oracle import microbatch_plan, relative_error
from megatron_lossfix.integrations.skyrl import SKYRL_MODES, lossfix_config_for

HAVE_SKYRL = importlib.util.find_spec("skyrl") is not None
needs_skyrl = pytest.mark.skipif(
    not HAVE_SKYRL, reason="SkyRL is not installed (pip install -e .[skyrl])"
)
TOL = 1e-5


# ------------------------------------------------------------------------------ unit


@pytest.mark.unit
@pytest.mark.parametrize("mode", sorted(SKYRL_MODES))
def test_every_skyrl_mode_maps_to_the_plugin_mode_of_its_name(mode):
    config = lossfix_config_for(SimpleNamespace(loss_reduction=mode, max_seq_len=16))
    assert config.reduction == mode
    assert config.norm_constant == (16 if mode == "seq_mean_token_sum_norm" else None)


@pytest.mark.unit
def test_unknown_skyrl_mode_and_missing_max_seq_len_are_refused():
    with pytest.raises(ValueError, match="prompt_mean"):
        lossfix_config_for(SimpleNamespace(loss_reduction="prompt_mean", max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        lossfix_config_for(
            SimpleNamespace(loss_reduction="seq_mean_token_sum_norm", max_seq_len=None)
        )


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


# ------------------------------------------------------------------------------ e2e


@pytest.fixture(scope="module")
def skyrl_pool():
    from megatron_lossfix.audit.pool import DistPool

    # Two ranks: the whole file needs no more, and a small pool starts fast.
    pool = DistPool(max_ranks=2, timeout_s=120)
    yield pool
    pool.close()


def _errors(pool, worker, mode: str, terms: str = "all") -> dict[str, float]:
    from megatron_lossfix.audit.stacks.skyrl import skyrl_reference, stack_case

    lay = parse_layout("dp2-m3")
    case = stack_case(AuditOptions(), lay)
    plan = microbatch_plan(case, lay.dp, lay.num_microbatches)
    ref = pool.run(skyrl_reference, 1, case, mode, plan, terms)[0]
    got = pool.run(worker, 2, lay.parallel(), case, (mode,), 3, terms)[0]
    return {row: relative_error(grads, ref) for (row, _), grads in got.items()}


@needs_skyrl
@pytest.mark.e2e
@pytest.mark.parametrize("terms", ["all", "kl_entropy"])
def test_adapter_is_exact_and_skyrl_as_released_is_not(skyrl_pool, terms):
    from megatron_lossfix.audit.stacks.skyrl import skyrl_layout_grads

    errors = _errors(skyrl_pool, skyrl_layout_grads, "token_mean", terms)
    assert errors["skyrl+lossfix"] <= TOL, errors
    # SkyRL's per-micro-batch KL and entropy means: far from the exact objective.
    assert errors["skyrl"] > 100 * TOL, errors


@needs_skyrl
@pytest.mark.e2e
def test_sft_path_is_exact_as_released_and_through_the_adapter(skyrl_pool):
    from megatron_lossfix.audit.stacks.skyrl import skyrl_layout_grads

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
