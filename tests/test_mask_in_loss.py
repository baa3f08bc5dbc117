"""Masks decided inside the loss (docs/design.md §10), against the one-rank reference that applies
the same mask before counting: every mode, exact under DP, TP, PP (interleaved), CP and
Megatron's per-token path, after the schedule and through the counting pass; the zeroed
semantics (the mask counted before the forward) missing by the dropped fraction; MoE auxiliary
losses kept stock; malformed or missing kept masks refused on every rank; nothing kept at all
trains nothing, without NaN."""

from __future__ import annotations

import pytest
import torch

from megatron_lossfix import REDUCTIONS
from megatron_lossfix.audit.matrix import check_layout, parse_layout
from megatron_lossfix.audit.options import MASKED_OBJECTIVE
from megatron_lossfix.audit.oracle import OracleCase, layout_grads, relative_error
from megatron_lossfix.audit.oracle_case import COUNTED_BEFORE, COUNTING_PASS
from megatron_lossfix.audit.tiny_gpt import Layout

pytestmark = pytest.mark.oracle

TOL = 1e-5
#: Each mode as the step chooses (after the schedule, or final weights in the loss), the modes
#: that wait for a global count through the counting pass too, and the zeroed baseline.
ROWS = (
    *REDUCTIONS,
    *(m + COUNTING_PASS for m in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")),
    "token_mean" + COUNTED_BEFORE,
)
PLUGIN_ROWS = tuple(r for r in ROWS if not r.endswith(COUNTED_BEFORE))


def _masked_case(layout, **kwargs) -> OracleCase:
    model = {"no_attention": True} if layout.cp > 1 else {}
    return OracleCase(
        objective="ppo",
        rl_kwargs=dict(MASKED_OBJECTIVE),
        schedule_kwargs={"mask_in_loss": True},
        model_kwargs=model,
        **kwargs,
    )


def _assert_exact(checks, rows, what):
    bad = {r: checks[r]["error"] for r in rows if not checks[r]["error"] <= TOL}
    assert not bad, f"{what}: gradient error above {TOL}: {bad}"
    for row in rows:
        got, want = checks[row]["loss"], checks[row]["ref_loss"]
        assert got == pytest.approx(want, rel=TOL, abs=1e-9), f"{what} {row}: {got} != {want}"


def _assert_counted_before_misses_by_the_dropped_fraction(checks, what):
    """Zeroed and still counted, token_mean's gradient is the kept one times N_kept / N: it
    misses by exactly the dropped fraction, which must not be small here."""
    kept = checks["token_mean"]["reference"]["kept_token_fraction"]
    assert 0.05 < 1 - kept < 0.95, f"{what}: the mask must drop some tokens, kept {kept}"
    err = checks["token_mean" + COUNTED_BEFORE]["error"]
    assert err == pytest.approx(1 - kept, rel=1e-4), f"{what}: {err} vs dropped {1 - kept}"


LAYOUTS = ("dp2-m3", "tp2-m2", "pp2-vpp2-m4", "cp2-dp2-m2", "dp3-m1")


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_mode_with_a_mask_decided_in_the_loss(dist_pool, name):
    layout = parse_layout(name)
    case = _masked_case(layout)
    checks = check_layout(
        dist_pool, case, layout.parallel(), layout.world_size, layout.num_microbatches, ROWS
    )
    _assert_exact(checks, PLUGIN_ROWS, name)
    _assert_counted_before_misses_by_the_dropped_fraction(checks, name)
    # The step's metrics: the kept share, and N as the kept tokens.
    reference = checks["token_mean"]["reference"]
    metrics = checks["token_mean"]["result"]["metrics"]
    assert metrics["kept_token_fraction"] == pytest.approx(reference["kept_token_fraction"])
    before = checks["token_mean" + COUNTED_BEFORE]["result"]["metrics"]
    assert metrics["num_tokens"] == pytest.approx(
        before["num_tokens"] * metrics["kept_token_fraction"]
    )


@pytest.mark.parametrize("name", ["dp2-m3", "cp2-dp2-m2"])
def test_kept_groups_and_trajectories(dist_pool, name):
    """Weights over group ids take the counting pass: group_mean over the kept tokens of each
    prompt group and the groups that keep one (groups straddle DP ranks and micro-batches), the
    sequence modes over trajectories split into rows; zeroed and still counted misses."""
    layout = parse_layout(name)
    case = _masked_case(layout, trajectory_rows=2)
    rows = ("group_mean", "sequence_mean", "seq_mean_token_sum_norm", "group_mean" + COUNTED_BEFORE)
    checks = check_layout(
        dist_pool, case, layout.parallel(), layout.world_size, layout.num_microbatches, rows
    )
    _assert_exact(checks, rows[:-1], name)
    assert checks["group_mean" + COUNTED_BEFORE]["error"] > 100 * TOL, checks
    metrics = checks["group_mean"]["result"]["metrics"]
    before = checks["group_mean" + COUNTED_BEFORE]["result"]["metrics"]
    assert 0 < metrics["kept_token_fraction"] < 1
    assert metrics["num_groups"] <= before["num_groups"]


@pytest.mark.parametrize("name", ["dp2-m3", "pp2-m3"])
def test_megatrons_per_token_path(dist_pool, name):
    """calculate_per_token_loss=True: Megatron divides by the count the step hands it (the
    kept tokens), and the scale after the schedule makes that the mode's count."""
    layout = parse_layout(name)
    case = _masked_case(layout, per_token=True)
    checks = check_layout(
        dist_pool, case, layout.parallel(), layout.world_size, layout.num_microbatches, ROWS
    )
    _assert_exact(checks, PLUGIN_ROWS, f"per-token {name}")
    _assert_counted_before_misses_by_the_dropped_fraction(checks, f"per-token {name}")


def test_metrics_are_global_values(dist_pool):
    """Every metric of a masked step is the one-rank, one-micro-batch value: the loss, N and S
    of the kept tokens, the kept fractions, the objective's weighted sums and mask counts."""
    layout = parse_layout("pp2-dp2-m2")
    case = _masked_case(layout)
    rows = ("token_mean", "sequence_mean", "token_mean" + COUNTING_PASS)
    got = dist_pool.run(layout_grads, 4, layout.parallel(), case, rows, 2)[0]
    want = dist_pool.run(layout_grads, 1, Layout(), case, rows, 1)[0]
    for row in rows:
        g, w = got[row]["metrics"], want[row]["metrics"]
        assert set(g) == set(w)
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (row, key, g, w)
    metrics = want["sequence_mean"]["metrics"]
    assert metrics["kept_sequence_fraction"] < 1 and metrics["offpolicy_drop_count"] > 0


def test_sft_filter_and_packed_sequences(dist_pool):
    """weighted_loss(keep=a function of the per-token loss), on packed micro-batches: the
    sequence modes count each packed sequence's kept tokens."""
    case = OracleCase(
        sft_keep_below=5.6,
        packed=True,
        model_kwargs={"no_attention": True},
        schedule_kwargs={"mask_in_loss": True},
    )
    checks = check_layout(dist_pool, case, Layout(), 2, 3, ROWS)
    _assert_exact(checks, PLUGIN_ROWS, "packed SFT filter")
    _assert_counted_before_misses_by_the_dropped_fraction(checks, "packed SFT filter")


MOE = {"num_experts": 4}


def test_moe_aux_losses_keep_stock_megatron_through_the_counting_pass(dist_pool):
    """With MoE auxiliary and z-losses a gradient scale after the schedule would rescale them:
    the step counts in a forward-only pass instead. The main loss is exact, and the aux part
    is stock Megatron's: (plugin with aux) - (plugin without) == (stock with) - (stock without)."""
    aux = {**MOE, "moe_aux_loss_coeff": 0.5, "moe_z_loss_coeff": 0.1}
    masked = {"sft_keep_below": 5.6, "schedule_kwargs": {"mask_in_loss": True}}
    rows = ("token_mean", "sequence_mean", "off")
    grads = {}
    for name, kwargs in (("aux", aux), ("plain", MOE)):
        case = OracleCase(model_kwargs=kwargs, **masked)
        checks = check_layout(dist_pool, case, Layout(ep=2), 2, 3, rows)
        if name == "plain":
            _assert_exact(checks, rows[:2], "MoE without aux")
        for row in rows:
            grads[name, row] = checks[row]["result"]["grads"]

    def diff(row):
        return {k: grads["aux", row][k] - grads["plain", row][k] for k in grads["aux", row]}

    stock = diff("off")
    assert torch.cat([g.flatten() for g in stock.values()]).norm() > 1e-3
    for row in rows[:2]:
        err = relative_error(diff(row), stock)
        assert err <= 1e-4, f"{row}: aux/z-loss gradient differs from stock Megatron: {err}"


# ---------------------------------------------------------------- refusals and edge cases
def _kept_step(
    name: str, mode: str, variant: str, bad_rank: int, per_token: bool = False, **fields
):
    """Pool worker: one plugin step with mask_in_loss; the loss of global rank ``bad_rank``
    misbehaves as ``variant`` says (``empty``: every rank keeps nothing; ``eval``: a forward-only
    call). Returns ``("ok", {metrics, grad_abs_sum, finite, all_one, self_check_error})`` or
    ``(exception type, message)``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_lossfix import LossFixConfig, LossFixSchedule, slice_batch_for_cp, weighted_loss
    from megatron_lossfix.audit.oracle import make_global_batch, microbatch_plan
    from megatron_lossfix.audit.oracle_case import microbatch_ids
    from megatron_lossfix.audit.tiny_gpt import build_tiny_gpt, init_layout
    from megatron_lossfix.audit.training import train_step
    from megatron_lossfix.runtime.losses import weighted_sum

    layout = parse_layout(name)
    parallel = init_layout(layout.parallel())
    model = {"no_attention": True} if layout.cp > 1 else {}
    chunks, config = build_tiny_gpt(parallel, calculate_per_token_loss=per_token, **model)
    case = OracleCase()
    batch = make_global_batch(case, config.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sizes = microbatch_plan(case, dp, layout.num_microbatches)
    start = sum(sum(s) for s in sizes[:dp_rank])
    rows = torch.split(torch.arange(start, start + sum(sizes[dp_rank])), sizes[dp_rank])
    mbs = [{**{k: v[i] for k, v in batch.items()}, **microbatch_ids(case, len(i))} for i in rows]
    rank, cp_group = dist.get_rank(), ps.get_context_parallel_group()

    def forward_step(data_iterator, model):
        b = slice_batch_for_cp(next(data_iterator), cp_group)
        output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        weights, mask = b.get("loss_weights"), b["loss_mask"]  # weights: the loss stage's

        def loss(out):
            keep = out.detach() < 5.6
            if variant == "empty":
                keep = torch.zeros_like(keep)
            elif rank == bad_rank:
                if variant == "fraction":
                    keep = mask * 0.5
                elif variant == "shape":
                    keep = keep[:, :-1]
                elif variant == "no-call":
                    return weighted_sum(out, weights), (weights != 0).sum(dtype=torch.int), {}
                elif variant == "raise":
                    raise RuntimeError("the loss failed before saying what it kept")
            return weighted_loss(weights, out, keep=keep)

        return output, loss

    norm = 16.0 if mode == "seq_mean_token_sum_norm" else None
    fields = {"reduction": mode, "norm_constant": norm, "mask_in_loss": True, **fields}
    schedule = LossFixSchedule(LossFixConfig(**fields))
    try:
        if variant == "eval":  # a forward-only call (evaluation): no gradient is touched
            for chunk in chunks:
                chunk.zero_grad_buffer()
                for param in chunk.parameters():
                    param.main_grad.fill_(1.0)
            schedule(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=chunks[0],
                num_microbatches=len(mbs), seq_length=case.seq_length,
                micro_batch_size=sizes[dp_rank][0], forward_only=True,
            )  # fmt: skip
        else:
            train_step(
                schedule, forward_step, chunks, mbs, seq_length=case.seq_length,
                micro_batch_size=sizes[dp_rank][0],
            )  # fmt: skip
        metrics = schedule.step_metrics()
    except Exception as exc:  # reported to the parent, which asserts on it
        return type(exc).__name__, str(exc)
    grads = [p.main_grad for c in chunks for p in c.parameters() if p.requires_grad]
    total = float(sum(g.abs().sum() for g in grads))
    return "ok", {
        "metrics": metrics,
        "grad_abs_sum": total,
        "finite": all(bool(torch.isfinite(g).all()) for g in grads),
        "all_one": all(bool((g == 1).all()) for g in grads),
        "self_check_error": schedule.self_check.last_error if schedule.self_check else None,
    }


@pytest.mark.parametrize(
    "variant, match",
    [
        ("fraction", "values other than 0 and 1"),
        ("shape", "kept mask has shape"),
        ("no-call", "did not say which tokens it kept"),
        ("raise", "failed before saying what it kept"),
    ],
)
@pytest.mark.parametrize(
    "name, mode, bad_rank",
    [("pp2-dp2-m2", "token_mean", 3), ("cp2-m2", "sequence_mean", 1), ("dp2-m2", "group_mean", 1)],
    ids=["pp2-dp2", "cp2-sequence-mean", "dp2-group-mean-counting-pass"],
)
def test_a_bad_kept_mask_on_one_rank_stops_every_rank(
    dist_pool, variant, match, name, mode, bad_rank
):
    """One line on the rank at fault, a peer's line on every other rank, nobody left waiting
    (the CP peers of a sequence_mean step sum their kept counts per micro-batch even when one
    rank's loss failed before it got there)."""
    world = parse_layout(name).world_size
    results = dist_pool.run(_kept_step, world, name, mode, variant, bad_rank)
    for rank, result in enumerate(results):
        kind, message = result[:2]
        if rank == bad_rank:
            assert kind == "StepRefused" and match in message, (rank, result)
        else:
            assert kind in ("StepRefused", "ProblemOnAnotherRank"), (rank, result)
        assert "\n" not in message


@pytest.mark.parametrize("per_token", [False, True], ids=["mean-path", "per-token-path"])
@pytest.mark.parametrize("mode", REDUCTIONS)
def test_nothing_kept_anywhere_trains_nothing(dist_pool, mode, per_token):
    results = dist_pool.run(_kept_step, 2, "dp2-m2", mode, "empty", -1, per_token)
    for result in results:
        assert result[0] == "ok", result
        got = result[1]
        metrics = got["metrics"]
        assert got["finite"] and got["grad_abs_sum"] == 0.0
        assert metrics["num_tokens"] == 0 and metrics["kept_token_fraction"] == 0
        assert metrics["loss"] == 0.0


def test_ok_variant_runs(dist_pool):
    """The worker's well-formed step goes through (the refusals above are the variants')."""
    results = dist_pool.run(_kept_step, 2, "cp2-m2", "sequence_mean", "none", -1)
    assert all(r[0] == "ok" and r[1]["grad_abs_sum"] > 0 for r in results), results


@pytest.mark.parametrize("per_token", [False, True], ids=["mean-path", "per-token-path"])
@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_evaluation_reports_the_kept_loss_and_leaves_gradients_alone(dist_pool, mode, per_token):
    """A forward-only call (Megatron-LM's evaluate) reports L of the kept tokens, the training
    step's value, and scales no gradient (nor runs a counting pass: there is no gradient)."""
    trained = dist_pool.run(_kept_step, 2, "dp2-m2", mode, "none", -1, per_token)
    evaluated = dist_pool.run(
        _kept_step, 2, "dp2-m2", mode, "eval", -1, per_token, counting_pass=True
    )
    for train, ev in zip(trained, evaluated, strict=True):
        assert train[0] == "ok" and ev[0] == "ok", (train, ev)
        want, got = train[1]["metrics"], ev[1]["metrics"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert (
            got["num_tokens"] == want["num_tokens"] < got["num_tokens"] / got["kept_token_fraction"]
        )
        assert ev[1]["all_one"]  # every gradient element was 1 before the call, and still is


@pytest.mark.parametrize("counting_pass", [False, True], ids=["deferred", "counting-pass"])
def test_self_check_passes_with_masks_decided_in_the_loss(dist_pool, counting_pass):
    """The first step re-split (docs/design.md §9) gives the same gradient: the kept counts,
    and the scale after the schedule, do not depend on the split."""
    results = dist_pool.run(
        _kept_step, 4, "pp2-dp2-m2", "sequence_mean", "none", -1,
        self_check=True, counting_pass=counting_pass,
    )  # fmt: skip
    errors = [r[1]["self_check_error"] if r[0] == "ok" else r for r in results]
    assert all(e is not None and e <= 1e-5 for e in errors), errors
