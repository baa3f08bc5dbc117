"""Fused vocab-parallel log-prob + entropy kernel vs the full-vocabulary reference.

Values and gradients (of both outputs, separately and together) are compared with
``naive_logprobs_entropy`` evaluated in fp64 on the same logits: fp32 tightly, bf16 loosely (the
kernel accumulates in fp32, only the returned bf16 gradient is rounded). A TP=2 test splits the
vocabulary over two gloo processes, started once for all TP cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lossfix.rl.logprobs import naive_logprobs_entropy, vocab_parallel_logprobs_entropy

# (atol, rtol) for values and for gradients; the gradient of bf16 logits is returned in bf16.
TOL = {
    torch.float64: {"value": (1e-12, 1e-12), "grad": (1e-12, 1e-12)},
    torch.float32: {"value": (2e-5, 1e-5), "grad": (1e-6, 1e-5)},
    torch.bfloat16: {"value": (2e-5, 1e-5), "grad": (1e-3, 8e-3)},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple, what: str) -> None:
    """allclose with a message naming the quantity, the worst element and both values there."""
    atol, rtol = tol
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bad.any() or not torch.isfinite(a).all():
        idx = tuple(int(i) for i in torch.nonzero(bad | ~torch.isfinite(a))[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"max abs err {err.max():.3e}; first at {idx}: got {a[idx]:.9g}, want {e[idx]:.9g}"
        )


def make_case(shape: tuple, vocab: int, dtype: torch.dtype, seed: int, scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    g_logp = torch.randn(shape, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(shape, generator=gen, dtype=torch.float64)
    return logits, target, g_logp, g_ent


def reference(logits, target, g_logp, g_ent):
    """fp64 full-vocabulary values and d(sum(g_logp*logp + g_ent*H))/d logits."""
    x = logits.detach().double().requires_grad_(True)
    logp, ent = naive_logprobs_entropy(x, target)
    (grad,) = torch.autograd.grad((g_logp * logp).sum() + (g_ent * ent).sum(), x)
    return logp, ent, grad


def kernel(logits, target, g_logp, g_ent, **kw):
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(x, target, **kw)
    (grad,) = torch.autograd.grad((g_logp * logp).sum() + (g_ent * ent).sum(), x)
    return logp, ent, grad


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 13)], ids=str)
@pytest.mark.parametrize("vocab", [1, 11, 97])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 4096])
def test_matches_reference(dtype, shape, vocab, chunk_size):
    case = make_case(shape, vocab, dtype, seed=vocab * 100 + chunk_size)
    logp, ent, grad = kernel(*case, chunk_size=chunk_size)
    r_logp, r_ent, r_grad = reference(*case)
    tol = TOL[dtype]
    assert logp.dtype == torch.promote_types(dtype, torch.float32) and logp.shape == shape
    assert grad.dtype == dtype
    tag = f"{dtype} {shape} V={vocab} chunk={chunk_size}"
    assert_close(logp, r_logp, tol["value"], f"logprobs [{tag}]")
    assert_close(ent, r_ent, tol["value"], f"entropy [{tag}]")
    assert_close(grad, r_grad, tol["grad"], f"d logits [{tag}]")


@pytest.mark.unit
@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_single_output_gradient(which):
    # The other output's gradient arrives as None in backward; it must count as zero.
    logits, target, _, _ = make_case((3, 7), 29, torch.float32, seed=1)
    x = logits.clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(x, target, chunk_size=5)
    out = logp if which == "logp" else ent
    (grad,) = torch.autograd.grad(out.sum(), x)
    xr = logits.double().requires_grad_(True)
    r_logp, r_ent = naive_logprobs_entropy(xr, target)
    (r_grad,) = torch.autograd.grad((r_logp if which == "logp" else r_ent).sum(), xr)
    assert_close(grad, r_grad, TOL[torch.float32]["grad"], f"d logits via {which} only")


@pytest.mark.unit
def test_gradcheck_fp64():
    logits, target, _, _ = make_case((2, 5), 13, torch.float64, seed=2)
    x = logits.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: vocab_parallel_logprobs_entropy(z, target, chunk_size=3), (x,)
    )


@pytest.mark.unit
def test_peaked_and_flat_distributions():
    # Huge logits: p_t -> 1 (logp -> 0, the target gradient 1 - p_t must not cancel to junk) and
    # p -> one-hot elsewhere; constant logits: maximal entropy log V.
    logits, target, g_l, g_h = make_case((4, 6), 50, torch.float32, seed=3, scale=200.0)
    for row_logits in (logits, torch.zeros_like(logits)):
        logp, ent, grad = kernel(row_logits, target, g_l, g_h, chunk_size=5)
        r_logp, r_ent, r_grad = reference(row_logits, target, g_l, g_h)
        assert_close(logp, r_logp, (1e-4, 1e-5), "logprobs (extreme)")
        assert_close(ent, r_ent, (1e-4, 1e-5), "entropy (extreme)")
        assert_close(grad, r_grad, (1e-5, 1e-5), "d logits (extreme)")


@pytest.mark.unit
def test_non_contiguous_logits_and_leading_dims():
    # Megatron's logits are [s, b, V]; a transposed view must work and give the same result.
    logits, target, g_l, g_h = make_case((7, 3), 19, torch.float32, seed=4)
    view = logits.transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous()
    got = kernel(view, target, g_l, g_h, chunk_size=4)
    want = reference(logits, target, g_l, g_h)
    for g, w, what in zip(got, want, ("logp", "entropy", "grad"), strict=True):
        assert_close(g, w, (2e-5, 1e-5), f"{what} (non-contiguous)")


@pytest.mark.unit
def test_out_of_vocab_targets_stay_finite():
    # Masked positions often carry -100; the kernel must not index out of bounds or make NaN.
    logits, target, g_l, g_h = make_case((3, 5), 17, torch.float32, seed=5)
    target[0, :2] = -100
    target[2, 4] = 17
    logp, ent, grad = kernel(logits, target, g_l, g_h, chunk_size=4)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    valid = (target >= 0) & (target < 17)
    r_logp, r_ent, _ = reference(logits, target.clamp(0, 16), g_l, g_h)
    assert_close(logp[valid], r_logp[valid], (2e-5, 1e-5), "logp on valid targets")
    assert_close(ent, r_ent, (2e-5, 1e-5), "entropy with invalid targets")


@pytest.mark.unit
def test_value_errors():
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="plus a vocab dim"):
        vocab_parallel_logprobs_entropy(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs_entropy(x, torch.zeros(2, 3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="floating"):
        vocab_parallel_logprobs_entropy(
            torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
        )


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: 2 gloo ranks, each with half of the vocabulary (Megatron layout).

TP = 2
TP_CASES = [
    # (shape, global vocab, dtype, chunk_size, seed)
    ((3, 7), 22, torch.float32, 4, 10),
    ((5, 13), 2 * 97, torch.float32, 7, 11),
    ((1, 1), 2, torch.float32, 4096, 12),
    ((5, 13), 2 * 50, torch.bfloat16, 6, 13),
]


def _tp_rank_results() -> list:
    """In a pool rank of a TP=2 world: every TP case on this rank's half of the vocabulary."""
    rank = dist.get_rank()
    results = []
    for shape, vocab, dtype, chunk, seed in TP_CASES:
        logits, target, g_l, g_h = make_case(shape, vocab, dtype, seed)
        v_local = vocab // TP
        shard = logits[..., rank * v_local : (rank + 1) * v_local]
        results.append(kernel(shard, target, g_l, g_h, tp_group=dist.group.WORLD, chunk_size=chunk))
    return results


@pytest.fixture(scope="module")
def tp_results(dist_pool):
    """Every TP case once on 2 pool ranks; per case, per rank (logp, H, d shard)."""
    per_rank = dist_pool.run(_tp_rank_results, TP)
    return [tuple(rank_res[i] for rank_res in per_rank) for i in range(len(TP_CASES))]


@pytest.mark.oracle
@pytest.mark.parametrize("case_idx", range(len(TP_CASES)))
def test_tensor_parallel_matches_single_rank(tp_results, case_idx):
    shape, vocab, dtype, chunk, seed = TP_CASES[case_idx]
    r_logp, r_ent, r_grad = reference(*make_case(shape, vocab, dtype, seed))
    tol = TOL[dtype]
    tag = f"TP={TP} {dtype} {shape} V={vocab} chunk={chunk}"
    for rank, (logp, ent, _) in enumerate(tp_results[case_idx]):
        # Both outputs are replicated: every rank must hold the full-vocabulary answer.
        assert_close(logp, r_logp, tol["value"], f"logprobs rank {rank} [{tag}]")
        assert_close(ent, r_ent, tol["value"], f"entropy rank {rank} [{tag}]")
    grad = torch.cat([res[2] for res in tp_results[case_idx]], dim=-1)
    assert_close(grad, r_grad, tol["grad"], f"d logits, shards concatenated [{tag}]")
