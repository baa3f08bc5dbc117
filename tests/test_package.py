"""The package's public surface: what docs/design.md §5 names, and an import that stays cheap."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import megatron_lossfix

pytestmark = pytest.mark.unit


def test_public_api_is_declared_and_importable():
    for name in megatron_lossfix.__all__:
        assert hasattr(megatron_lossfix, name), name


def test_loss_weights_signature_is_the_contract():
    params = inspect.signature(megatron_lossfix.loss_weights).parameters
    assert list(params) == ["loss_masks", "reduction", "norm_constant", "dp_group", "cp_group"]
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[2:])
    assert all(params[p].default is None for p in list(params)[2:])


def test_importing_the_package_does_not_import_megatron():
    code = (
        "import sys, megatron_lossfix; print(any(m.startswith('megatron.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_contract_names_are_top_level():
    """What outside harnesses import (docs/design.md §5): no internal module path needed."""
    for name in ("REDUCTIONS", "loss_weights", "LossFixConfig", "LossFixSchedule",
                 "enable_cpu_megatron", "slice_batch_for_cp", "StepRefused", "SelfCheckError",
                 "weighted_loss", "add_lossfix_args", "schedule_from_args"):  # fmt: skip
        assert name in megatron_lossfix.__all__, name
    assert megatron_lossfix.enable_cpu_megatron.__module__ == "megatron_lossfix.cpu_compat"
