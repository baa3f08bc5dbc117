"""The micro-batch wrapping and the helpers the step's phases share, without Megatron.

A fake schedule calls the wrapped ``forward_step`` the way Megatron's does (forward, then the
loss function it returned); the index of each micro-batch reaches its loss closure and the kept
masks as an argument, whatever order the closures are called in.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mask_in_loss import KeptStep, Phase, kept_weights
from megatron_lossfix.runtime.process_groups import same_on_every_rank
from megatron_lossfix.runtime.prompt_groups import parse_group_ids
from megatron_lossfix.step.microbatch import MicroBatches, PassLog, PassSettings, wrap_forward_step

pytestmark = pytest.mark.unit

CONFIG = LossFixConfig(reduction="sum")


def _pass(num: int, scale: float = 0.5) -> tuple[MicroBatches, PassSettings, KeptStep]:
    masks = [torch.ones(1, 3) * (k + 1) for k in range(num)]
    batches = [
        {"loss_mask": torch.ones(1, 3), "x": torch.full((1, 3), float(k))} for k in range(num)
    ]
    kept = KeptStep(
        mode="sum", phase=Phase.ZERO, rows=[1] * num, device=torch.device("cpu"), dp_size=1,
        cp_group=None,
    )  # fmt: skip
    settings = PassSettings(CONFIG, False, False, scale, kept, None)
    return MicroBatches(batches, masks, CONFIG), settings, kept


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    weights = batch[CONFIG.weights_key]

    def loss_func(output):
        keep = torch.tensor([[1.0, 1.0, 0.0]])
        return (output * kept_weights(weights, keep)).sum(), {"x": batch["x"][0, 0]}

    return batch["x"], loss_func


def test_each_loss_closure_gets_its_own_microbatch_index():
    batches, settings, kept = _pass(3)
    log = PassLog()
    step = wrap_forward_step(_forward_step, batches, settings, log)
    losses = [step(batches, None) for _ in range(3)]
    assert batches.taken == 3
    outputs = [loss(output) for output, loss in reversed(losses)]  # closures called out of order
    # micro-batch k: x = k, weights k + 1 on two kept tokens, scaled by 0.5
    assert [float(out[0]) for out in outputs] == [0.5 * 2 * k * (k + 1) for k in (2, 1, 0)]
    assert [float(r["x"]) for r in log.reports] == [2.0, 1.0, 0.0]
    assert kept.called == [True, True, True] and log.problem is None


def test_a_forward_step_that_reads_nothing_is_named():
    batches, settings, _ = _pass(2)
    log = PassLog()

    def lazy(data_iterator, model):
        return torch.zeros(1, 3), lambda output: (output.sum(), {})

    output, loss = wrap_forward_step(lazy, batches, settings, log)(batches, None)
    assert float(loss(output)[0]) == 0.0
    assert "micro-batch 0: ValueError: forward_step_func returned without reading" in str(
        log.problem
    )


def test_microbatches_hand_out_weights_and_stop():
    batches, _, _ = _pass(2)
    first = next(batches)
    assert batches.taken == 1 and float(first[CONFIG.weights_key][0, 0]) == 1.0
    assert float(next(batches)[CONFIG.weights_key][0, 0]) == 2.0
    with pytest.raises(StopIteration):
        next(batches)
    nan = MicroBatches([{"x": torch.tensor([float("nan")])}], [torch.ones(1)], _checking())
    with pytest.raises(FloatingPointError, match="micro-batch 0: 'x' holds NaN or Inf"):
        next(nan)


def _checking() -> LossFixConfig:
    return LossFixConfig(reduction="sum", check_finite=True)


def test_same_on_every_rank():
    assert same_on_every_rank(3.0 * 4, 3 * 4.0**2, 3)
    assert not same_on_every_rank(1.0 + 2.0, 1.0 + 4.0, 2)
    differ = same_on_every_rank(torch.tensor(3.0), torch.tensor(5.0), 2)
    assert isinstance(differ, torch.Tensor) and not bool(differ)


def test_one_group_id_parser():
    masks = [torch.ones(2, 3), torch.ones(1, 3)]
    names = ("group_ids", "num_groups")
    with pytest.raises(ValueError, match="missing"):
        parse_group_ids("group", None, None, masks, [2, 1], names, "missing")
    with pytest.raises(ValueError, match="num_trajectories needs trajectory_ids"):
        names_t = ("trajectory_ids", "num_trajectories")
        parse_group_ids("trajectory", None, 4, masks, [2, 1], names_t, "")
    assert parse_group_ids("trajectory", None, None, masks, [2, 1], names, "") is None
    ids = [torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int8)]
    parsed = parse_group_ids("group", ids, 2, masks, [2, 1], names, "")
    assert parsed.count == 2 and all(i.dtype == torch.long for i in parsed.ids)
    with pytest.raises(ValueError, match=r"group_ids of micro-batch 1 must have one id"):
        parse_group_ids("group", ids, 2, masks, [2, 2], names, "")
