"""LoRA (``helpers.lora``): wrapper math, frozen base, tensor-parallel correctness, and
layout-invariant adapter gradients under the plugin.

Megatron's linears need a process group even with one rank, so the "single-process" checks run
on a 1-rank world of the session pool. The tensor-parallel checks compare a 2-rank TP run of a
small column -> row block (the attention / MLP pattern) with the same block computed densely in
plain PyTorch. The gradient oracle then runs the tiny GPT with adapters (``model_hook``) under
DP, TP, PP, TP x PP x DP and (MoE) EP, and checks on every rank that the frozen weights got no
gradient and no grad buffer.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from megatron_lossfix.audit.oracle import (
    OracleCase,
    layout_grads,
    reference_grads,
    relative_error,
)
from megatron_lossfix.audit.tiny_gpt import Layout

pytestmark = pytest.mark.oracle

TOL = 1e-5
RANK = 4


def add_adapters(model: torch.nn.Module) -> None:
    """The tiny GPT's ``model_hook``: LoRA adapters of rank ``RANK`` on a frozen base (a
    module-level function, so that the pool's ranks can unpickle it)."""
    from helpers.lora import apply_lora

    apply_lora(model, rank=RANK)


CASE = OracleCase(model_kwargs={"model_hook": add_adapters})
MOE_CASE = OracleCase(model_kwargs={"model_hook": add_adapters, "num_experts": 4})
MODES = ("token_mean", "sequence_mean")


def _is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


# -- a small column -> row block of bare Megatron linears ------------------------------------------

IN, MID, OUT, SEQ, BATCH = 8, 12, 6, 4, 3


def _linear_config(tp: int, sequence_parallel: bool = False) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=IN,
        num_attention_heads=2,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
    )


class _Block(torch.nn.Module):
    """``linear_fc1`` (column-parallel) -> tanh -> ``linear_fc2`` (row-parallel, bias returned
    separately, as in Megatron's MLP). ``gathered``: fc1 gathers its output and fc2 scatters its
    input (``gather_output=True``, ``input_is_parallel=False``)."""

    def __init__(self, config: Any, gathered: bool = False) -> None:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.config = config  # read by tiny_gpt's canonical-name helpers

        def init(weight: torch.Tensor) -> torch.Tensor:
            return torch.nn.init.normal_(weight, std=0.2)

        self.linear_fc1 = ColumnParallelLinear(
            IN, MID, config=config, init_method=init, bias=True, gather_output=gathered
        )
        self.linear_fc2 = RowParallelLinear(
            MID,
            OUT,
            config=config,
            init_method=init,
            bias=True,
            input_is_parallel=not gathered,
            skip_bias_add=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.linear_fc1(x)
        out, bias = self.linear_fc2(torch.tanh(hidden))
        return out + bias


def _dense_block(p: dict[str, torch.Tensor], x: torch.Tensor, scaling: float) -> torch.Tensor:
    """The same block, unsharded, in plain PyTorch: W x + b + scaling * B (A x)."""

    def lora(prefix: str, v: torch.Tensor) -> torch.Tensor:
        base = v @ p[f"{prefix}.base.weight"].T + p[f"{prefix}.base.bias"]
        low_rank = (v @ p[f"{prefix}.lora_A.weight"].T) @ p[f"{prefix}.lora_B.weight"].T
        return base + scaling * low_rank

    return lora("linear_fc2", torch.tanh(lora("linear_fc1", x)))


def _unit_checks() -> dict[str, Any]:
    """1 rank: wrapper == base + scaling * B A x, identity at init, frozen base, error paths."""
    from helpers.lora import (
        LoRAColumnParallelLinear,
        LoRARowParallelLinear,
        apply_lora,
        lora_parameters,
    )
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lossfix.audit.tiny_gpt import init_layout

    init_layout(Layout())
    torch.manual_seed(0)
    config = _linear_config(1)
    block = _Block(config)
    x = torch.randn(SEQ, BATCH, IN)
    before = block(x).detach()
    base_fc1, base_fc2 = block.linear_fc1, block.linear_fc2
    wrapped = apply_lora(block, rank=RANK, alpha=8.0)
    out: dict[str, Any] = {"wrapped": wrapped, "scaling": block.linear_fc1.scaling}
    out["types"] = (type(block.linear_fc1), type(block.linear_fc2))
    out["same_base"] = block.linear_fc1.base is base_fc1 and block.linear_fc2.base is base_fc2
    # B = 0 at init: exactly the base model.
    out["init_identity"] = torch.equal(block(x).detach(), before)
    out["init_B_zero"] = all(
        not m.lora_B.weight.any() for m in (block.linear_fc1, block.linear_fc2)
    )
    out["init_A_bound"] = float(block.linear_fc2.lora_A.weight.abs().max()) <= 1 / math.sqrt(MID)
    out["trainable"] = sorted(n for n, p in block.named_parameters() if p.requires_grad)
    out["lora_parameters"] = sorted(n for n, _ in lora_parameters(block))

    # Nonzero adapters: the wrapped linears' outputs are base + scaling * B A x.
    for _, param in lora_parameters(block):
        with torch.no_grad():
            param.normal_(std=0.3)
    fc1, fc2 = block.linear_fc1, block.linear_fc2
    h, h_bias = fc1(x)
    want_h = base_fc1(x)[0] + fc1.scaling * (x @ fc1.lora_A.weight.T) @ fc1.lora_B.weight.T
    y, y_bias = fc2(torch.tanh(h))
    t = torch.tanh(h)
    want_y = base_fc2(t)[0] + fc2.scaling * (t @ fc2.lora_A.weight.T) @ fc2.lora_B.weight.T
    out["fc1_err"] = float((h - want_h).abs().max())
    out["fc2_err"] = float((y - want_y).abs().max())
    out["bias_passthrough"] = h_bias is None and y_bias is base_fc2.bias
    # Gradients: only adapters get one, and they equal autograd through the dense formula.
    x.requires_grad_(True)
    block(x).square().sum().backward()
    params = {n: p.detach().clone() for n, p in block.named_parameters()}
    dense_params = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    x_ref = x.detach().clone().requires_grad_(True)
    _dense_block(dense_params, x_ref, fc1.scaling).square().sum().backward()
    out["grad_err"] = {
        n: float((p.grad - dense_params[n].grad).abs().max())
        for n, p in block.named_parameters()
        if p.requires_grad
    }
    out["x_grad_err"] = float((x.grad - x_ref.grad).abs().max())
    out["frozen_grads"] = [
        n for n, p in block.named_parameters() if not _is_lora(n) and p.grad is not None
    ]
    out["wrapper_classes_ok"] = isinstance(fc1, LoRAColumnParallelLinear) and isinstance(
        fc2, LoRARowParallelLinear
    )
    # Attribute fall-through to the base linear.
    out["delegates"] = fc1.weight is base_fc1.weight and fc2.input_is_parallel

    errors = {}
    for label, call in (
        ("twice", lambda: apply_lora(block)),
        ("rank0", lambda: apply_lora(_Block(config), rank=0)),
        ("no_match", lambda: apply_lora(_Block(config), targets=("linear_qkv",))),
        (
            "after_ddp",
            lambda: apply_lora(
                DistributedDataParallel(config, DistributedDataParallelConfig(), _Block(config))
            ),
        ),
        ("not_megatron", lambda: apply_lora(_Plain(), targets=("linear_fc1",))),
    ):
        try:
            call()
            errors[label] = None
        except (ValueError, NotImplementedError) as exc:
            errors[label] = type(exc).__name__
    out["errors"] = errors
    return out


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(2, 2)


def test_wrapper_math_and_frozen_base(dist_pool):
    r = dist_pool.run(_unit_checks, 1)[0]
    assert r["wrapped"] == ["linear_fc1", "linear_fc2"]
    assert r["wrapper_classes_ok"] and r["same_base"] and r["delegates"]
    assert r["scaling"] == 8.0 / RANK
    assert r["init_identity"] and r["init_B_zero"] and r["init_A_bound"]
    lora_names = [f"{m}.lora_{f}.weight" for m in ("linear_fc1", "linear_fc2") for f in ("A", "B")]
    assert r["trainable"] == r["lora_parameters"] == sorted(lora_names)
    assert r["fc1_err"] < 1e-6 and r["fc2_err"] < 1e-6
    assert r["bias_passthrough"]
    assert sorted(r["grad_err"]) == sorted(lora_names)
    assert max(r["grad_err"].values()) < 1e-5, r["grad_err"]
    assert r["x_grad_err"] < 1e-5
    assert r["frozen_grads"] == []
    assert r["errors"] == {
        "twice": "ValueError",
        "rank0": "ValueError",
        "no_match": "ValueError",
        "after_ddp": "ValueError",
        "not_megatron": "NotImplementedError",
    }


def _gpt_structure() -> dict[str, Any]:
    """1 rank: apply_lora on the tiny GPT wraps the 4 linears of every layer, freezes the rest,
    and DDP's grad buffers hold exactly the adapters."""
    from megatron_lossfix.audit.tiny_gpt import build_tiny_gpt, init_layout

    init_layout(Layout())
    chunks, _ = build_tiny_gpt(Layout(), model_hook=add_adapters)
    (chunk,) = chunks
    names = {p: n for n, p in chunk.module.named_parameters()}
    buffers = chunk.buffers + chunk.expert_parallel_buffers
    in_buffers = [names[p] for buf in buffers for p in buf.params]
    return {
        "trainable": sorted(n for p, n in names.items() if p.requires_grad),
        "trainable_numel": sum(p.numel() for p in names if p.requires_grad),
        "all": sorted(names.values()),
        "in_buffers": sorted(in_buffers),
        "main_grads": sorted(n for p, n in names.items() if hasattr(p, "main_grad")),
    }


def test_gpt_only_adapters_trainable(dist_pool):
    r = dist_pool.run(_gpt_structure, 1)[0]
    targets = [f"self_attention.linear_{t}" for t in ("qkv", "proj")]
    targets += [f"mlp.linear_{t}" for t in ("fc1", "fc2")]
    want = sorted(
        f"decoder.layers.{i}.{t}.lora_{f}.weight" for i in range(4) for t in targets for f in "AB"
    )
    assert r["trainable"] == want
    assert r["in_buffers"] == r["main_grads"] == want
    # Every base weight is still there (frozen), renamed under `.base.`.
    assert "decoder.layers.0.self_attention.linear_qkv.base.weight" in r["all"]
    assert "embedding.word_embeddings.weight" in r["all"]
    hidden, ffn, qkv = 32, 128, 96
    per_layer = RANK * (hidden + qkv) + RANK * (hidden + hidden) + RANK * (hidden + ffn) * 2
    assert r["trainable_numel"] == 4 * per_layer


# -- tensor parallelism: sharded block vs dense ----------------------------------------------------


def _tp_block_check(gathered: bool, sequence_parallel: bool) -> dict[str, Any] | None:
    """2-rank TP run of the LoRA block (through Megatron DDP and finalize_model_grads) vs the
    dense block; returns max errors on rank 0."""
    import torch.distributed as dist
    from helpers.lora import apply_lora
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_lossfix.audit.tiny_gpt import (
        gather_full_grads,
        gather_full_params,
        init_layout,
        set_deterministic_params,
    )

    init_layout(Layout(tp=2))
    config = _linear_config(2, sequence_parallel)
    block = _Block(config, gathered)
    apply_lora(block, rank=RANK, alpha=8.0)
    # As initialized: the replicated factors agree over TP (gather_full_params checks replicas).
    gather_full_params([block], rtol=0.0)
    # Distributed checkpointing shards each factor like its weight: (global shape, fragments).
    checkpoint = {
        key: (tuple(value.global_shape), tuple(value.axis_fragmentations))
        for name in ("linear_fc1", "linear_fc2")
        for key, value in getattr(block, name).sharded_state_dict(prefix=f"{name}.").items()
        if key.endswith(".weight")
    }
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), block)
    set_deterministic_params([ddp], seed=7)  # B nonzero, so every factor gets a gradient
    full = gather_full_params([ddp])

    gen = torch.Generator().manual_seed(3)
    x_full = torch.randn(SEQ, BATCH, IN, generator=gen)
    g_full = torch.randn(SEQ, BATCH, OUT, generator=gen)
    tp_rank = ps.get_tensor_model_parallel_rank()
    # Under SP the activations entering fc1 and leaving fc2 are split along the sequence.
    x = x_full.chunk(2, dim=0)[tp_rank] if sequence_parallel else x_full
    g = g_full.chunk(2, dim=0)[tp_rank] if sequence_parallel else g_full
    x = x.clone().requires_grad_(True)
    ddp.zero_grad_buffer()
    y = ddp(x)
    (y * g).sum().backward()
    finalize_model_grads([ddp])
    grads = gather_full_grads([ddp])
    x_grads = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(x_grads, x.grad.detach().contiguous())
    ys = [torch.empty_like(y) for _ in range(2)]
    dist.all_gather(ys, y.detach().contiguous())
    if dist.get_rank() != 0:
        return None

    params = {n: p.clone().requires_grad_(True) for n, p in full.items()}
    x_ref = x_full.clone().requires_grad_(True)
    y_ref = _dense_block(params, x_ref, 8.0 / RANK)
    (y_ref * g_full).sum().backward()
    if sequence_parallel:
        y_got, x_grad = torch.cat(ys, 0), torch.cat(x_grads, 0)
    else:
        y_got, x_grad = ys[0], x_grads[0]
        # Replicated outputs and input gradients agree over TP.
        assert torch.allclose(ys[0], ys[1]) and torch.allclose(x_grads[0], x_grads[1])
    lora = sorted(n for n in params if _is_lora(n))
    return {
        "checkpoint": checkpoint,
        "y_err": float((y_got - y_ref).abs().max() / y_ref.abs().max()),
        "x_grad_err": float((x_grad - x_ref.grad).norm() / x_ref.grad.norm()),
        "grad_err": {n: relative_error({n: grads[n]}, {n: params[n].grad}) for n in lora},
        "frozen_grad_norm": float(sum(grads[n].norm() for n in params if not _is_lora(n))),
    }


@pytest.mark.parametrize(
    "gathered, sequence_parallel",
    [(False, False), (True, False), (False, True)],
    ids=["parallel", "gather-scatter", "sequence-parallel"],
)
def test_tensor_parallel_block_matches_dense(dist_pool, gathered, sequence_parallel):
    r = dist_pool.run(_tp_block_check, 2, gathered, sequence_parallel)[0]
    assert len(r["grad_err"]) == 4
    assert r["y_err"] < 1e-6
    assert r["x_grad_err"] < 1e-6
    assert max(r["grad_err"].values()) < 1e-6, r["grad_err"]
    assert r["frozen_grad_norm"] == 0.0
    assert r["checkpoint"] == {
        "linear_fc1.base.weight": ((MID, IN), (2, 1)),
        "linear_fc1.lora_A.weight": ((RANK, IN), (1, 1)),  # replicated
        "linear_fc1.lora_B.weight": ((MID, RANK), (2, 1)),  # output dim, like the base
        "linear_fc2.base.weight": ((OUT, MID), (1, 2)),
        "linear_fc2.lora_A.weight": ((RANK, MID), (1, 2)),  # input dim, like the base
        "linear_fc2.lora_B.weight": ((OUT, RANK), (1, 1)),  # replicated
    }


# -- gradient oracle over layouts ------------------------------------------------------------------


@contextmanager
def _recording_chunks():
    """Records the model chunks that `layout_grads` builds (it imports `build_tiny_gpt` from
    `tiny_gpt` when called), so that the run itself can be inspected afterwards."""
    from megatron_lossfix.audit import tiny_gpt

    built: list = []
    original = tiny_gpt.build_tiny_gpt

    def build(*args: Any, **kwargs: Any) -> tuple[list, Any]:
        chunks, config = original(*args, **kwargs)
        built.extend(chunks)
        return chunks, config

    tiny_gpt.build_tiny_gpt = build
    try:
        yield built
    finally:
        tiny_gpt.build_tiny_gpt = original


def _inspect_frozen(chunks: list) -> list[str]:
    """Problems on this rank: a frozen parameter with a gradient or a grad-buffer slot, an
    adapter without one."""
    problems = []
    for i, chunk in enumerate(chunks):
        dense = {id(p) for buf in chunk.buffers for p in buf.params}
        expert = {id(p) for buf in chunk.expert_parallel_buffers for p in buf.params}
        buffered = dense | expert
        for name, param in chunk.module.named_parameters():
            where = f"chunk {i} {name}"
            if _is_lora(name):
                # Expert adapters are reduced over the expert-DP group, as their experts are.
                right = expert if ".experts." in name and expert else dense
                if not param.requires_grad or id(param) not in right:
                    problems.append(f"{where}: adapter not trainable / in the wrong grad buffer")
                elif not param.main_grad.any():
                    problems.append(f"{where}: adapter gradient is zero")
            elif param.requires_grad or id(param) in buffered:
                problems.append(f"{where}: frozen weight trainable / in a grad buffer")
            elif param.grad is not None or getattr(param, "main_grad", None) is not None:
                problems.append(f"{where}: frozen weight has a gradient")
    return problems


def _lora_layout_run(layout: Layout, case: OracleCase, modes: tuple, m: int) -> dict[str, Any]:
    import torch.distributed as dist

    with _recording_chunks() as chunks:
        results = layout_grads(layout, case, modes, m)
    if not chunks:
        raise AssertionError("layout_grads built no chunks through tiny_gpt.build_tiny_gpt")
    return {"rank": dist.get_rank(), "results": results, "problems": _inspect_frozen(chunks)}


def _lora_references(cases: dict[str, OracleCase]) -> dict[str, Any]:
    return {key: {mode: reference_grads(c, mode) for mode in MODES} for key, c in cases.items()}


@pytest.fixture(scope="module")
def lora_references(dist_pool):
    return dist_pool.run(_lora_references, 1, {"dense": CASE, "moe": MOE_CASE})[0]


LAYOUTS = [
    # (id, case, layout, world size, micro-batches per DP rank, adapter count)
    ("dp2-m3", "dense", Layout(), 2, 3, 4 * 4 * 2),
    ("tp2-m3", "dense", Layout(tp=2), 2, 3, 4 * 4 * 2),
    ("pp2-m4", "dense", Layout(pp=2), 2, 4, 4 * 4 * 2),
    ("tp2-pp2-dp2-m3", "dense", Layout(tp=2, pp=2), 8, 3, 4 * 4 * 2),
    # 4 layers x (qkv, proj + 4 experts x (fc1, fc2)) x (A, B); the router stays frozen.
    ("ep2-moe-m3", "moe", Layout(ep=2), 2, 3, 4 * 10 * 2),
]


@pytest.mark.parametrize(
    "name, case, layout, world, m, count", LAYOUTS, ids=[row[0] for row in LAYOUTS]
)
def test_adapter_gradients_layout_invariant(
    dist_pool, lora_references, name, case, layout, world, m, count
):
    with_off = name == "dp2-m3"
    modes = (*MODES, "off") if with_off else MODES
    oracle_case = {"dense": CASE, "moe": MOE_CASE}[case]
    ranks = dist_pool.run(_lora_layout_run, world, layout, oracle_case, modes, m)
    problems = [p for r in ranks for p in r["problems"]]
    assert not problems, f"{name}: {problems[:10]}"
    results, references = ranks[0]["results"], lora_references[case]
    for mode in MODES:
        got, ref = results[mode]["grads"], references[mode]["grads"]
        lora = sorted(n for n in ref if _is_lora(n))
        assert len(lora) == count
        # Frozen weights: no gradient anywhere in the reference or the layout run.
        assert all(not ref[n].any() and not got[n].any() for n in ref if not _is_lora(n))
        assert all(ref[n].any() for n in lora), f"{mode}: an adapter has no reference gradient"
        err = relative_error({n: got[n] for n in lora}, {n: ref[n] for n in lora})
        assert err <= TOL, f"{name} {mode}: adapter gradient relative L2 error {err:.2e}"
        loss, want = results[mode]["metrics"]["loss"], references[mode]["loss"]
        assert loss == pytest.approx(want, rel=TOL)
    if with_off:
        # Stock Megatron's mean of per-micro-batch means: the adapters' gradient is wrong too.
        err = relative_error(results["off"]["grads"], references["token_mean"]["grads"])
        assert err > 1e-3, f"{name}: `off` unexpectedly matched token_mean ({err:.2e})"
