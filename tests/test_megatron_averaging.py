"""Pins what the installed Megatron-Core does to a loss: a release that changes it fails here.

The plugin undoes Megatron's averaging exactly (``x num_microbatches x DP`` on the 2-tuple path,
the global token count on the per-token path). That is only right while Megatron averages the
way these tests assert:

* the schedule's loss step: a 2-tuple loss is multiplied by ``cp / M``; a 3-tuple loss is divided
  by ``max(num_tokens, 1)`` and by ``M``; with ``calculate_per_token_loss`` it is left alone;
* DDP divides the summed gradient by ``dp x cp``, except in per-token mode, where
  ``finalize_model_grads`` divides by the token count summed over DP x CP instead.

The second test runs Megatron's real schedule, DDP and ``finalize_model_grads`` on a model with
one weight ``w`` and output ``w * x``: the gradient of ``w`` is then exactly the sum of the
scaled ``x``, which these tests compute from the rules above.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from packaging.version import Version

from megatron_lossfix.audit.tiny_gpt import Layout, init_layout
from megatron_lossfix.step import megatron_compat

pytestmark = pytest.mark.oracle


def _calc_loss(outputs: tuple, *, per_token: bool, cp: int, num_microbatches: int) -> float:
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    config = types.SimpleNamespace(calculate_per_token_loss=per_token, timers=None)
    store: list = []
    loss, _ = forward_step_calc_loss(
        model=object(),
        output_tensor=torch.tensor(0.0),
        loss_func=lambda _: outputs,
        config=config,
        vp_stage=None,
        collect_non_loss_data=False,
        num_microbatches=num_microbatches,
        forward_data_store=store,
        cp_group_size=cp,
        is_last_stage=True,
    )
    assert store == [outputs[-1]], "the report must reach forward_data_store unchanged"
    return float(loss)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_loss_step_scaling(cp: int, num_microbatches: int) -> None:
    m = num_microbatches
    two = _calc_loss((torch.tensor(6.0), {}), per_token=False, cp=cp, num_microbatches=m)
    assert two == pytest.approx(6.0 * cp / m, rel=1e-6), "2-tuple: loss * cp / M"
    for n in (0, 1, 4):
        three = _calc_loss(
            (torch.tensor(6.0), torch.tensor(n), {}), per_token=False, cp=cp, num_microbatches=m
        )
        assert three == pytest.approx(6.0 / max(n, 1) / m, rel=1e-6), "3-tuple: / max(n,1) / M"
        per_token = _calc_loss(
            (torch.tensor(6.0), torch.tensor(n), {}), per_token=True, cp=cp, num_microbatches=m
        )
        assert per_token == 6.0, "per-token mode leaves the loss alone"


# ---------------------------------------------------------------- schedule + DDP, end to end
def _x(dp_rank: int, cp_rank: int, k: int) -> float:
    return float(1 + 10 * dp_rank + 3 * cp_rank + k)


def _n(dp_rank: int, cp_rank: int, k: int, all_zero: bool) -> int:
    return 0 if all_zero else (k + dp_rank + 2 * cp_rank) % 3  # zero-token micro-batches too


def _expected_grad(layout: Layout, m: int, arity: int, per_token: bool, all_zero: bool) -> float:
    ranks = [(d, c) for d in range(layout.dp) for c in range(layout.cp)]
    if per_token:
        total_x = sum(_x(d, c, k) for d, c in ranks for k in range(m))
        total_n = sum(_n(d, c, k, all_zero) for d, c in ranks for k in range(m))
        if total_n == 0:
            # 0.16/0.17 skip the division when no token was seen; 0.18+ divide by max(N, 1).
            return total_x
        return total_x / total_n
    if arity == 2:
        scaled = sum(_x(d, c, k) * layout.cp / m for d, c in ranks for k in range(m))
    else:
        scaled = sum(
            _x(d, c, k) / max(_n(d, c, k, all_zero), 1) / m for d, c in ranks for k in range(m)
        )
    return scaled / (layout.dp * layout.cp)


def _scalar_model_grad(
    layout: Layout, m: int, arity: int, per_token: bool, all_zero: bool
) -> tuple[float, float]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    layout = init_layout(layout)

    class Scalar(MegatronModule):
        def __init__(self, config: TransformerConfig) -> None:
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder
            self.w = torch.nn.Parameter(torch.ones(1))

        def set_input_tensor(self, tensor: torch.Tensor) -> None:
            pass

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w * x

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        context_parallel_size=layout.cp,
        calculate_per_token_loss=per_token,
        use_cpu_initialization=True,
    )
    config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(), module=Scalar(config)
    )
    d, c = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    batches = [
        (torch.tensor([_x(d, c, k)]), torch.tensor(_n(d, c, k, all_zero), dtype=torch.int))
        for k in range(m)
    ]

    def forward_step(data_iterator, chunk):
        x, n = next(data_iterator)
        out = chunk(x)
        if arity == 2:
            return out, lambda o: (o.sum(), {})
        return out, lambda o: (o.sum(), n, {})

    model.zero_grad_buffer()
    megatron_compat.schedule_for(model, ps.get_pipeline_model_parallel_group())(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=m,
        seq_length=1,
        micro_batch_size=1,
        forward_only=False,
    )
    got = float(model.module.w.main_grad)
    return got, _expected_grad(layout, m, arity, per_token, all_zero)


AVERAGING_CASES = [
    # (layout, world size, micro-batches, loss arity, per-token mode, all-zero token counts)
    pytest.param(Layout(), 1, 3, 2, False, False, id="dp1-m3-2tuple"),
    pytest.param(Layout(), 2, 3, 2, False, False, id="dp2-m3-2tuple"),
    pytest.param(Layout(cp=2), 4, 3, 2, False, False, id="cp2xdp2-m3-2tuple"),
    pytest.param(Layout(), 2, 3, 3, False, False, id="dp2-m3-3tuple"),
    pytest.param(Layout(cp=2), 4, 3, 3, False, False, id="cp2xdp2-m3-3tuple"),
    pytest.param(Layout(), 2, 3, 3, True, False, id="dp2-m3-per-token"),
    pytest.param(Layout(cp=2), 4, 3, 3, True, False, id="cp2xdp2-m3-per-token"),
    pytest.param(Layout(), 2, 2, 3, True, True, id="dp2-m2-per-token-no-tokens"),
]


@pytest.mark.parametrize("layout,world,m,arity,per_token,all_zero", AVERAGING_CASES)
def test_schedule_and_ddp_averaging(dist_pool, layout, world, m, arity, per_token, all_zero):
    results = dist_pool.run(_scalar_model_grad, world, layout, m, arity, per_token, all_zero)
    for rank, (got, expected) in enumerate(results):
        assert got == pytest.approx(expected, rel=1e-6), (
            f"rank {rank}: Megatron-Core {megatron_compat.megatron_core_version()} gave grad "
            f"{got}, the averaging the plugin undoes predicts {expected}; if Megatron changed "
            "how it averages, the plugin's compensation (megatron_compat.undo_averaging) must "
            "change with it"
        )


# ---------------------------------------------------------------- context-parallel slicing
def _cp_slices(layout: Layout, seq: int) -> tuple[int, list[float], list[float], float]:
    """Slice a batch through megatron_compat and through the Megatron-LM integration's loss path.

    Returns (cp rank, token positions kept, weight positions kept, the integration's loss)."""
    from functools import partial

    from megatron.core import parallel_state as ps

    from megatron_lossfix.integrations.megatron_lm.training import MegatronLMLossFix
    from megatron_lossfix.runtime.config import LossFixConfig
    from megatron_lossfix.step.megatron_compat import resolve_groups

    init_layout(layout)
    positions = torch.arange(seq, dtype=torch.float32)[None, :]
    batch = {"tokens": positions.clone(), "loss_weights": positions.clone() + 0.5}
    sliced = megatron_compat.slice_batch_for_cp(batch, ps.get_context_parallel_group())

    # Megatron-LM's path: pretrain_gpt slices the tokens itself; the integration slices the
    # weights it holds back from get_batch. The loss over the token slice must use the matching
    # weights: sum((p + 0.5) * p) over this rank's positions.
    wrapper = MegatronLMLossFix(LossFixConfig(reduction="token_mean"), lambda **kw: [])
    wrapper._streaming = False

    def loss_func(output_tensor, lossfix=None):
        return lossfix(output_tensor)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        tokens = megatron_compat.slice_batch_for_cp(
            {"tokens": b["tokens"]}, ps.get_context_parallel_group()
        )["tokens"]
        return tokens, partial(loss_func)

    step = wrapper._wrap_forward_step(forward_step, tp_rank=0, groups=resolve_groups())
    output, loss = step(iter([batch]), model=None)
    value = float(loss(output)[0])
    return (
        ps.get_context_parallel_rank(),
        sliced["tokens"].flatten().tolist(),
        (sliced["loss_weights"] - 0.5).flatten().tolist(),
        value,
    )


def _zigzag(cp_rank: int, cp: int, seq: int) -> list[float]:
    """Megatron's load-balanced CP split: 2*cp chunks, rank r keeps chunks r and 2*cp-1-r."""
    chunk = seq // (2 * cp)
    keep = [cp_rank, 2 * cp - 1 - cp_rank]
    return [float(p) for j in keep for p in range(j * chunk, (j + 1) * chunk)]


def test_cp_slicing_takes_this_ranks_share_under_dp(dist_pool):
    """CP2 x DP2 (4 ranks): each rank keeps 8 of 16 positions, tokens and weights alike.

    Before megatron_compat passed the CP group explicitly, megatron-core >= 0.18 sliced over the
    world group here: 4 of 16 positions ([0, 1, 14, 15] on rank 0), and the weights no longer
    lined up with the tokens of any rank."""
    seq = 16
    for cp_rank, tokens, weights, value in dist_pool.run(_cp_slices, 4, Layout(cp=2), seq):
        expected = _zigzag(cp_rank, 2, seq)
        assert tokens == expected, f"CP rank {cp_rank} kept token positions {tokens}"
        assert weights == expected, f"CP rank {cp_rank} kept weight positions {weights}"
        assert value == pytest.approx(sum((p + 0.5) * p for p in expected), rel=1e-6)


def test_slice_batch_for_cp_refuses_a_missing_group():
    with pytest.raises(ValueError, match="context-parallel group"):
        megatron_compat.slice_batch_for_cp({"tokens": torch.zeros(1, 4)}, None)


# ---------------------------------------------------------------- the supported range
def test_installed_release_is_in_the_tested_range():
    low, high = megatron_compat.TESTED_RANGE
    assert low <= megatron_compat.megatron_core_version() < high
    megatron_compat.warn_if_untested.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert megatron_compat.warn_if_untested()


def test_untested_release_warns_once_and_names_the_audit(monkeypatch):
    monkeypatch.setattr(megatron_compat, "megatron_core_version", lambda: Version("0.21.0"))
    megatron_compat.warn_if_untested.cache_clear()
    try:
        with pytest.warns(UserWarning, match="python -m megatron_lossfix audit"):
            assert not megatron_compat.warn_if_untested()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            megatron_compat.warn_if_untested()  # cached: no second warning
    finally:
        megatron_compat.warn_if_untested.cache_clear()


def test_null_tokenizer_eod_follows_the_release():
    # The Megatron-LM tests' data (tests/helpers/megatron_lm_run.py) depend on this fact.
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    eod = int(NullTokenizer(256).eod)
    if megatron_compat.megatron_core_version() >= Version("0.18"):
        assert eod == 255
    else:
        assert eod == 256
