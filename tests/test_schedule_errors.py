"""Hostile inputs to the schedule hook: every one fails with a message a user can act on, and
data-dependent failures on one data-parallel rank stop every rank instead of hanging them."""

from __future__ import annotations

import math
import re
from functools import partial

import pytest
import torch

from megatron_lossfix import LossFixConfig, weighted_loss
from megatron_lossfix.audit.oracle import OracleCase, make_global_batch, microbatch_plan
from megatron_lossfix.audit.tiny_gpt import Layout
from megatron_lossfix.runtime.losses import weighted_sum

pytestmark = pytest.mark.oracle


def _forward_step(loss_variant, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    weights = batch.get("loss_weights", batch["loss_mask"])
    if loss_variant == "one-tuple":
        return output, lambda out: (weighted_sum(out, weights),)
    if loss_variant == "two-tuple":
        return output, lambda out: (weighted_sum(out, weights), {})
    if loss_variant == "vector-loss":
        return output, lambda out: ((out * weights).sum(dim=1), torch.tensor(1), {})
    if loss_variant == "nan-on-second":

        def loss(out):
            value, n, report = weighted_loss(weights, out)
            is_second = float(batch["tokens"][0, 0] == SECOND_TOKEN)
            return value + (math.nan if is_second else 0.0), n, report

        return output, loss
    return output, partial(weighted_loss, weights)


SECOND_TOKEN = -1


def _step(
    mode_by_rank,
    *,
    m=3,
    mutate=None,
    loss_variant="plain",
    per_token=False,
    model_kwargs=None,
    **cfg,
):
    """One step on DP ranks; returns ``("ok", None)`` or ``(exception type, message)``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit.tiny_gpt import build_tiny_gpt, init_layout
    from megatron_lossfix.step.schedule import LossFixSchedule

    global SECOND_TOKEN
    init_layout(Layout())
    rank = dist.get_rank()
    if isinstance(per_token, tuple):  # one flag per rank
        per_token = per_token[rank]
    chunks, config = build_tiny_gpt(
        Layout(), calculate_per_token_loss=per_token, **(model_kwargs or {})
    )
    case = OracleCase()
    batch = make_global_batch(case, config.vocab_size)
    dp = ps.get_data_parallel_world_size()
    sizes = microbatch_plan(case, dp, m)[rank]
    start = sum(sizes) * rank
    local = {k: v[start : start + sum(sizes)] for k, v in batch.items()}
    index = torch.split(torch.arange(sum(sizes)), sizes)
    mbs = [{k: v[i] for k, v in local.items()} for i in index]
    SECOND_TOKEN = int(mbs[1]["tokens"][0, 0]) if len(mbs) > 1 else -1
    num_microbatches = m
    if mutate is not None:
        mbs, num_microbatches = mutate(rank, mbs, num_microbatches)
    schedule = LossFixSchedule(LossFixConfig(reduction=mode_by_rank[rank], **cfg))
    try:
        schedule(
            forward_step_func=partial(_forward_step, loss_variant),
            data_iterator=iter(mbs),
            model=chunks[0],
            num_microbatches=num_microbatches,
            seq_length=case.seq_length,
            micro_batch_size=2,
        )
    except Exception as exc:  # reported to the parent, which asserts on it
        return type(exc).__name__, str(exc)
    return "ok", None


def _run(pool, *args, world=2, **kwargs):
    return pool.run(_step, world, *args, **kwargs)


# ---------------------------------------------------------------- cross-rank problems
REFUSED = "StepRefused"  # the rank whose data is at fault
PEER = "ProblemOnAnotherRank"  # every other rank of the step (a StepRefused too)


@pytest.mark.parametrize(
    "modes",
    [("token_mean", "sequence_mean"), ("sum", "token_mean_legacy"), ("token_mean", "sum")],
)
def test_ranks_disagreeing_on_the_mode_all_raise(dist_pool, modes):
    """(``off`` against a plugin mode cannot be seen: ``off`` is stock and communicates
    nothing, so the plugin rank waits in its all-reduce; see docs/limits.md.)"""
    results = _run(dist_pool, modes)
    for kind, message in results:
        assert kind == REFUSED and "disagree on the loss reduction" in message, results


def test_ranks_disagreeing_on_per_token_mode_all_raise(dist_pool):
    results = _run(dist_pool, ("token_mean", "token_mean"), per_token=(False, True))
    for kind, message in results:
        assert kind == REFUSED and "calculate_per_token_loss" in message, results


def _fractional_mask_on_rank1(rank, mbs, m):
    if rank == 1:
        mbs[2] = {**mbs[2], "loss_mask": mbs[2]["loss_mask"] * 0.5}
    return mbs, m


def _negative_mask_on_rank0(rank, mbs, m):
    if rank == 0:
        mbs[0] = {**mbs[0], "loss_mask": -mbs[0]["loss_mask"]}
    return mbs, m


@pytest.mark.parametrize("per_token", [False, True], ids=["", "per-token"])
@pytest.mark.parametrize(
    "mutate, bad_rank, k",
    [(_fractional_mask_on_rank1, 1, 2), (_negative_mask_on_rank0, 0, 0)],
    ids=["fractional", "negative"],
)
def test_bad_mask_on_one_rank_stops_every_rank(dist_pool, mutate, bad_rank, k, per_token):
    """Per-token token_mean (Megatron divides) is checked before the step like every mode."""
    results = _run(dist_pool, ("token_mean", "token_mean"), mutate=mutate, per_token=per_token)
    kind, message = results[bad_rank]
    assert kind == REFUSED and f"micro-batch {k} must hold only 0 and 1" in message, results
    kind, message = results[1 - bad_rank]
    assert kind == PEER, results
    assert f"a loss mask holds values other than 0 and 1 (reported by global rank {bad_rank}" in (
        message
    )


def _short_iterator_on_rank1(rank, mbs, m):
    return (mbs[:2] if rank == 1 else mbs), m


def test_num_microbatches_disagreeing_with_the_data(dist_pool):
    results = _run(dist_pool, ("sequence_mean", "sequence_mean"), mutate=_short_iterator_on_rank1)
    assert results[1][0] == REFUSED and "ran out after 2 micro-batches" in results[1][1]
    assert results[0][0] == PEER and "ran out before num_microbatches" in results[0][1]


def test_off_asks_nothing_of_the_masks(dist_pool):
    """``off`` is stock Megatron: a fractional mask is the user's business, not refused."""
    assert _run(dist_pool, ("off", "off"), mutate=_fractional_mask_on_rank1) == [("ok", None)] * 2


def _drop_mask(rank, mbs, m):
    return [{k: v for k, v in mb.items() if k != "loss_mask"} for mb in mbs], m


def _zero_microbatches(rank, mbs, m):
    return mbs, 0


@pytest.mark.parametrize(
    "mutate, kind, match",
    [
        (_drop_mask, REFUSED, "holding the loss mask under 'loss_mask'"),
        (_zero_microbatches, "ValueError", "positive"),
    ],
    ids=["missing-mask", "no-microbatches"],
)
def test_malformed_step_inputs(dist_pool, mutate, kind, match):
    results = _run(dist_pool, ("token_mean", "token_mean"), mutate=mutate, world=1)
    assert results[0][0] == kind and match in results[0][1], results


# ---------------------------------------------------------------- loss function contract
@pytest.mark.parametrize(
    "variant, per_token, match",
    [
        ("one-tuple", False, "must return (loss, num_tokens, report) or (loss, report)"),
        ("two-tuple", True, "calculate_per_token_loss=True needs loss_func to return"),
        ("vector-loss", False, "one-element loss tensor"),
    ],
)
def test_loss_function_arity_and_shape(dist_pool, variant, per_token, match):
    results = _run(
        dist_pool, ("sequence_mean",), world=1, loss_variant=variant, per_token=per_token
    )
    # Found inside Megatron's schedule: the step ends, then is refused (StepRefused is a
    # ValueError) with the loss function's own message.
    kind, message = results[0]
    assert kind == "StepRefused" and "ValueError: " in message and match in message, results


def test_two_tuple_works_without_per_token_mode(dist_pool):
    assert _run(dist_pool, ("token_mean",), world=1, loss_variant="two-tuple") == [("ok", None)]


def test_check_finite_names_the_microbatch(dist_pool):
    results = _run(
        dist_pool, ("token_mean",), world=1, loss_variant="nan-on-second", check_finite=True
    )
    kind, message = results[0]
    assert kind == "StepRefused" and "FloatingPointError" in message, results
    assert "micro-batch 1" in message, results
    # Without the check the NaN flows on silently (the flag exists because checking syncs).
    assert _run(dist_pool, ("token_mean",), world=1, loss_variant="nan-on-second") == [("ok", None)]


def _nan_advantages_in_microbatch_2(rank, mbs, m):
    out = []
    for k, mb in enumerate(mbs):
        adv = torch.ones(mb["tokens"].shape)
        if k == 2:
            adv[0, 3] = math.nan
        out.append({**mb, "advantages": adv})
    return out, m


def test_check_finite_names_a_nan_input_tensor(dist_pool):
    """A plugin mode's check (``off`` looks at no batch: it is stock Megatron)."""
    results = _run(
        dist_pool,
        ("token_mean",),
        world=1,
        mutate=_nan_advantages_in_microbatch_2,
        check_finite=True,
    )
    assert results[0][0] == "FloatingPointError", results
    assert "micro-batch 2: 'advantages' holds NaN or Inf" in results[0][1]


# ---------------------------------------------------------------- single-process contract
def test_weighted_sum_refuses_mask_shape_mismatch():
    with pytest.raises(ValueError, match=r"per-token loss has shape \(2, 5\).*\(2, 4\)"):
        weighted_sum(torch.zeros(2, 5), torch.zeros(2, 4))


def test_weighted_sum_ignores_garbage_on_zero_weight_tokens():
    losses = torch.tensor([[1.0, math.nan, math.inf]], requires_grad=True)
    weights = torch.tensor([[0.5, 0.0, 0.0]])
    value = weighted_sum(losses, weights)
    value.backward()
    assert value.item() == 0.5
    assert torch.equal(losses.grad, torch.tensor([[0.5, 0.0, 0.0]]))


def test_hybrid_context_parallel_is_refused_before_any_collective():
    """Megatron 0.19's hybrid CP calls forward_step per sub-sample: a plugin mode refuses it on
    every rank alike (the setting is the same everywhere), naming what to use instead. No
    process group exists here, so reaching any collective would fail differently."""
    from types import SimpleNamespace

    from megatron_lossfix import LossFixSchedule, StepRefused

    model = SimpleNamespace(config=SimpleNamespace(hybrid_context_parallel=True))
    schedule = LossFixSchedule(LossFixConfig(reduction="sequence_mean"))
    with pytest.raises(StepRefused, match="hybrid_context_parallel=True.*--loss-reduction off"):
        schedule(forward_step_func=None, data_iterator=iter([]), model=[model], num_microbatches=2)


# ---------------------------------------------------------------- multi-token prediction
MTP = {"model_kwargs": {"mtp_num_layers": 1}}


def test_mtp_needs_the_loss_mask_passed_to_the_model(dist_pool):
    """This forward step calls the model without ``loss_mask``: Megatron would then weigh MTP
    by a mask of ones; every rank refuses the step, saying what to pass."""
    results = _run(dist_pool, ("token_mean", "token_mean"), **MTP)
    for kind, message in results:
        assert kind == REFUSED, results
        assert "pass the loss mask to the model" in message, results


def _packed(rank, mbs, m):
    b, s = mbs[0]["tokens"].shape
    packed = [{k: v.reshape(1, -1) for k, v in mb.items()} for mb in mbs]
    for mb in packed:
        mb["cu_seqlens"] = torch.arange(0, mb["tokens"].shape[1] + 1, s, dtype=torch.int32)
    return packed, m


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"data_is_cp_sharded": True}, "needs whole sequences from the data iterator"),
        ({"mutate": _packed}, "packed micro-batches .cu_seqlens. with multi-token prediction"),
    ],
    ids=["cp-sharded-data", "packed"],
)
def test_mtp_refuses_what_it_cannot_normalize(dist_pool, kwargs, match):
    results = _run(dist_pool, ("sequence_mean", "sequence_mean"), **MTP, **kwargs)
    for kind, message in results:
        assert kind == REFUSED and re.search(match, message), results
