"""``LossFixConfig``: the modes it accepts and the settings it refuses, each with a message that
says what to change."""

from __future__ import annotations

import pytest

from megatron_lossfix import REDUCTIONS, LossFixConfig
from megatron_lossfix.config import MODES

pytestmark = pytest.mark.unit


def test_modes_are_the_reductions_and_off():
    assert MODES == (*REDUCTIONS, "off")


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_builds_and_only_off_is_disabled(mode):
    norm = 8.0 if mode == "seq_mean_token_sum_norm" else None
    config = LossFixConfig(reduction=mode, norm_constant=norm)
    assert config.enabled is (mode != "off")


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
        ({"reduction": "off", "norm_constant": -1.0}, "must be > 0"),
        ({"reduction": "sum", "weights_key": "loss_mask"}, "must differ"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossFixConfig(**kwargs)
