"""The step's agreement, one process: what a rank reports, and the verdict every rank draws from
the sum of the reports (refuse on all ranks at once, naming who and why).

The records of several "ranks" are summed here by hand, as the all-reduces over the step's
groups would (their tensors added); the distributed paths are covered by test_step_refusal.py
and test_schedule_errors.py. Nothing here reads the record's layout: only its public methods.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_lossfix import LossFixConfig, LossFixSchedule, StepRefused
from megatron_lossfix.runtime.process_groups import StepGroups
from megatron_lossfix.runtime.weights import MODES
from megatron_lossfix.step.agreement import (
    Agreement,
    Problem,
    ProblemOnAnotherRank,
    StepSettings,
    agree,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
ONE_RANK = StepGroups(dp=None, cp=None, dp_cp=None, pp=None)
SETTINGS = StepSettings("token_mean", per_token=False)


def report(rank: int, problem: StepRefused | None = None, settings=SETTINGS, counts=0):
    return Agreement.of_rank(settings, problem, num_counts=counts, rank=rank, device=CPU)


def summed(*records: Agreement) -> Agreement:
    """What an all-reduce of these ranks' records gives."""
    return Agreement.from_tensor(torch.stack([r.to_tensor() for r in records]).sum(0))


def one_stage(*records: Agreement) -> Agreement:
    """What the agreement of these DP ranks of a one-stage step gives on the first of them."""
    return summed(*records).for_pipeline(records[0], len(records))


def test_a_record_goes_into_one_float64_tensor_and_back():
    record = report(3, Problem.RAN_OUT.refusal("ran out"), counts=4)
    record.counts.copy_(torch.tensor([10.0, 2.0, 7.0, 1.0]))
    vec = record.to_tensor()
    assert vec.dtype == torch.float64 and vec.dim() == 1
    back = Agreement.from_tensor(vec.clone())
    assert torch.equal(back.to_tensor(), vec)
    assert back.counts.tolist() == [10.0, 2.0, 7.0, 1.0]
    assert float(back.problems) == 1.0 and float(back.rank_sum) == 4.0  # global rank + 1
    # One more count makes the tensor one longer; a clean rank reports nothing.
    assert len(report(0, counts=5).to_tensor()) == len(vec) + 1
    clean = report(0)
    assert float(clean.problems) == 0 and not clean.kinds.any()


def test_counts_and_problems_add_up_over_ranks():
    records = [report(r, counts=2) for r in range(3)]
    for r, record in enumerate(records):
        record.counts.copy_(torch.tensor([float(r + 1), 1.0]))
    records[2].report(Problem.MASK_VALUES, torch.tensor(True))  # a flag found on the device
    total = summed(*records)
    assert total.counts.tolist() == [6.0, 3.0]
    assert float(total.problems) == 1.0
    assert not total.settings_differ(3)


def test_fingerprints_tell_every_setting_apart():
    prints = [StepSettings(m, p).fingerprint for m in MODES for p in (False, True)]
    assert len(set(prints)) == len(prints)


def test_clean_step_passes():
    one_stage(*(report(r) for r in range(4))).verdict(1, None, SETTINGS)


def test_the_rank_with_the_problem_raises_its_own_error():
    problem = Problem.MASK_VALUES.refusal("micro-batch 1: loss mask holds 0.5")
    total = one_stage(report(0, problem), report(1))
    with pytest.raises(StepRefused, match="refused this step: micro-batch 1: loss mask holds"):
        total.verdict(1, problem, SETTINGS)


def test_a_problem_found_on_the_device_is_asked_for_only_when_refused():
    asked = []

    def late():
        asked.append(True)
        return Problem.MASK_VALUES.refusal("micro-batch 0: 0.5")

    one_stage(report(0), report(1)).verdict(1, None, SETTINGS, late=late)
    assert not asked  # a clean step reads nothing more
    flagged = report(0)
    flagged.report(Problem.MASK_VALUES, torch.tensor(True), rank=0)
    with pytest.raises(StepRefused, match="micro-batch 0: 0.5"):
        one_stage(flagged, report(1)).verdict(1, None, SETTINGS, late=late)


def test_other_ranks_hear_what_and_who():
    problem = Problem.RAN_OUT.refusal("ran out")
    total = one_stage(report(0), report(5, problem))
    with pytest.raises(
        ProblemOnAnotherRank, match=rf"{Problem.RAN_OUT.value} \(reported by global rank 5"
    ):
        total.verdict(1, None, SETTINGS)
    two = one_stage(report(2, problem), report(5, problem))
    with pytest.raises(ProblemOnAnotherRank, match="reported by 2 ranks"):
        two.verdict(1, None, SETTINGS)


def test_disagreeing_settings_are_refused_on_every_rank():
    other = StepSettings("sum", per_token=False)
    assert summed(report(0), report(1, settings=other)).settings_differ(2)
    assert not summed(report(0), report(1)).settings_differ(2)
    # Inside one stage's DP x CP group: a problem of no one rank, that every rank hears of.
    stage = one_stage(report(0, settings=other), report(1))
    with pytest.raises(StepRefused, match="data- or context-parallel ranks disagree"):
        stage.verdict(1, None, other)
    # Two pipeline stages that bring different settings: (a + b)^2 != 2 (a^2 + b^2).
    stages = summed(one_stage(report(0)), report(1, settings=other))
    with pytest.raises(StepRefused, match="pipeline stages disagree.*'sum', per-token=False"):
        stages.verdict(2, None, other)
    summed(one_stage(report(0)), report(1)).verdict(2, None, SETTINGS)  # the same: fine


def test_one_rank_agrees_with_itself_without_communicating():
    mine = report(0, counts=2)
    mine.counts.copy_(torch.tensor([5.0, 2.0]))
    agreed = agree(mine, ONE_RANK)
    assert agreed.counts.tolist() == [5.0, 2.0]
    agreed.verdict(ONE_RANK.pp_size, None, SETTINGS)
    refused = agree(report(0, Problem.UNREDUCED.refusal("wrap the model")), ONE_RANK)
    with pytest.raises(StepRefused, match="refused this step: wrap the model"):
        refused.verdict(1, Problem.UNREDUCED.refusal("wrap the model"))


def test_cp_sharded_data_with_mtp_is_refused_before_any_collective(monkeypatch):
    """The schedule refuses, on every rank alike, settings it cannot serve before it even
    resolves the step's process groups."""

    class Reached(Exception):
        pass

    def resolve_groups(pg_collection):
        raise Reached

    monkeypatch.setattr("megatron_lossfix.step.megatron_compat.resolve_groups", resolve_groups)

    def call(config, mtp_layers):
        model = SimpleNamespace(config=SimpleNamespace(mtp_num_layers=mtp_layers))
        LossFixSchedule(config)(
            forward_step_func=None, data_iterator=iter([]), model=model, num_microbatches=1
        )

    with pytest.raises(StepRefused, match="mtp_num_layers=2.*whole sequences"):
        call(LossFixConfig(data_is_cp_sharded=True), 2)
    with pytest.raises(Reached):
        call(LossFixConfig(), 2)  # whole sequences: fine
    with pytest.raises(Reached):
        call(LossFixConfig(data_is_cp_sharded=True), 0)  # no MTP: fine
