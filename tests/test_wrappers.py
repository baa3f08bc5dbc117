"""Every data-parallel wrapper Megatron-Core ships is served exactly or refused (docs/limits.md).

The step relies on a wrapper's ``scale_gradients`` (Megatron's per-token division, the scale
after the schedule of ``mask_in_loss``); ``_BaseDataParallel``'s is a no-op. A wrapper that keeps
the no-op, or that the gradient oracle has not proven, is refused before the step; a wrapper
whose scale leaves the gradient unchanged is refused on every rank at the first scale; Megatron
DDP is seen to scale. (The oracle's exactness rows per wrapper: ``test_hard_layouts.py``.)
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers.wrappers import wrapped_step


def _bare(cls: type) -> torch.nn.Module:
    """An instance of ``cls`` with no Megatron state (its class is all the check reads)."""
    chunk = cls.__new__(cls)
    torch.nn.Module.__init__(chunk)
    return chunk


def _base() -> type:
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    return _BaseDataParallel


@pytest.mark.unit
def test_torch_fsdp2_keeps_the_no_op_scale_and_is_refused():
    from megatron.core.distributed import TorchFullyShardedDataParallel

    from megatron_lossfix.step.wrappers import INSTEAD, known_wrapper, wrapper_problem

    # The fact the refusal rests on: a release that gives FSDP2 a scale fails here.
    assert TorchFullyShardedDataParallel.scale_gradients is _base().scale_gradients
    chunk = _bare(TorchFullyShardedDataParallel)
    assert known_wrapper(chunk).refusal is not None
    message = wrapper_problem([chunk])
    assert "TorchFullyShardedDataParallel keeps _BaseDataParallel's no-op" in message
    assert message.endswith(INSTEAD) and "\n" not in message


@pytest.mark.unit
def test_a_wrapper_without_its_own_scale_is_refused():
    class Sharded(_base()):
        pass

    from megatron_lossfix.step.wrappers import wrapper_problem

    message = wrapper_problem([_bare(Sharded)])
    assert message.startswith("the model's wrapper Sharded keeps _BaseDataParallel's no-op")
    assert "--use-megatron-fsdp" in message


@pytest.mark.unit
def test_an_unproven_wrapper_is_refused_even_with_a_scale():
    class Custom(_base()):
        def scale_gradients(self, scaling_factor: float) -> None:
            for param in self.parameters():
                param.grad.mul_(scaling_factor)

    from megatron_lossfix.step.wrappers import wrapper_problem

    message = wrapper_problem([_bare(Custom)])
    assert "Custom is not one whose gradient averaging and scale_gradients" in message


@pytest.mark.unit
def test_the_proven_wrappers_pass():
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from megatron_lossfix.step.wrappers import known_wrapper, wrapper_problem

    ddp = _bare(DistributedDataParallel)
    assert wrapper_problem([ddp, torch.nn.Linear(1, 1)]) is None
    # Megatron-FSDP binds its module's scale on the instance, as the adapter's __init__ does.
    fsdp = _bare(FullyShardedDataParallel)
    assert known_wrapper(fsdp).refusal is None
    assert "no-op" in wrapper_problem([fsdp])
    fsdp.scale_gradients = torch.nn.Linear(1, 1).forward
    fsdp.ddp_config = types.SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params")
    assert wrapper_problem([fsdp]) is None
    fsdp.ddp_config.data_parallel_sharding_strategy = "unknown"
    assert "strategy='unknown' is not proven exact" in wrapper_problem([fsdp])


@pytest.mark.unit
def test_a_scale_that_leaves_the_gradient_unchanged_is_caught():
    from megatron_lossfix.step import wrappers

    class Idle(_base()):
        def scale_gradients(self, scaling_factor: float) -> None:
            del scaling_factor

    class Scales(Idle):
        def scale_gradients(self, scaling_factor: float) -> None:
            for param in self.parameters():
                param.grad.mul_(scaling_factor)

    verdicts = {}
    for cls in (Idle, Scales):
        chunk = _bare(cls)
        chunk.w = torch.nn.Parameter(torch.ones(3))
        chunk.w.grad = torch.tensor([0.0, 2.0, 3.0])
        verdicts[cls.__name__] = wrappers.scale_gradients([chunk], 0.5)
        problem = wrappers.agree_scale_seen([chunk], verdicts[cls.__name__], [])
        assert wrappers.unseen([chunk]) == (cls is Idle)
        assert (problem is None) == (cls is Scales), problem
    assert verdicts == {"Idle": 2, "Scales": 1}
    # A zero gradient says nothing: the chunk stays unseen, the step is not refused.
    chunk = _bare(Idle)
    chunk.w = torch.nn.Parameter(torch.zeros(2))
    chunk.w.grad = torch.zeros(2)
    assert wrappers.scale_gradients([chunk], 0.5) == 0
    assert wrappers.agree_scale_seen([chunk], 0, []) is None and wrappers.unseen([chunk])


@pytest.mark.oracle
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("noop-scale", "the model's wrapper NoOpScaleDDP keeps _BaseDataParallel's no-op"),
        ("idle-scale", "the model's wrapper IdleScaleDDP left the gradients unchanged"),
    ],
    ids=["noop-scale", "idle-scale"],
)
def test_refused_on_every_rank(dist_pool, kind, expected):
    """DP2, a mask decided in the loss: a wrapper keeping the no-op is refused before the
    step, one whose own scale does nothing after its first scale; on both ranks, one line."""
    for outcome, message, seen in dist_pool.run(wrapped_step, 2, kind):
        assert outcome == "StepRefused" and expected in message, message
        assert "--use-megatron-fsdp" in message and "\n" not in message
        assert not seen


@pytest.mark.oracle
def test_megatron_ddp_is_seen_to_scale(dist_pool):
    assert dist_pool.run(wrapped_step, 2, "ddp") == [("ok", "", True)] * 2
