"""RL losses vs independent plain-PyTorch references (Liger-Kernel style).

Every reference below is written from the formulas with explicit per-element / per-sequence loops
and Python branches, sharing no code with ``megatron_lossfix.rl.objective``. Values and gradients
(``torch.autograd.grad``) are compared over odd shapes and dtypes. Inputs are built from a menu of
ratios kept away from the clip boundaries, so bf16 rounding cannot flip a clip decision.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_lossfix.rl.objective import (
    RLObjective,
    grpo_advantages,
    gspo_token_loss,
    kl_penalty,
    ppo_token_loss,
    rl_loss,
    rl_objective,
    scale_advantages,
)

SHAPES = [(1, 1), (3, 7), (5, 13)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
# (atol, rtol). Losses compute in fp32 even for bf16 inputs, so bf16 values are as tight as fp32;
# gradients w.r.t. bf16 inputs come back rounded to bf16.
TOL = {
    torch.float64: {"value": (1e-12, 1e-12), "grad": (1e-12, 1e-12)},
    torch.float32: {"value": (1e-5, 1e-5), "grad": (1e-6, 1e-5)},
    torch.bfloat16: {"value": (1e-5, 1e-5), "grad": (1e-3, 8e-3)},
}
EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0
# Ratios on both sides of both clip bounds and beyond the dual-clip constant, none near a bound.
RATIO_MENU = [0.3, 0.7, 0.95, 1.0, 1.1, 1.4, 2.0, 4.5]
ADV_MENU = [-1.5, -0.3, 0.0, 0.7, 2.0]


def assert_close(actual, expected, tol, what):
    """allclose with a message naming the quantity, the worst element and both values there."""
    atol, rtol = tol
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    err = (a - e).abs()
    bad = (err > atol + rtol * e.abs()) | (torch.isfinite(a) != torch.isfinite(e))
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"max abs err {err.max():.3e}; first at {idx}: got {a[idx]:.9g}, want {e[idx]:.9g}"
        )


def make_inputs(shape, dtype, seed, per_seq_adv=False):
    gen = torch.Generator().manual_seed(seed)
    pick = lambda menu, size: torch.tensor(menu, dtype=torch.float64)[  # noqa: E731
        torch.randint(0, len(menu), size, generator=gen)
    ]
    logp = -(torch.rand(shape, generator=gen, dtype=torch.float64) * 3 + 0.05)
    old = logp - pick(RATIO_MENU, shape).log()
    adv = pick(ADV_MENU, shape[:1] if per_seq_adv else shape).float()
    mask = torch.rand(shape, generator=gen) < 0.75
    if shape[0] > 1:
        mask[1] = False  # a zero-token sequence
    weights = torch.rand(shape, generator=gen) * mask
    return logp.to(dtype), old.to(dtype), adv, mask, weights


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def grad_of(out, x):
    # A reference whose every branch is clipped is a constant: its gradient is zero.
    if not out.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(out, x)
    return g


# ---------------------------------------------------------------------------------------------
# References.


def ref_ppo(logp, old, adv, eps_low, eps_high, c):
    """Per-token dual-clip PPO and its indicators with explicit branches; fp64."""
    b, s = logp.shape
    adv = adv if adv.dim() == 2 else adv[:, None].expand(b, s)
    losses, low, high, dual = [], torch.zeros(b, s), torch.zeros(b, s), torch.zeros(b, s)
    for i in range(b):
        for t in range(s):
            r = torch.exp(logp[i, t].double() - old[i, t].double().detach())
            a = float(adv[i, t])
            rv = float(r.detach())
            if a > 0 and rv > 1 + eps_high:
                loss = torch.tensor(-a * (1 + eps_high), dtype=torch.float64)  # no gradient
                high[i, t] = 1
            elif a < 0 and rv < 1 - eps_low:
                loss = torch.tensor(-a * (1 - eps_low), dtype=torch.float64)
                low[i, t] = 1
            else:
                loss = -a * r
            if c is not None and a < 0 and float(loss.detach()) > -a * c:
                loss = torch.tensor(-a * c, dtype=torch.float64)
                dual[i, t] = 1
            losses.append(loss)
    return torch.stack(losses).reshape(b, s), low, high, dual


def ref_gspo_objective(logp, old, adv, mask, weights, eps_low, eps_high):
    """Sequence-level GSPO: sum_i (sum_t w_it) * max(-A_i s_i, -A_i clip(s_i)), s_i differentiable.

    Equals the token-form weighted sum, value and gradient, whenever w is constant within each
    sequence (true for every reduction mode of the plugin).
    """
    total = torch.zeros((), dtype=torch.float64)
    seq_losses = []
    clipped = torch.zeros(logp.shape[0], 2)  # per sequence: clipped low, clipped high
    for i in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if bool(mask[i, t])]
        if not toks:
            seq_losses.append(torch.tensor(0.0, dtype=torch.float64))
            continue
        lr = sum(logp[i, t].double() - old[i, t].double() for t in toks) / len(toks)
        s = torch.exp(lr)
        a = float(adv[i])
        sv = float(s.detach())
        if a > 0 and sv > 1 + eps_high:
            loss = torch.tensor(-a * (1 + eps_high), dtype=torch.float64)
            clipped[i, 1] = 1
        elif a < 0 and sv < 1 - eps_low:
            loss = torch.tensor(-a * (1 - eps_low), dtype=torch.float64)
            clipped[i, 0] = 1
        else:
            loss = -a * s
        seq_losses.append(loss)
        total = total + sum(float(weights[i, t]) for t in toks) * loss
    return total, seq_losses, clipped


def ref_kl(logp, ref, kind):
    out = torch.empty(logp.shape, dtype=torch.float64)
    vals = []
    for lp, rf in zip(logp.double().flatten(), ref.double().flatten(), strict=True):
        if kind == "k1":
            vals.append(lp - rf)
        elif kind == "k2":
            vals.append((lp - rf) ** 2 / 2)
        else:
            vals.append(torch.exp(rf - lp) - (rf - lp) - 1)
    return torch.stack(vals).reshape(out.shape) if vals else out


def ref_grpo(rewards, groups, scale_by_std, eps):
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        vals = [float(rewards[i]) for i in idx]
        mean = statistics.fmean(vals)
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        for i in idx:
            out[i] = (float(rewards[i]) - mean) / ((std + eps) if scale_by_std else 1.0)
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# PPO.


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dual_clip_c", [None, DUAL_C])
@pytest.mark.parametrize("per_seq_adv", [False, True])
def test_ppo_matches_reference(dtype, shape, dual_clip_c, per_seq_adv):
    logp, old, adv, _, w = make_inputs(shape, dtype, seed=sum(shape), per_seq_adv=per_seq_adv)
    x, xr = leaf(logp), leaf(logp)
    loss, ind = ppo_token_loss(
        x, old, adv, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=dual_clip_c
    )
    r_loss, r_low, r_high, r_dual = ref_ppo(xr, old, adv, EPS_LOW, EPS_HIGH, dual_clip_c)
    tol, tag = TOL[dtype], f"{dtype} {shape} c={dual_clip_c} per_seq_adv={per_seq_adv}"
    assert_close(loss, r_loss, tol["value"], f"ppo loss [{tag}]")
    assert_close(ind["clip_low"], r_low, (0, 0), f"clip_low [{tag}]")
    assert_close(ind["clip_high"], r_high, (0, 0), f"clip_high [{tag}]")
    assert_close(ind["dual_clip"], r_dual, (0, 0), f"dual_clip [{tag}]")
    assert_close(ind["ratio"], torch.exp(logp.double() - old.double()), tol["value"], "ratio")
    g, gr = grad_of((w * loss).sum(), x), grad_of((w * r_loss).sum(), xr)
    assert g.dtype == dtype
    assert_close(g, gr, tol["grad"], f"d sum(w*ppo)/d logp [{tag}]")


@pytest.mark.unit
def test_ppo_covers_every_branch():
    # Guard the test data itself: the parametrized cases must exercise every clip branch.
    logp, old, adv, _, _ = make_inputs((5, 13), torch.float64, seed=18)
    _, low, high, dual = ref_ppo(logp, old, adv, EPS_LOW, EPS_HIGH, DUAL_C)
    assert low.sum() > 0 and high.sum() > 0 and dual.sum() > 0
    assert (low + high + dual == 0).any()


# ---------------------------------------------------------------------------------------------
# GSPO.


def seq_constant_weights(mask, mode):
    n = mask.sum(-1, keepdim=True).float()
    num_seqs = (n > 0).sum().clamp(min=1)  # an all-masked batch gets all-zero weights
    if mode == "sequence_mean":
        return mask / (num_seqs * n.clamp(min=1))
    return mask / mask.sum().clamp(min=1)  # token_mean


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", ["sequence_mean", "token_mean"])
@pytest.mark.parametrize("eps", [(EPS_LOW, EPS_HIGH), (3e-4, 4e-4)])
def test_gspo_matches_sequence_level_reference(dtype, shape, mode, eps):
    logp, old, adv, mask, _ = make_inputs(shape, dtype, seed=7 + sum(shape), per_seq_adv=True)
    if shape[0] > 2:
        old[2] = logp[2] - math.log(4.5)  # a sequence clipped high or low, whatever its A
    w = seq_constant_weights(mask, mode)
    x, xr = leaf(logp), leaf(logp)
    loss, ind = gspo_token_loss(x, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
    r_total, r_seq, r_clip = ref_gspo_objective(xr, old, adv, mask, w, *eps)
    tol, tag = TOL[dtype], f"{dtype} {shape} {mode} eps={eps}"
    # Per token: the sequence objective broadcast to loss tokens, exactly 0 elsewhere.
    want = torch.stack([ls.detach().expand(shape[1]) for ls in r_seq]) * mask
    assert_close(loss, want, tol["value"], f"gspo per-token loss [{tag}]")
    assert torch.isfinite(loss).all()
    assert_close((w * loss).sum(), r_total, tol["value"], f"gspo weighted sum [{tag}]")
    g, gr = grad_of((w * loss).sum(), x), grad_of(r_total, xr)
    assert_close(g, gr, tol["grad"], f"d gspo/d logp [{tag}]")
    assert (g[~mask] == 0).all(), "gradient leaked to masked tokens"
    n = mask.sum(-1).double()
    seq_ratio = torch.exp(((logp.double() - old.double()) * mask).sum(-1) / n.clamp(min=1))
    assert_close(ind["ratio"], seq_ratio[:, None].expand(shape), tol["value"], "gspo ratio")
    for k, name in enumerate(("clip_low", "clip_high")):
        want_ind = r_clip[:, k, None].expand(shape)
        assert_close(ind[name][mask], want_ind[mask], (0, 0), f"gspo {name} [{tag}]")


@pytest.mark.unit
def test_gspo_zero_token_sequences_and_garbage_padding():
    logp, old, adv, mask, w = make_inputs((3, 7), torch.float32, seed=3, per_seq_adv=True)
    mask[:] = False
    mask[0, :3] = True
    old[~mask] = float("-inf")  # padding garbage must not reach value or gradient
    x = leaf(logp)
    loss, ind = gspo_token_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert torch.isfinite(loss).all() and (loss[1:] == 0).all()
    g = grad_of((w * loss).sum(), x)
    assert torch.isfinite(g).all() and (g[1:] == 0).all()
    assert (ind["ratio"][1:] == 1).all()


# GSPO under context parallelism: the sequence dimension is split over 2 gloo ranks.
CP = 2
CP_SPLIT = 6  # tokens [0, 6) on rank 0, [6, 13) on rank 1: uneven on purpose


def _cp_case():
    logp, old, adv, mask, _ = make_inputs((5, 13), torch.float32, seed=99, per_seq_adv=True)
    mask[3, CP_SPLIT:] = False  # all of sequence 3's loss tokens on rank 0
    mask[4, :CP_SPLIT] = False  # all of sequence 4's on rank 1
    return logp, old, adv, mask, seq_constant_weights(mask, "sequence_mean")


def _cp_rank_result():
    """In a pool rank of a CP=2 world: this rank's share of the GSPO loss and gradient."""
    rank = dist.get_rank()
    logp, old, adv, mask, w = _cp_case()
    sl = slice(0, CP_SPLIT) if rank == 0 else slice(CP_SPLIT, None)
    x = leaf(logp[:, sl])
    loss, ind = gspo_token_loss(
        x, old[:, sl], adv, mask[:, sl], eps_low=0.1, eps_high=0.1, cp_group=dist.group.WORLD
    )
    local = (w[:, sl] * loss).sum()
    return local, grad_of(local, x), ind["ratio"]


@pytest.mark.oracle
def test_gspo_context_parallel_matches_unsplit(dist_pool):
    parts = dist_pool.run(_cp_rank_result, CP)
    logp, old, adv, mask, w = _cp_case()
    x = leaf(logp)
    loss, ind = gspo_token_loss(x, old, adv, mask, eps_low=0.1, eps_high=0.1)
    full = (w * loss).sum()
    tol = TOL[torch.float32]
    assert_close(sum(p[0] for p in parts), full, tol["value"], "CP=2 loss (sum over ranks)")
    g_cp = torch.cat([p[1] for p in parts], dim=1)
    assert_close(g_cp, grad_of(full, x), tol["grad"], "CP=2 d loss/d logp (shards concatenated)")
    assert_close(torch.cat([p[2] for p in parts], 1), ind["ratio"], tol["value"], "CP=2 ratio")


# ---------------------------------------------------------------------------------------------
# KL.


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_matches_reference(dtype, shape, kind):
    logp, ref, _, _, w = make_inputs(shape, dtype, seed=5 + sum(shape))
    x, xr = leaf(logp), leaf(logp)
    kl = kl_penalty(x, ref, kind)
    r_kl = ref_kl(xr, ref, kind)
    tol, tag = TOL[dtype], f"{kind} {dtype} {shape}"
    assert_close(kl, r_kl, tol["value"], f"kl [{tag}]")
    assert_close(
        grad_of((w * kl).sum(), x),
        grad_of((w * r_kl).sum(), xr),
        tol["grad"],
        f"d kl/d logp [{tag}]",
    )
    if kind != "k1":
        assert (kl >= 0).all(), f"{kind} must be non-negative"


# ---------------------------------------------------------------------------------------------
# The combined objective and its stats.


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_rl_objective_matches_reference(dtype, shape, policy_loss):
    logp, old, adv, mask, w = make_inputs(shape, dtype, seed=11 + sum(shape), per_seq_adv=True)
    if policy_loss == "gspo":  # the sequence-level reference needs per-sequence-constant weights
        w = seq_constant_weights(mask, "sequence_mean")
    gen = torch.Generator().manual_seed(1)
    ref = (logp.double() + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    ent = torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype) * 2
    # Garbage on padding, as rollouts often carry: must not leak into value, gradient or stats.
    old = old.masked_fill(~mask, float("nan"))
    ref = ref.masked_fill(~mask, float("-inf"))
    ent = ent.masked_fill(~mask, float("nan"))
    kl_coef, ent_coef = 0.05, 0.01
    c = DUAL_C if policy_loss == "ppo" else None
    x, e = leaf(logp), leaf(ent)
    total, stats = rl_objective(
        x,
        old,
        adv,
        w,
        mask,
        RLObjective(
            policy_loss=policy_loss,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            dual_clip_c=c,
            kl_coef=kl_coef,
            kl_kind="k3",
            entropy_coef=ent_coef,
        ),
        ref_logprobs=ref,
        entropy=e,
    )

    xr, er = leaf(logp), leaf(ent)
    m = mask.double()
    old_c = torch.where(mask, old, logp).double()
    ref_c = torch.where(mask, ref, logp).double()
    ent_c = torch.where(mask, er.double(), torch.zeros((), dtype=torch.float64))
    if policy_loss == "ppo":
        pg, low, high, dual = ref_ppo(xr, old_c, adv, EPS_LOW, EPS_HIGH, c)
        ratio = torch.exp(logp.double() - old_c)
        pg_sum = (w * pg).sum()
    else:
        pg_sum, _, clip = ref_gspo_objective(xr, old_c, adv, mask, w, EPS_LOW, EPS_HIGH)
        low, high = (clip[:, k, None].expand(shape) for k in range(2))
        dual = torch.zeros(shape)
        n = mask.sum(-1).double().clamp(min=1)
        ratio = torch.exp(((logp.double() - old_c) * m).sum(-1) / n)[:, None].expand(shape)
    kl = ref_kl(xr, ref_c, "k3") * m
    r_total = pg_sum + kl_coef * (w * kl).sum() - ent_coef * (w * ent_c).sum()

    tol, tag = TOL[dtype], f"{policy_loss} {dtype} {shape}"
    assert_close(total, r_total, tol["value"], f"weighted sum [{tag}]")
    g, ge = torch.autograd.grad(total, [x, e])
    gr, ger = torch.autograd.grad(r_total, [xr, er])
    assert_close(g, gr, tol["grad"], f"d objective/d logp [{tag}]")
    assert_close(ge, ger, tol["grad"], f"d objective/d entropy [{tag}]")

    sel = lambda v: v[mask].double()  # noqa: E731
    want = {
        "pg_loss_sum": pg_sum,
        "kl_sum": (w * kl).sum(),
        "entropy_sum": (w * ent_c).sum(),
        "clip_low_count": sel(low).sum(),
        "clip_high_count": sel(high).sum(),
        "dual_clip_count": sel(dual).sum(),
        "ratio_sum": sel(ratio).sum(),
        "ratio_min": sel(ratio).min() if mask.any() else torch.tensor(math.inf),
        "ratio_max": sel(ratio).max() if mask.any() else torch.tensor(-math.inf),
        "num_tokens": m.sum(),
    }
    assert set(stats) == set(want)
    for name, value in stats.items():
        assert value.dim() == 0 and not value.requires_grad, name
        # step_metrics() reduces a report entry by this suffix rule (metrics.py) and counts
        # tokens itself; any other name would be dropped from the step's metrics.
        assert name == "num_tokens" or name.endswith(("_sum", "_count", "_min", "_max")), name
        assert_close(value, want[name], (1e-4, 1e-5), f"stat {name} [{tag}]")


@pytest.mark.unit
def test_rl_objective_all_masked_is_zero_without_nan():
    logp, old, adv, _, _ = make_inputs((3, 7), torch.float32, seed=2)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    w = torch.zeros(3, 7)
    for policy_loss in ("ppo", "gspo"):
        x = leaf(logp)
        total, stats = rl_objective(
            x,
            old.fill_(float("nan")),
            adv,
            w,
            mask,
            RLObjective(policy_loss=policy_loss, kl_coef=0.1, entropy_coef=0.1),
            ref_logprobs=old,
            entropy=torch.full((3, 7), float("nan")),
        )
        assert total == 0 and (grad_of(total, x) == 0).all()
        assert stats["num_tokens"] == 0 and stats["ratio_min"] == math.inf
        assert stats["ratio_max"] == -math.inf and stats["pg_loss_sum"] == 0


@pytest.mark.unit
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rl_loss_is_rl_objective_on_the_logits(temperature):
    """The Megatron loss_func: log-probs and entropy of softmax(logits / T) at the labels (plain
    log_softmax here), on-policy tokens (has_old_logprobs 0) at ratio 1, Megatron's 3-tuple."""
    gen = torch.Generator().manual_seed(11)
    b, s, vocab = 3, 5, 17
    logits = torch.randn(b, s, vocab, generator=gen, dtype=torch.float64).float()
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    mask = (torch.rand(b, s, generator=gen) < 0.7).float()
    batch = {
        "labels": labels,
        "loss_mask": mask,
        "loss_weights": mask * torch.rand(b, s, generator=gen),
        "old_logprobs": -torch.rand(b, s, generator=gen) - 2.0,
        "ref_logprobs": -torch.rand(b, s, generator=gen) - 2.0,
        "advantages": torch.randn(b, generator=gen),
        "has_old_logprobs": (torch.arange(s) % 2).expand(b, s).float(),
    }
    objective = {"kl_coef": 0.1, "entropy_coef": 0.01, "eps_high": EPS_HIGH}
    x, xr = leaf(logits), leaf(logits)
    loss, num_tokens, stats = rl_loss(batch, x, temperature=temperature, objective=objective)
    logp_all = torch.log_softmax(xr.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    old = torch.where(batch["has_old_logprobs"] > 0, batch["old_logprobs"].double(), logp.detach())
    want, want_stats = rl_objective(
        logp,
        old,
        batch["advantages"].double(),
        batch["loss_weights"].double(),
        mask,
        RLObjective(**objective),
        ref_logprobs=batch["ref_logprobs"].double(),
        entropy=entropy,
    )
    assert_close(loss, want, (1e-6, 1e-5), "rl_loss value")
    assert_close(grad_of(loss, x), grad_of(want, xr), (1e-6, 1e-5), "rl_loss gradient")
    assert num_tokens.dtype == torch.int32 and int(num_tokens) == int((mask != 0).sum())
    assert set(stats) == set(want_stats)
    for name, value in stats.items():
        assert_close(value, want_stats[name], (1e-5, 1e-5), f"rl_loss stat {name}")


# ---------------------------------------------------------------------------------------------
# GRPO advantages and Tinker-style advantage scaling.


@pytest.mark.unit
@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("group_size", [1, 2, 3, 6])
def test_grpo_group_size_matches_reference(scale_by_std, group_size):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.0, 0.0, 3.0, 1.0, 1.0, 7.0])
    got = grpo_advantages(rewards, group_size, scale_by_std=scale_by_std, eps=1e-6)
    groups = [i // group_size for i in range(len(rewards))]
    want = ref_grpo(rewards, groups, scale_by_std, 1e-6)
    assert_close(got, want, (1e-5, 1e-5), f"grpo group_size={group_size} std={scale_by_std}")


@pytest.mark.unit
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_group_ids_matches_reference(scale_by_std):
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([7, 3, 7, 9, 3, 3, 7, 9, 42])  # arbitrary labels, interleaved, a singleton
    rewards = torch.randn(9, generator=gen, dtype=torch.float64)
    got = grpo_advantages(rewards, group_ids=ids, scale_by_std=scale_by_std, eps=1e-4)
    want = ref_grpo(rewards, ids.tolist(), scale_by_std, 1e-4)
    assert_close(got, want, TOL[torch.float64]["value"], f"grpo group_ids std={scale_by_std}")
    assert got[8] == 0, "a group of one has no baseline signal"
    # Blocks given as ids must agree with group_size.
    blocks = torch.arange(9) // 3
    assert_close(
        grpo_advantages(rewards, group_ids=blocks, scale_by_std=scale_by_std),
        grpo_advantages(rewards, 3, scale_by_std=scale_by_std),
        TOL[torch.float64]["value"],
        "grpo group_ids == group_size",
    )


@pytest.mark.unit
def test_grpo_constant_group_gives_zero_not_nan():
    got = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0]), 3)
    assert torch.isfinite(got).all() and (got[:3] == 0).all()


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=4).flatmap(
        lambda g: st.tuples(st.just(g), st.integers(1, 4))
    )
)
def test_grpo_property_zero_mean_per_group(rewards):
    group, n_groups = rewards
    r = torch.tensor(group * n_groups, dtype=torch.float64)
    for scale in (True, False):
        adv = grpo_advantages(r, len(group), scale_by_std=scale).reshape(n_groups, len(group))
        assert adv.sum(-1).abs().max() < 1e-6 * (1 + r.abs().max())


@pytest.mark.unit
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("per_seq_adv", [False, True])
def test_scale_advantages_equivalence(shape, per_seq_adv):
    logp, old, adv, _, w = make_inputs(shape, torch.float64, seed=3, per_seq_adv=per_seq_adv)
    adv, w = adv.double(), w.double()  # exact identity: compare in fp64
    x, xr = leaf(logp), leaf(logp)
    ratio = torch.exp(x - old)
    a_tok = adv[:, None].expand(shape) if per_seq_adv else adv
    scaled = scale_advantages(adv, w)
    assert scaled.shape == shape
    lhs = (-scaled * ratio).sum()
    rhs = (w * (-a_tok * torch.exp(xr - old))).sum()
    assert_close(lhs, rhs, (1e-12, 1e-12), "sum(-A_scaled*ratio) vs sum(w*-A*ratio)")
    assert_close(grad_of(lhs, x), grad_of(rhs, xr), (1e-12, 1e-12), "their gradients")


# ---------------------------------------------------------------------------------------------
# Every ValueError.


@pytest.mark.unit
def test_value_errors():
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    a = torch.zeros(2)
    cases = [
        (lambda: ppo_token_loss(lp, torch.zeros(2, 4), a), "shape mismatch"),
        (lambda: ppo_token_loss(lp, lp, torch.zeros(3)), "advantages"),
        (lambda: ppo_token_loss(lp, lp, torch.zeros(2, 3, 1)), "advantages"),
        (lambda: ppo_token_loss(lp, lp, a, eps_low=-0.1), "eps"),
        (lambda: ppo_token_loss(lp, lp, a, eps_high=-0.1), "eps"),
        (lambda: ppo_token_loss(lp, lp, a, dual_clip_c=1.0), "dual_clip_c"),
        (lambda: gspo_token_loss(lp, lp, a, m[:, :2], eps_low=0.1, eps_high=0.1), "shape"),
        (lambda: gspo_token_loss(lp, lp, a, m, eps_low=-1, eps_high=0.1), "eps"),
        (lambda: gspo_token_loss(lp, lp, torch.zeros(5), m, eps_low=0, eps_high=0), "advant"),
        (lambda: kl_penalty(lp, lp, "k4"), "unknown KL kind"),
        (lambda: kl_penalty(lp, torch.zeros(3, 2), "k1"), "shape mismatch"),
        (lambda: RLObjective(policy_loss="grpo"), "policy_loss"),
        (lambda: RLObjective(kl_kind="k9"), "unknown KL kind"),
        (lambda: RLObjective(eps_low=-0.1), "eps"),
        (lambda: rl_objective(lp, lp, a, lp, m, RLObjective(kl_coef=0.1)), "ref_logprobs"),
        (lambda: rl_objective(lp, lp, a, lp, m, RLObjective(entropy_coef=0.1)), "entropy"),
        (lambda: RLObjective(policy_loss="gspo", dual_clip_c=3.0), "dual"),
        (lambda: rl_objective(lp, lp, a, torch.zeros(2, 2), m), "shape mismatch"),
        (lambda: rl_objective(lp, lp, a, lp, m, ref_logprobs=torch.zeros(1)), "shape"),
        (lambda: rl_objective(lp, lp, a, lp, m, entropy=torch.zeros(1)), "shape"),
        (lambda: grpo_advantages(torch.zeros(2, 2), 2), "1-D"),
        (lambda: grpo_advantages(torch.zeros(4)), "exactly one"),
        (lambda: grpo_advantages(torch.zeros(4), 2, torch.zeros(4, dtype=torch.long)), "exactly"),
        (lambda: grpo_advantages(torch.zeros(4), 3), "divide"),
        (lambda: grpo_advantages(torch.zeros(4), 0), "divide"),
        (lambda: grpo_advantages(torch.zeros(4), group_ids=torch.zeros(4)), "integer"),
        (
            lambda: grpo_advantages(torch.zeros(4), group_ids=torch.zeros(3, dtype=torch.long)),
            "shape",
        ),
        (lambda: scale_advantages(torch.zeros(3), lp), "advantages"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
