"""The counting pass (docs/design.md §10) on a stand-in schedule: it runs forward-only without
autograd, replays what each data iterator yielded to the real pass, and puts the RNG back."""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix.step.counting_pass import counting_pass

pytestmark = pytest.mark.unit


def _schedule(seen: dict):
    """Reads every chunk's iterator twice and draws random numbers, as a forward pass may."""

    def run(*, forward_step_func, data_iterator, forward_only, num_microbatches, **_):
        its = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        seen["forward_only"], seen["grad"] = forward_only, torch.is_grad_enabled()
        seen["reads"] = [[next(it) for _ in range(num_microbatches)] for it in its]
        seen["draw"] = torch.rand(3)
        seen["forward_step"] = forward_step_func

    return run


@pytest.mark.parametrize("as_list", [False, True])
def test_replays_every_iterator_and_restores_the_rng(as_list):
    first = [{"tokens": torch.tensor([k])} for k in range(3)]
    second = [{"tokens": torch.tensor([10 + k])} for k in range(3)]
    sources = [iter(first), iter(second)] if as_list else [iter(first)]
    call = {
        "data_iterator": sources if as_list else sources[0],
        "forward_step_func": "real",
        "num_microbatches": 2,
        "forward_only": False,
    }
    seen: dict = {}
    torch.manual_seed(0)
    replays = counting_pass(_schedule(seen), call, "counting", sources, None)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3)), "the real pass draws what it would have drawn"
    assert seen["forward_only"] is True and seen["grad"] is False
    assert seen["forward_step"] == "counting"
    for replay, read, source in zip(replays, seen["reads"], (first, second), strict=False):
        again = [next(replay) for _ in range(3)]  # the two read, then the source's next one
        assert [int(b["tokens"]) for b in again] == [int(b["tokens"]) for b in source]
        assert again[0] is not read[0] and again[0]["tokens"] is read[0]["tokens"]


def test_the_loss_stage_brings_its_own_iterators():
    """The loss chunk's micro-batches are already in the step: its two passes each get one."""
    own = (iter([{"k": 0}, {"k": 1}]), iter([{"k": 2}]))
    call = {"data_iterator": [iter([]), iter([])], "num_microbatches": 2}
    seen: dict = {}
    replays = counting_pass(_schedule(seen), call, None, [iter([{"a": 1}] * 2), None], own)
    assert seen["reads"][1] == [{"k": 0}, {"k": 1}]
    assert replays[1] is own[1] and next(replays[1]) == {"k": 2}
