"""``reduction="off"`` is a literal pass-through: Megatron's schedule gets the caller's own
objects and the caller gets Megatron's result, untouched; ``step_metrics()`` reads that result.

A stand-in ``forward_backward_func`` records what it was called with; no process group is
needed (the metrics' groups are the one-rank ``StepGroups`` of ``None``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix import LossFixSchedule
from megatron_lossfix.runtime.process_groups import StepGroups

pytestmark = pytest.mark.unit


class Recorder:
    """Megatron's schedule, stood in: records its keyword arguments, returns ``result``."""

    def __init__(self, result: object) -> None:
        self.result = result
        self.calls: list[dict] = []

    def __call__(self, **kwargs: object) -> object:
        self.calls.append(kwargs)
        return self.result


def test_off_hands_over_the_callers_objects_and_returns_the_result_untouched(monkeypatch):
    reports = [
        {"loss_sum": torch.tensor(1.5), "tokens_count": torch.tensor(3.0)},
        {"loss_sum": torch.tensor(0.25), "tokens_count": torch.tensor(2.0), "other": "kept"},
    ]
    stock = Recorder(reports)
    schedule = LossFixSchedule("off", forward_backward_func=stock)

    def forward_step(data_iterator, model):  # never called by the stand-in
        raise AssertionError("off must not call forward_step itself")

    iterator = iter([{"tokens": torch.zeros(1, 2)}])  # not a dict of loss masks: off ignores it
    model = torch.nn.Linear(2, 1)
    extra = {"seq_length": 2, "micro_batch_size": 1, "forward_only": False, "collect": object()}
    got = schedule(
        forward_step_func=forward_step,
        data_iterator=iterator,
        model=model,
        num_microbatches=2,
        **extra,
    )
    assert got is reports
    assert [g is r for g, r in zip(got, reports, strict=True)] == [True, True]
    assert reports[1]["other"] == "kept" and len(reports[0]) == 2  # nothing added to a report
    (call,) = stock.calls
    assert set(call) == {"forward_step_func", "data_iterator", "model", "num_microbatches", *extra}
    assert call["forward_step_func"] is forward_step
    assert call["data_iterator"] is iterator
    assert call["model"] is model
    assert call["num_microbatches"] == 2
    for key, value in extra.items():
        assert call[key] is value, key
    assert next(iterator)["tokens"].shape == (1, 2)  # off did not read the iterator

    # step_metrics() reads the reports Megatron returned, and only them.
    monkeypatch.setattr(
        "megatron_lossfix.step.megatron_compat.resolve_groups",
        lambda pg: StepGroups(dp=None, cp=None, dp_cp=None, pp=None),
    )
    assert schedule.step_metrics() == {"loss_sum": 1.75, "tokens_count": 5.0}


def test_off_passes_lists_of_chunks_and_iterators_through():
    """Interleaved pipelining: the lists themselves, not copies, and non-last-stage results."""
    stock = Recorder([])
    iterators, chunks = [iter([]), iter([])], [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    got = LossFixSchedule("off", forward_backward_func=stock)(
        forward_step_func=print, data_iterator=iterators, model=chunks, num_microbatches=4
    )
    assert got is stock.result
    assert stock.calls[0]["data_iterator"] is iterators and stock.calls[0]["model"] is chunks
