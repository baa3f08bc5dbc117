"""The micro-batch wrapping and the helpers the step's phases share, without Megatron.

A fake schedule calls the wrapped ``forward_step`` the way Megatron's does (forward, then the
loss function it returned); the index of each micro-batch reaches its loss closure and the kept
masks as an argument, whatever order the closures are called in. And nothing in that loop makes
the host wait for the device: no read of a tensor's value, no tensor built from host data, in
the plugin's wrapper or in its loss functions (``weighted_loss``, ``rl_loss``), in every mode.
"""

from __future__ import annotations

import operator
from functools import partial

import numpy as np
import pytest
import torch
from helpers.host_syncs import HOST_SYNCS, HostSyncs

from megatron_lossfix.rl.objective import rl_loss
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.losses import weighted_loss
from megatron_lossfix.runtime.mask_in_loss import KeptStep, Phase, kept_weights, phase_for
from megatron_lossfix.runtime.modes import REDUCTIONS, mode_of
from megatron_lossfix.runtime.process_groups import same_on_every_rank
from megatron_lossfix.runtime.prompt_groups import parse_group_ids
from megatron_lossfix.runtime.weights import count_tokens, weights_from_counts
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


# --------------------------------------------------------------------- no host sync in the loop
#: The modes whose weights need no group ids.
PLAIN_MODES = tuple(m for m in REDUCTIONS if mode_of(m).weights is not None)


def _rl_forward_step(data_iterator, model):
    batch = next(data_iterator)
    return batch["logits"] * model, partial(rl_loss, batch, objective=RL)


def _sft_forward_step(keep, data_iterator, model):
    batch = next(data_iterator)
    loss = partial(weighted_loss, batch[CONFIG.weights_key], keep=keep)
    return batch["per_token"] * model, loss


RL = {"policy_loss": "ppo", "kl_coef": 0.01, "ratio_band": (0.8, 1.25)}
LOSSES = {
    "weighted_loss": partial(_sft_forward_step, None),
    "weighted_loss+keep": partial(_sft_forward_step, lambda per_token: per_token < 0.5),
    "rl_loss": _rl_forward_step,
}


def _microbatch_loop(mode: str, loss: str, per_token: bool, mask_in_loss: bool) -> tuple:
    """One pass of the step's micro-batch loop as Megatron's schedule runs it (forward, loss,
    backward per micro-batch), the weights from the step's counts; the host syncs it made."""
    num, rows, seq, vocab = 3, 2, 8, 5
    gen = torch.Generator().manual_seed(0)
    masks = [(torch.rand(rows, seq, generator=gen) < 0.7).float() for _ in range(num)]
    norm = float(seq) if mode == "seq_mean_token_sum_norm" else None
    config = LossFixConfig(reduction=mode, norm_constant=norm, mask_in_loss=mask_in_loss)
    counts = count_tokens(masks)
    weights = weights_from_counts(masks, counts, mode, norm_constant=norm)
    batches = [
        {
            "loss_mask": m,
            "per_token": torch.rand(rows, seq, generator=gen),
            "logits": torch.randn(rows, seq, vocab, generator=gen),
            "labels": torch.randint(vocab, (rows, seq), generator=gen),
            "old_logprobs": -1.6 + 0.1 * torch.randn(rows, seq, generator=gen),
            "ref_logprobs": -1.6 + 0.1 * torch.randn(rows, seq, generator=gen),
            "advantages": torch.randn(rows, generator=gen),
        }
        for m in masks
    ]
    phase = phase_for(mode, mask_in_loss, False, False)
    kept = KeptStep(
        mode=mode, phase=phase, rows=[rows] * num, device=torch.device("cpu"), dp_size=1,
        cp_group=None, norm_constant=norm,
    )  # fmt: skip
    scale = counts.num_tokens.float() if per_token else float(num)
    settings = PassSettings(config, per_token, False, scale, kept, None)
    real, log = MicroBatches(batches, weights, config), PassLog()
    model = torch.ones((), requires_grad=True)
    step = wrap_forward_step(LOSSES[loss], real, settings, log)
    with HostSyncs() as syncs:
        for _ in range(num):
            output, loss_func = step(real, model)
            loss_func(output)[0].backward()
    return syncs.calls, log


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("mode", PLAIN_MODES)
def test_no_host_sync_in_the_microbatch_loop(mode, loss):
    for per_token in (False, True):
        for mask_in_loss in (False, True):
            if mask_in_loss and phase_for(mode, True, False, False) is Phase.COUNT:
                continue  # the counting pass is a pass of its own: tests/test_collectives.py
            calls, log = _microbatch_loop(mode, loss, per_token, mask_in_loss)
            assert log.problem is None, log.problem
            assert len(log.contributions) == 3
            assert calls == [], (per_token, mask_in_loss, calls)


def test_the_host_sync_probe_sees_what_it_looks_for():
    """The probe the tests share (``helpers.host_syncs``) records each call of its list, once,
    and nothing that stays on the device."""
    x = torch.tensor([1.0, 0.0, 2.0])
    with HostSyncs() as syncs:
        x[0].item(), x.tolist(), x.numpy(), np.asarray(x)
        bool(x[0]), float(x[0]), int(x[0]), operator.index(x.long()[0])
        torch.equal(x, x), torch.allclose(x, x), x.cpu(), torch.tensor(1.0), torch.as_tensor([1])
        x.nonzero(), torch.argwhere(x), x.masked_select(x > 0), torch.unique(x)
        torch.unique_consecutive(x)
        x * 2, x.sum(), torch.where(x > 0, x, 0.0), x.to(torch.float64), x.clone()  # no sync
    assert syncs.names() == [
        "item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__",
        "equal", "allclose", "cpu", "tensor", "as_tensor", "nonzero", "argwhere",
        "masked_select", "unique", "unique_consecutive",
    ]  # fmt: skip
    assert set(syncs.names()) == HOST_SYNCS
