"""``off`` is stock Megatron, and a plugin mode refuses what it cannot use on every rank.

Our own scenarios in the style of Megatron-Core's schedule unit tests (their file is run as it
is by ``test_upstream_schedules.py`` when a Megatron-LM checkout is at hand): a bare
``torch.nn.Linear`` as the model, a plain ``ModelParallelConfig`` (no
``calculate_per_token_loss`` field), a loss function that returns the rank as a Python int,
forward steps that never read their iterator, ``range`` iterators, ``None`` iterators on the loss
stage, and micro-batches that are not dicts -- under each of Megatron's three schedules. For each
scenario, stock Megatron and ``LossFixSchedule(off)`` wrapping it must give the same result (or
the same exception) after exactly the same collective calls; a plugin mode must end the step on
every rank with its StepRefused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.oracle

# name -> (tp, pp, vpp, what the loss stage reads, forward_only)
SCENARIOS = {
    "no-pipelining-range-never-read": (2, 1, None, "range", True),
    "no-pipelining-ints-read": (1, 1, None, "ints", True),
    "no-pipelining-training": (1, 1, None, "range", False),
    "1f1b-none-iterator": (1, 4, None, "none", True),
    "interleaved-ranges": (1, 2, 2, "range", True),
}
HIDDEN, SEQ, MBS = 8, 16, 2


def _plain(value: Any) -> Any:
    """Results as comparable Python values (tensors become lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _scenario(name: str, variant: str) -> dict:
    """Pool worker (world 4): one call of the scenario's schedule, stock or through the plugin."""
    import torch.distributed as dist
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from test_collectives import count_collectives

    from megatron_lossfix import LossFixConfig, LossFixSchedule

    tp, pp, vpp, reads, forward_only = SCENARIOS[name]
    ps.initialize_model_parallel(tp, pp, vpp)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model.model_type = ModelType.encoder_or_decoder
    model.set_input_tensor = lambda tensor: None
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
    )
    config.hidden_size = HIDDEN
    model.config = config

    def forward_step(data_iterator: Any, model: Any) -> tuple:
        if reads == "ints":
            next(data_iterator)  # an int: stock has no opinion on what a batch is
        if pp > 1:
            output = torch.full((SEQ, MBS, HIDDEN), float(rank), requires_grad=not forward_only)
        else:
            output = model(torch.ones(1, 4))
        if forward_only:
            return output, lambda out: (rank, {"loss_reduced": rank})
        return output, lambda out: (out.sum(), {"loss_reduced": out.detach().sum()})

    chunks = [model] * (vpp or 1)
    iterator = {"range": lambda: range(100), "ints": lambda: iter(range(100))}.get(
        reads, lambda: None
    )
    data = [iterator() for _ in chunks] if vpp else iterator()
    stock = get_forward_backward_func()
    func = (
        stock
        if variant == "stock"
        else LossFixSchedule(
            LossFixConfig(reduction=variant, self_check=False), forward_backward_func=stock
        )
    )
    with count_collectives() as counter:
        try:
            result = func(
                forward_step_func=forward_step,
                data_iterator=data,
                model=chunks,
                num_microbatches=4,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=forward_only,
            )
            outcome = ("ok", _plain(result))
        except Exception as exc:  # noqa: BLE001 - compared by the parent
            outcome = (type(exc).__name__, str(exc))
    grads = None if model.weight.grad is None else model.weight.grad.tolist()
    return {"outcome": outcome, "counts": dict(counter), "grads": grads}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_off_is_stock(dist_pool, name):
    stock = dist_pool.run(_scenario, 4, name, "stock")
    off = dist_pool.run(_scenario, 4, name, "off")
    if name != "no-pipelining-training":  # stock training wants a TransformerConfig's fields
        assert any(r["outcome"][0] == "ok" for r in stock), f"stock itself failed: {stock}"
    for rank, (want, got) in enumerate(zip(stock, off, strict=True)):
        assert got == want, f"rank {rank}: off {got} != stock {want}"


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "no-pipelining-training"])
def test_plugin_mode_refuses_on_every_rank(dist_pool, name):
    """Nothing here is a dict holding a loss mask: every rank of the step is told so."""
    results = dist_pool.run(_scenario, 4, name, "token_mean")
    for rank, result in enumerate(results):
        kind, message = result["outcome"]
        assert kind in ("StepRefused", "ProblemOnAnotherRank"), (rank, results)
        assert message.startswith("megatron_lossfix refused this step: "), (rank, message)
