"""``LossFixConfig``: the modes it accepts and the settings it refuses, each with a message that
says what to change."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron_lossfix import REDUCTIONS, LossFixConfig, add_lossfix_args, loss_weights
from megatron_lossfix.args import from_args
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.weights import MODES

pytestmark = pytest.mark.unit


def test_modes_are_the_reductions_and_off():
    assert MODES == (*REDUCTIONS, "off")


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_builds(mode):
    norm = 8.0 if mode_of(mode).uses_constant else None
    config = LossFixConfig(reduction=mode, norm_constant=norm)
    assert (config.reduction, config.norm_constant) == (mode, norm)


def test_config_is_keyword_only_and_slotted():
    with pytest.raises(TypeError):
        LossFixConfig("sum")  # type: ignore[misc]
    with pytest.raises(AttributeError):
        LossFixConfig().reductoin = "sum"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reduction": "mean"}, "unknown loss reduction"),
        ({"reduction": "seq_mean_token_sum_norm"}, "needs norm_constant"),
        ({"reduction": "seq_mean_token_sum_norm", "norm_constant": 0}, "must be > 0"),
        ({"reduction": "seq_mean_token_sum_norm", "norm_constant": -1.0}, "must be > 0"),
        ({"reduction": "off", "norm_constant": -1.0}, "applies only to"),
        ({"reduction": "sum", "weights_key": "loss_mask"}, "must differ"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossFixConfig(**kwargs)


# One validation for the Python API and the flags: each flag combination below is refused by
# from_args with exactly the message LossFixConfig gives for the same values.
_SAME_REFUSALS = [
    ({"reduction": "token_mean", "norm_constant": 5.0}, ["token_mean", "5"], "applies only to"),
    ({"reduction": "off", "norm_constant": 5.0}, ["off", "5"], "applies only to"),
    (
        {"reduction": "seq_mean_token_sum_norm", "norm_constant": math.inf},
        ["seq_mean_token_sum_norm", "inf"],
        "> 0 and finite",
    ),
    (
        {"reduction": "seq_mean_token_sum_norm", "norm_constant": math.nan},
        ["seq_mean_token_sum_norm", "nan"],
        "> 0 and finite",
    ),
    (
        {"reduction": "seq_mean_token_sum_norm", "norm_constant": -2.0},
        ["seq_mean_token_sum_norm", "-2"],
        "> 0 and finite",
    ),
]


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, flags, match", _SAME_REFUSALS)
def test_config_and_flags_refuse_alike(kwargs, flags, match):
    with pytest.raises(ValueError, match=match) as api:
        LossFixConfig(**kwargs)
    argv = ["--loss-reduction", flags[0], "--loss-norm-constant", flags[1]]
    args = add_lossfix_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(ValueError) as cli:
        from_args(args)
    assert str(cli.value) == str(api.value)
    assert "--loss-norm-constant" in str(api.value)  # names the flag to change


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reduction": "seq_mean_token_sum_norm", "norm_constant": "100"}, "must be a number"),
        ({"reduction": "seq_mean_token_sum_norm", "norm_constant": True}, "must be a number"),
        ({"reduction": None}, "unknown loss reduction"),
        ({"validate": "no"}, r"validate \(--lossfix-no-validate\) must be True or False"),
        ({"check_finite": 1}, "must be True or False"),
        ({"data_is_cp_sharded": None}, "must be True or False"),
        ({"loss_mask_key": ""}, "loss_mask_key must be a non-empty string"),
        ({"weights_key": ""}, "weights_key must be a non-empty string"),
        ({"cu_seqlens_key": 3}, "cu_seqlens_key must be a non-empty string"),
    ],
)
def test_config_refuses_what_no_flag_can_give(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossFixConfig(**kwargs)


@pytest.mark.unit
def test_schedule_takes_a_config_or_a_mode_name_only():
    from megatron_lossfix import LossFixSchedule

    assert LossFixSchedule("sequence_mean").config == LossFixConfig(reduction="sequence_mean")
    config = LossFixConfig(reduction="sum")
    assert LossFixSchedule(config).config is config
    for bad in (None, {"reduction": "token_mean"}, 3):
        with pytest.raises(TypeError, match="takes a LossFixConfig or a mode name"):
            LossFixSchedule(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown loss reduction 'mean'"):
        LossFixSchedule("mean")
    with pytest.raises(TypeError, match="forward_backward_func must be"):
        LossFixSchedule("sum", forward_backward_func="stock")  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize("mode", [m for m in REDUCTIONS if not mode_of(m).uses_constant])
def test_loss_weights_refuses_a_constant_its_mode_ignores(mode):
    with pytest.raises(ValueError, match="applies only to"):
        loss_weights([torch.ones(1, 3)], mode, norm_constant=5.0)
