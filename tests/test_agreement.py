"""The step's agreement, one process: what a rank puts in the agreement vector, and the verdict
every rank draws from the reduced vector (refuse on all ranks at once, naming who and why).

The vectors of several "ranks" are summed here by hand, as the all-reduce over the step's
groups would; the distributed paths are covered by test_step_refusal.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_lossfix import LossFixConfig, StepRefused
from megatron_lossfix.reduction import MODES
from megatron_lossfix.schedule import (
    DISAGREE,
    KINDS,
    MASK_VALUES,
    RAN_OUT,
    SLOT_FP,
    SLOT_FP2,
    SLOT_KIND0,
    SLOT_PROBLEMS,
    SLOT_RANK_SUM,
    VECTOR_LEN,
    ProblemOnAnotherRank,
    _model_settings,
    agreement_vector,
    fingerprint,
    local_problem,
    verdict,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
ONE_STAGE = SimpleNamespace(pp_size=1)


def _reduced(*vectors: torch.Tensor, fp: float = 1.0) -> list[float]:
    """The reduced vector of these data-parallel ranks of one pipeline stage with setting
    fingerprint ``fp`` (the fingerprint slots are summed over pipeline stages only)."""
    total = torch.stack(list(vectors)).sum(0)
    total[SLOT_FP], total[SLOT_FP2] = fp, fp * fp
    return total.tolist()


def test_vector_layout_and_a_rank_with_a_problem():
    clean = agreement_vector(None, rank=3, device=CPU, mtp_layers=2)
    assert clean.dtype == torch.float64 and clean.shape == (VECTOR_LEN + 4,)
    assert not clean.any()
    vec = agreement_vector(local_problem(RAN_OUT, "ran out"), rank=3, device=CPU)
    assert vec[SLOT_PROBLEMS] == 1 and vec[SLOT_RANK_SUM] == 4  # global rank + 1
    assert vec[SLOT_KIND0 + RAN_OUT] == 1 and vec[SLOT_KIND0:].sum() == 1


def test_fingerprints_tell_every_setting_apart():
    prints = [fingerprint(mode, per_token) for mode in MODES for per_token in (False, True)]
    assert len(set(prints)) == len(prints)


def test_clean_step_passes():
    values = _reduced(*(agreement_vector(None, r, CPU) for r in range(4)))
    verdict(values, ONE_STAGE, "token_mean", False, None, None)


def test_the_rank_with_the_problem_raises_its_own_error():
    problem = local_problem(MASK_VALUES, "micro-batch 1: loss mask holds 0.5")
    values = _reduced(agreement_vector(problem, 0, CPU), agreement_vector(None, 1, CPU))
    with pytest.raises(StepRefused, match="refused this step: micro-batch 1: loss mask holds"):
        verdict(values, ONE_STAGE, "token_mean", False, problem, None)


def test_other_ranks_hear_what_and_who():
    problem = local_problem(RAN_OUT, "ran out")
    values = _reduced(agreement_vector(None, 0, CPU), agreement_vector(problem, 5, CPU))
    with pytest.raises(
        ProblemOnAnotherRank, match=rf"{KINDS[RAN_OUT]} \(reported by global rank 5"
    ):
        verdict(values, ONE_STAGE, "token_mean", False, None, None)
    two = _reduced(agreement_vector(problem, 2, CPU), agreement_vector(problem, 5, CPU))
    with pytest.raises(ProblemOnAnotherRank, match="reported by 2 ranks"):
        verdict(two, ONE_STAGE, "token_mean", False, None, None)


def test_disagreeing_settings_are_refused_on_every_rank():
    values = _reduced(agreement_vector(None, 0, CPU))
    values[SLOT_KIND0 + DISAGREE] = 1.0
    with pytest.raises(StepRefused, match="data- or context-parallel ranks disagree"):
        verdict(values, ONE_STAGE, "sum", False, None, None)
    # Two pipeline stages with different fingerprints: (a + b)^2 != 2 (a^2 + b^2).
    stages = torch.stack([agreement_vector(None, r, CPU) for r in range(2)]).sum(0)
    a, b = fingerprint("sum", False), fingerprint("token_mean", False)
    stages[SLOT_FP], stages[SLOT_FP2] = a + b, a * a + b * b
    with pytest.raises(StepRefused, match="pipeline stages disagree"):
        verdict(stages.tolist(), SimpleNamespace(pp_size=2), "sum", False, None, None)


def test_cp_sharded_data_with_mtp_is_refused_before_any_collective():
    def model(mtp_layers):
        return SimpleNamespace(config=SimpleNamespace(mtp_num_layers=mtp_layers))

    _model_settings(LossFixConfig(), model(2))  # whole sequences: fine
    _model_settings(LossFixConfig(data_is_cp_sharded=True), model(0))  # no MTP: fine
    with pytest.raises(StepRefused, match="mtp_num_layers=2.*whole sequences"):
        _model_settings(LossFixConfig(data_is_cp_sharded=True), model(2))
