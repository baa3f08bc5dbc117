"""``LossFixConfig(self_check=True)`` on the tiny GPT through real Megatron-Core schedules (pool
ranks): it passes for the plugin's loss under DP, PP (1F1B and interleaved), the distributed
optimizer, dropout, the per-token path and MTP, leaves training exactly as a run without it, and
catches double-scaled losses on every rank. The re-split plans are in test_resplit.py."""

from __future__ import annotations

import argparse
import warnings
from functools import partial

import pytest
import torch
from helpers.memory import MARK, tensor_peak

from megatron_lossfix import LossFixConfig, LossFixSchedule, SelfCheckError
from megatron_lossfix.args import add_lossfix_args, from_args
from megatron_lossfix.audit.tiny_gpt import Layout
from megatron_lossfix.step.selfcheck import SelfCheck

# ------------------------------------------------------------------------------ skipping


class _FakeStep:
    def __init__(self):
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        return ["ok"]


@pytest.mark.unit
@pytest.mark.parametrize("reduction", ["off", "token_mean_legacy"])
def test_split_dependent_modes_are_skipped(reduction):
    inner = _FakeStep()
    check = SelfCheck(LossFixConfig(reduction=reduction, self_check=True))
    call = dict(forward_step_func=None, data_iterator=None, model=None, num_microbatches=2)
    assert check.due({})
    with pytest.warns(UserWarning, match="depends on the micro-batch split"):
        out = check.run(inner, call)
    assert out == ["ok"] and inner.calls == 1
    assert not check.due({})  # the first training step only


@pytest.mark.unit
def test_off_schedule_with_the_check_passes_its_step_through():
    """``off`` with ``self_check=True``: a warning, and the wrapped function's result as is."""
    seen = []

    def forward_backward(**kwargs):
        seen.append(kwargs)
        return ["stock"]

    schedule = LossFixSchedule(LossFixConfig(reduction="off", self_check=True), forward_backward)
    call = dict(forward_step_func=len, data_iterator=None, model=None, num_microbatches=2)
    with pytest.warns(UserWarning, match="self-check skipped"):
        assert schedule(**call) == ["stock"]
    assert schedule(**call) == ["stock"] and len(seen) == 2
    assert seen[0]["forward_step_func"] is len and schedule.self_check.checked


@pytest.mark.unit
def test_self_check_from_flags():
    parser = add_lossfix_args(argparse.ArgumentParser())
    config = from_args(parser.parse_args(["--loss-reduction", "token_mean"]))
    assert config.self_check is None and LossFixSchedule(config).self_check is not None
    config = from_args(parser.parse_args(["--loss-reduction", "sum", "--no-lossfix-self-check"]))
    assert config.self_check is False and LossFixSchedule(config).self_check is None
    assert from_args(parser.parse_args(["--no-lossfix-self-check"])) is None  # stock: fine
    flags = ["--loss-reduction", "sum", "--lossfix-self-check"]
    config = from_args(parser.parse_args([*flags, "--lossfix-self-check-tolerance", "1e-3"]))
    assert config.self_check and config.self_check_tolerance == 1e-3
    assert LossFixSchedule(config).self_check.tolerance == 1e-3
    with pytest.raises(ValueError, match="needs --loss-reduction"):
        from_args(parser.parse_args(["--lossfix-self-check"]))
    with pytest.raises(ValueError, match="self_check_tolerance"):
        LossFixConfig(self_check=True, self_check_tolerance=float("nan"))


@pytest.mark.unit
def test_recorder_reads_next_only_iterators_and_keeps_copies():
    """Megatron-LM wraps data in RerunDataIterator, which has ``__next__`` and no ``__iter__``;
    forward_step may pop keys from the dict it gets, which must not reach the record."""
    from megatron_lossfix.step.counting_pass import recorded

    class NextOnly:
        def __init__(self, items):
            self._items = iter(items)

        def __next__(self):
            return next(self._items)

    batches = [{"tokens": torch.ones(2), "tag": 1}, {"tokens": torch.zeros(2), "tag": 2}]
    seen: list = []
    recorder = recorded(NextOnly(batches), seen)
    first = next(recorder)
    assert first is batches[0]
    first.pop("tag")
    assert next(recorder) is batches[1]
    with pytest.raises(StopIteration):
        next(recorder)
    assert [b["tag"] for b in seen] == [1, 2]


@pytest.mark.unit
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "sum"])
def test_plugin_modes_check_their_first_step_by_default(reduction, capsys):
    """On unless opted out; not in the modes that depend on the split; a default check of a
    step it cannot check says so in one line, an asked-for one warns."""
    assert LossFixConfig().self_check is None
    schedule = LossFixSchedule(LossFixConfig(reduction=reduction))
    assert schedule.self_check is not None and not schedule.self_check.explicit
    assert LossFixSchedule(LossFixConfig(reduction=reduction, self_check=False)).self_check is None
    for mode in ("off", "token_mean_legacy"):
        assert LossFixSchedule(LossFixConfig(reduction=mode)).self_check is None
    call = dict(forward_step_func=None, data_iterator=None, model=None, num_microbatches=2)
    inner = _FakeStep()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default says so in one line, no warning
        assert schedule.self_check.run(inner, call) == ["ok"] and inner.calls == 1
    said = capsys.readouterr().out.splitlines()
    assert said == ["megatron_lossfix self-check: not run on the first step: the model is not "
                    "a torch.nn.Module: no gradient to compare"]  # fmt: skip
    asked = SelfCheck(LossFixConfig(reduction=reduction, self_check=True))
    with pytest.warns(UserWarning, match="self-check skipped: the model is not a torch.nn"):
        assert asked.run(inner, call) == ["ok"]
    with pytest.raises(ValueError, match=r"self_check \(--\[no-\]lossfix-self-check\) must be"):
        LossFixConfig(self_check="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ on the tiny GPT


def _double_scaled_loss(weights, output_tensor, **_):
    """The bug to catch: the plugin-weighted sum divided again by the micro-batch's tokens."""
    from megatron_lossfix.runtime.losses import weighted_sum

    num_tokens = (weights != 0).sum(dtype=torch.int)
    return weighted_sum(output_tensor, weights) / num_tokens.clamp(min=1), num_tokens, {}


def _mask_mean_loss(mask, output_tensor, **_):
    """The other bug: a per-micro-batch masked mean that ignores the plugin's weights."""
    return (output_tensor * mask).sum() / mask.sum().clamp(min=1), {}


def _raw_count_loss(batch, output_tensor, **_):
    """The plugin's weighted sum, then divided by the micro-batch's raw loss-mask count: the
    habit of anyone who normalized by tokens before."""
    from megatron_lossfix.runtime.losses import weighted_loss

    loss, num_tokens, report = weighted_loss(batch["loss_weights"], output_tensor)
    return loss / batch["loss_mask"].sum(), num_tokens, report


def _per_sequence_loss(batch, output_tensor, **_):
    """The weighted sum divided by the micro-batch's number of sequences (its rows; packed: its
    ``cu_seqlens`` sequences)."""
    from megatron_lossfix.runtime.losses import weighted_loss

    loss, num_tokens, report = weighted_loss(batch["loss_weights"], output_tensor)
    cu_seqlens = batch.get("cu_seqlens")
    sequences = len(batch["tokens"]) if cu_seqlens is None else len(cu_seqlens) - 1
    return loss / sequences, num_tokens, report


def _mask_share_loss(batch, output_tensor, **_):
    """The weighted sum scaled by another quantity of its own micro-batch: the share of its
    positions that are loss tokens."""
    from megatron_lossfix.runtime.losses import weighted_loss

    loss, num_tokens, report = weighted_loss(batch["loss_weights"], output_tensor)
    return loss * batch["loss_mask"].float().mean(), num_tokens, report


def _sequence_statistic_loss(batch, output_tensor, **_):
    """A right loss that reads its mask: each token's loss times its sequence's mean loss over
    the mask (a statistic over the whole sequence, as GSPO's ratio), weighed by the plugin's
    weights. The check must pass it."""
    from megatron_lossfix.runtime.losses import weighted_sum
    from megatron_lossfix.runtime.weights import segment_ids

    mask, losses = batch["loss_mask"].float(), output_tensor.float()
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        index = torch.arange(len(mask))[:, None].expand(mask.shape)
    else:
        index = segment_ids(cu_seqlens, mask.shape[-1])[0].expand(mask.shape)
    flat = index.reshape(-1)
    size = int(flat.max()) + 1
    sums = torch.zeros(size).index_add(0, flat, (mask * losses).reshape(-1))
    counts = torch.zeros(size).index_add(0, flat, mask.reshape(-1))
    means = (sums / counts.clamp(min=1))[flat].view(mask.shape)
    return weighted_sum(losses * means, batch["loss_weights"]), {}


WRONG = {"raw_count": _raw_count_loss, "per_sequence": _per_sequence_loss,
         "mask_share": _mask_share_loss}  # fmt: skip


def _broadcast_first_stage_batch(data_iterator, rows: int) -> dict:
    """Megatron-LM's ``get_batch_on_this_tp_rank`` on a first (non-loss) pipeline stage: TP rank
    0 reads, the others receive into buffers of the configured micro-batch shape."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    src = ps.get_tensor_model_parallel_src_rank()
    if ps.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        tokens, position_ids = batch["tokens"], batch["position_ids"]
    else:
        tokens = torch.empty((rows, 16), dtype=torch.long)
        position_ids = torch.empty((rows, 16), dtype=torch.long)
    for tensor in (tokens, position_ids):
        dist.broadcast(tensor, src, group=group)
    return {"tokens": tokens, "position_ids": position_ids, "labels": None}


def _forward_step(loss: str, counter: list, broadcast_rows, data_iterator, model):
    from megatron.core import parallel_state as ps

    from megatron_lossfix.runtime.losses import weighted_loss

    counter[0] += 1
    if counter[0] == counter[1]:  # a model error on this rank only (the test's choice)
        raise RuntimeError(f"the model failed on forward step {counter[0]}")
    if broadcast_rows and not ps.is_pipeline_last_stage():
        batch = _broadcast_first_stage_batch(data_iterator, broadcast_rows)
    else:
        batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        loss_mask=batch.get("loss_mask"),  # MTP layers read it inside the model
    )
    if loss == "double":
        return output, partial(
            _double_scaled_loss, batch.get("loss_weights", batch.get("loss_mask"))
        )
    if loss == "mask_mean":
        return output, partial(_mask_mean_loss, batch["loss_mask"])
    if loss in WRONG:
        return output, partial(WRONG[loss], batch)
    if loss == "sequence_statistic":
        return output, partial(_sequence_statistic_loss, batch)
    return output, partial(weighted_loss, batch.get("loss_weights", batch.get("loss_mask")))


def _break_finalize(config, how: str, dp_rank: int) -> None:
    """Loops that reduce wrongly while DDP and a ``finalize_model_grads_func`` are in place, so
    the structural guard passes them: ``no-reduce`` (a finalize function that forgets the
    data-parallel reduction), ``rank-factor`` (Megatron's reduction, then a factor that depends
    on the rank, like a per-rank normalization after the all-reduce)."""
    from megatron.core.distributed import finalize_model_grads

    if how == "no-reduce":
        config.finalize_model_grads_func = lambda *args, **kwargs: None
    elif how == "rank-factor":

        def finalize(model, *args, **kwargs):
            finalize_model_grads(model, *args, **kwargs)
            for chunk in model:
                for param in chunk.parameters():
                    if param.requires_grad:
                        param.main_grad.mul_(1.0 + dp_rank)

        config.finalize_model_grads_func = finalize


def _check_on_rank(
    layout: Layout,
    m: int,
    loss: str = "plugin",
    reduction: str = "token_mean",
    per_token: bool = False,
    broadcast: bool = False,
    finalize: str = "megatron",
    self_check: bool | None = True,
    peaks: bool = False,
    packed: bool = False,
    seq: int = 16,
    fail_at: tuple[int, int] | None = None,
    **model_kwargs,
) -> dict:
    """A plain step, then the same step under the self-check (``self_check``: the config's
    value, None: its default), then a second checked step; every rank returns what it saw
    (rank 0 also compares the full gradients; ``peaks``: the tensor peaks of the first two
    schedule calls, and the gradients' bytes; ``packed``: each micro-batch one THD row with
    ``cu_seqlens``, on a model without attention, which then mixes nothing across sequences;
    ``fail_at``: (rank, n), forward_step raises on that rank at its n-th call of the checked
    step)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_lossfix.audit.oracle import OracleCase, make_global_batch, microbatch_plan
    from megatron_lossfix.audit.oracle_case import id_ranges
    from megatron_lossfix.audit.tiny_gpt import (
        build_tiny_gpt,
        gather_full_grads,
        init_layout,
        set_deterministic_params,
    )

    init_layout(layout)
    if packed:
        model_kwargs["no_attention"] = True
    chunks, config = build_tiny_gpt(
        layout, seq_len=seq, calculate_per_token_loss=per_token, **model_kwargs
    )
    set_deterministic_params(chunks, 1234)
    _break_finalize(config, finalize, ps.get_data_parallel_rank())
    case = OracleCase(seq_length=seq)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sizes = microbatch_plan(case, dp, m)[rank]
    batch = make_global_batch(case, config.vocab_size)
    start = rank * sum(sizes)
    local = {k: v[start : start + sum(sizes)] for k, v in batch.items()}
    parts = {k: torch.split(v, sizes) for k, v in local.items()}
    mbs = [{k: parts[k][i] for k in local} | id_ranges(case) for i in range(m)]
    if packed:  # [1, b*s] rows with their sequence boundaries (ids stay one per sequence)
        mbs = [
            {
                k: v.reshape(1, -1) if torch.is_tensor(v) and v.dim() > 1 else v
                for k, v in mb.items()
            }
            | {"cu_seqlens": torch.arange(0, mb["tokens"].numel() + 1, 16, dtype=torch.int32)}
            for mb in mbs
        ]
    counter = [0, 0]
    peak_bytes = []

    def step(schedule):
        torch.manual_seed(7)  # dropout: the same masks for the plain and the checked run
        model_parallel_cuda_manual_seed(7)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        counter[0] = 0
        iterators = [iter(mbs) for _ in chunks]
        if broadcast and not ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank():
            iterators = [None for _ in chunks]  # as Megatron-LM: data on TP rank 0 only
        call = partial(
            schedule,
            forward_step_func=partial(
                _forward_step, loss, counter, sizes[0] if broadcast else None
            ),
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=m,
            seq_length=seq * (sizes[0] if packed else 1),
            micro_batch_size=1 if packed else sizes[0],
            forward_only=False,
        )
        peak_bytes.append(tensor_peak(call)[1:]) if peaks else call()
        # (gather_full_grads asserts that DP replicas agree: not so when reduced wrongly)
        grads = gather_full_grads(chunks) if finalize == "megatron" else None
        return grads, torch.get_rng_state(), counter[0], schedule.step_metrics()["loss"]

    norm = 16.0 if reduction == "seq_mean_token_sum_norm" else None
    config_ = LossFixConfig(reduction=reduction, norm_constant=norm, self_check=False)
    if peaks:  # one-time allocations of a first step out of the measured ones
        step(LossFixSchedule(config_))
    if finalize == "megatron":
        plain, plain_rng, plain_calls, plain_loss = step(LossFixSchedule(config_))
    asked = {} if self_check is None else {"self_check": self_check}
    schedule = LossFixSchedule(LossFixConfig(reduction=reduction, norm_constant=norm, **asked))
    if peaks:  # each of the check's runs marked, to read what is live when it starts
        schedule.step = _Marked(schedule.step)
    checker = schedule.self_check or SelfCheck(config_)  # opted out: a check that never ran
    if fail_at is not None and fail_at[0] == torch.distributed.get_rank():
        counter[1] = fail_at[1]
    try:
        checked, checked_rng, checked_calls, checked_loss = step(schedule)
    except (SelfCheckError, RuntimeError) as exc:
        if fail_at is None and not isinstance(exc, SelfCheckError):
            raise
        # Every rank must reach the verdict, or the others would hang in the next collective.
        return {
            "raised": str(exc),
            "error": checker.last_error,
            "spread": checker.last_replica_spread,
        }
    second, _, second_calls, _ = step(schedule)
    out = {
        "raised": None,
        "checked": checker.checked,
        "error": checker.last_error,
        "spread": checker.last_replica_spread,
        "plan": checker.last_plan,
        "rng_same": torch.equal(plain_rng, checked_rng),
        "calls": (plain_calls, checked_calls, second_calls),
        # The step record (metrics) is the normal run's, not the re-run's.
        "loss_same": plain_loss == checked_loss,
    }
    if peaks:
        grads = sum(p.main_grad.numel() * 4 for c in chunks for p in c.parameters())
        (plain_peak, _), (checked_peak, held) = peak_bytes[1:3]
        out["peaks"] = (plain_peak, checked_peak, max(held), grads)
    if plain is not None:
        out["grads_same"] = all(torch.equal(plain[k], checked[k]) for k in plain)
        out["second_same"] = all(torch.equal(plain[k], second[k]) for k in plain)
    return out


class _Marked:
    """A step whose every run is a ``record_function`` range named ``MARK``."""

    def __init__(self, step):
        self.inner = step

    def __call__(self, **call):
        with torch.profiler.record_function(MARK):
            return self.inner(**call)

    @property
    def last_step(self):
        return self.inner.last_step

    @last_step.setter
    def last_step(self, record):
        self.inner.last_step = record


def _assert_passed(results: list[dict], plan_kind: str) -> None:
    for rank, res in enumerate(results):
        assert res["raised"] is None, f"rank {rank}: {res['raised']}"
        assert res["error"] <= 1e-5, res
        assert res["spread"] <= 1e-12, res  # DP replicas hold the same reduced gradient
        assert res["plan"][0] == plan_kind
        assert res["rng_same"], "the check changed the RNG stream"
        assert res["loss_same"], "step_metrics after the check differ from a plain step's"
        plain, checked, second = res["calls"]
        assert checked > plain and second == plain, res["calls"]  # later steps pass through
    assert results[0]["grads_same"], "training did not continue from the normal run's gradient"
    assert results[0]["second_same"]


ROPE = {"position_embedding_type": "rope"}
MOE = {"num_experts": 4, "moe_aux_loss_coeff": 0.0}
PASSING = [
    # id, layout, world, micro-batches, options, expected plan
    ("dp2-m2", Layout(), 2, 2, {}, "split"),
    ("dp2-m2-sum", Layout(), 2, 2, {"reduction": "sum"}, "split"),
    ("pp2-m4", Layout(pp=2), 2, 4, {}, "split"),
    # Three rows per micro-batch under PP: rows dealt to other micro-batches of that size.
    ("pp2-m8-shuffle", Layout(pp=2), 2, 8, {"reduction": "sequence_mean"}, "shuffle"),
    # Group ids (one per row) are cut and dealt with their rows; the group count goes along.
    ("dp2-m2-group", Layout(), 2, 2, {"reduction": "group_mean"}, "split"),
    ("pp2-m8-shuffle-group", Layout(pp=2), 2, 8, {"reduction": "group_mean"}, "shuffle"),
    # One row per micro-batch: two runs over halves of the loss tokens, no micro-batch grown.
    ("dp2-m12-halves", Layout(), 2, 12, {}, "halves"),
    ("dp2-m12-halves-per-token", Layout(), 2, 12, {"per_token": True}, "halves"),
    ("dp2-m12-halves-moe", Layout(), 2, 12, MOE, "halves"),
    ("pp2-m24-halves-seq", Layout(pp=2), 2, 24, {"reduction": "sequence_mean"}, "halves"),
    ("dp2-m12-halves-group", Layout(), 2, 12, {"reduction": "group_mean"}, "halves"),
    ("dp2-m12-halves-dropout", Layout(), 2, 12, {"hidden_dropout": 0.1}, "halves"),
    # Packed (THD) micro-batches: one row each, so halves of their loss tokens.
    ("dp2-m2-packed", Layout(), 2, 2, {"packed": True}, "halves"),
    ("dp2-m2-packed-seq", Layout(), 2, 2, {"packed": True, "reduction": "sequence_mean"}, "halves"),
    ("pp2-m4-packed-per-token", Layout(pp=2), 2, 4, {"packed": True, "per_token": True}, "halves"),
    ("pp2-vpp2-m4", Layout(pp=2, vpp=2), 2, 4, {}, "split"),
    # Interleaved at micro-batch 1: the halves' window is the schedule's group (2).
    ("pp2-vpp2-m24-halves", Layout(pp=2, vpp=2), 2, 24, {}, "halves"),
    ("dp2-m2-distopt", Layout(), 2, 2, {"use_distributed_optimizer": True}, "split"),
    ("dp2-m2-dropout", Layout(), 2, 2, {"hidden_dropout": 0.1, "attention_dropout": 0.1}, "split"),
    ("dp2-m2-per-token", Layout(), 2, 2, {"per_token": True}, "split"),
    ("tp2-m3", Layout(tp=2), 2, 3, {}, "split"),
    # MTP losses are normalized like the main loss, so a re-split leaves them unchanged too.
    ("pp2-m4-mtp2", Layout(pp=2), 2, 4, {"mtp_num_layers": 2, **ROPE}, "split"),
    # The first stage broadcasts fixed-shape batches over TP: only a shape-keeping re-split.
    ("tp2-pp2-m4-broadcast", Layout(tp=2, pp=2), 4, 4, {"broadcast": True}, "shuffle"),
]


@pytest.mark.oracle
@pytest.mark.parametrize(
    "name, layout, world, m, options, plan", PASSING, ids=[row[0] for row in PASSING]
)
def test_self_check_passes_for_the_plugin(dist_pool, name, layout, world, m, options, plan):
    results = dist_pool.run(_check_on_rank, world, layout, m, **options)
    _assert_passed(results, plan)


FAILING = [
    ("dp2-m2-double", Layout(), 2, 2, {"loss": "double"}),
    ("dp2-m2-per-token-double", Layout(), 2, 2, {"loss": "double", "per_token": True}),
    ("dp2-m2-mask-mean", Layout(), 2, 2, {"loss": "mask_mean"}),
    ("pp2-m4-double", Layout(pp=2), 2, 4, {"loss": "double"}),
    # Micro-batch size 1 (halves of the loss tokens), dense and MoE, and packed micro-batches.
    ("dp2-m12-mask-mean", Layout(), 2, 12, {"loss": "mask_mean"}),
    ("dp2-m12-double", Layout(), 2, 12, {"loss": "double"}),
    ("dp2-m12-moe-mask-mean", Layout(), 2, 12, {"loss": "mask_mean", **MOE}),
    ("dp2-m12-per-token-double", Layout(), 2, 12, {"loss": "double", "per_token": True}),
    ("dp2-m2-packed-mask-mean", Layout(), 2, 2, {"loss": "mask_mean", "packed": True}),
    ("pp2-m24-mask-mean", Layout(pp=2), 2, 24, {"loss": "mask_mean"}),
    # The plugin's weights, then divided by the raw mask count or the number of sequences.
    ("dp2-m12-per-token-raw-count", Layout(), 2, 12, {"loss": "raw_count", "per_token": True}),
    ("pp2-m24-raw-count", Layout(pp=2), 2, 24, {"loss": "raw_count"}),
    ("pp2-m4-packed-per-sequence", Layout(pp=2), 2, 4, {"loss": "per_sequence", "packed": True}),
    ("pp2-vpp2-m24-raw-count", Layout(pp=2, vpp=2), 2, 24, {"loss": "raw_count"}),
    (
        "tp2-pp2-m4-broadcast-double",
        Layout(tp=2, pp=2),
        4,
        4,
        {"loss": "double", "broadcast": True},
    ),
]


@pytest.mark.oracle
@pytest.mark.parametrize("name, layout, world, m, options", FAILING, ids=[r[0] for r in FAILING])
def test_self_check_catches_split_dependent_losses(dist_pool, name, layout, world, m, options):
    results = dist_pool.run(_check_on_rank, world, layout, m, **options)
    for rank, res in enumerate(results):
        assert res["raised"] is not None, f"rank {rank} did not raise: {res}"
        assert "double scaling" in res["raised"] and "re-running the first step" in res["raised"]
        assert res["error"] > 1e-3
    assert len({res["error"] for res in results}) == 1  # one verdict: the same number everywhere


def _wrong_losses_on_rank(cases: list[tuple]) -> dict[str, str]:
    """Each case (name, micro-batches, options) on this rank's layout under the default
    first-step check: ``stopped`` (the check's error) or ``passed``."""
    out = {}
    for name, m, options in cases:
        res = _check_on_rank(Layout(), m, self_check=None, **options)
        raised = res["raised"]
        stopped = raised is not None and "double scaling" in raised
        out[name] = "passed" if raised is None else "stopped" if stopped else raised
    return out


def wrong_loss_cases(world: int, moe: bool) -> dict[str, tuple]:
    """Every loss of the test against every split a user ships, on ``world`` DP ranks: 24
    sequences in micro-batches of 1 and 2 rows, and packed 3 to a micro-batch; the verdict the
    check must reach (``passed`` only where the loss is the weighted sum, or one divided by
    the 1 row of its micro-batch)."""
    model = MOE if moe else {}
    splits = {"mbs1": (24 // world, {}), "mbs2": (12 // world, {}),
              "packed": (8 // world, {"packed": True})}  # fmt: skip
    cases = {}
    for loss in ("plugin", "sequence_statistic", "mask_mean", "double", *WRONG):
        for split, (m, options) in splits.items():
            right = loss in ("plugin", "sequence_statistic") or (
                loss == "per_sequence" and split == "mbs1"
            )
            cases[f"{loss}-{split}"] = (m, {"loss": loss, **options, **model}, right)
    return cases


@pytest.mark.oracle
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("world", [1, 2], ids=["1-rank", "dp2"])
def test_the_default_check_stops_every_wrong_loss_at_any_micro_batch_size(dist_pool, world, moe):
    """Issue-level promise: at micro-batch 1 and 2, packed or not, on one rank and DP2, dense
    and MoE, the default check stops every loss that does not return the weighted sum (a mean
    that ignores the weights; the weighted sum divided by its own weighted or raw token count,
    or by its number of sequences; scaled by its share of loss tokens) and passes the plugin's
    and a right one that takes a statistic over each sequence's mask (no false alarm)."""
    cases = wrong_loss_cases(world, moe)
    results = dist_pool.run(
        _wrong_losses_on_rank, world, [(n, m, o) for n, (m, o, _) in cases.items()]
    )
    want = {name: "passed" if right else "stopped" for name, (_, _, right) in cases.items()}
    for rank, got in enumerate(results):
        print(f"world {world}, {'moe' if moe else 'dense'}, rank {rank}: {got}")
        wrong = {name: (got[name], want[name]) for name in want if got[name] != want[name]}
        assert not wrong, f"rank {rank}: (got, want): {wrong}"


REDUCED_WRONGLY = [
    ("dp2-m2-no-reduce", Layout(), 2, {"finalize": "no-reduce"}),
    ("dp2-m2-rank-factor", Layout(), 2, {"finalize": "rank-factor"}),
    ("tp2-dp2-m2-rank-factor", Layout(tp=2), 4, {"finalize": "rank-factor"}),
]


@pytest.mark.oracle
@pytest.mark.parametrize(
    "name, layout, world, options", REDUCED_WRONGLY, ids=[r[0] for r in REDUCED_WRONGLY]
)
def test_self_check_catches_gradients_that_differ_across_dp_ranks(
    dist_pool, name, layout, world, options
):
    """The structural guard sees DDP and a finalize_model_grads_func and lets these run; the
    self-check compares the gradient across data-parallel ranks and refuses on every rank."""
    results = dist_pool.run(_check_on_rank, world, layout, 2, **options)
    for rank, res in enumerate(results):
        assert res["raised"] is not None, f"rank {rank} did not raise: {res}"
        assert "differs across the 2 data x context-parallel ranks" in res["raised"], res
        assert "finalize_model_grads_func = finalize_model_grads" in res["raised"]
        assert res["spread"] > 1e-2, res
    assert len({res["spread"] for res in results}) == 1  # one verdict everywhere


@pytest.mark.oracle
def test_default_check_stops_a_loss_that_returns_a_mean_on_dp2(dist_pool):
    """A plugin mode without any self-check setting: a loss function returning a per-micro-batch
    mean is stopped at the first step on every rank, with one line naming the fix."""
    results = dist_pool.run(_check_on_rank, 2, Layout(), 2, loss="mask_mean", self_check=None)
    for rank, res in enumerate(results):
        assert res["raised"] is not None, f"rank {rank} did not raise: {res}"
        assert "\n" not in res["raised"], "one line"
        assert "return (sum(weights * loss), num_tokens, report)" in res["raised"]
        assert "megatron_lossfix.weighted_loss" in res["raised"]
    assert len({res["raised"] for res in results}) == 1  # one verdict everywhere


@pytest.mark.oracle
def test_opting_out_skips_the_first_step_check(dist_pool):
    """``self_check=False``: the same mean-returning loss trains on unchecked (the user's
    choice), and the step runs once: no re-run."""
    results = dist_pool.run(_check_on_rank, 2, Layout(), 2, loss="mask_mean", self_check=False)
    for rank, res in enumerate(results):
        assert res["raised"] is None and not res["checked"], f"rank {rank}: {res}"
        plain, checked, second = res["calls"]
        assert plain == checked == second, res["calls"]
    assert results[0]["grads_same"]  # exactly a plain step's gradient


@pytest.mark.oracle
def test_the_check_holds_no_copy_of_the_gradient(dist_pool):
    """On DP2, what the check holds when each of its runs starts (its reading, re-split and
    normal runs) is under a quarter of the gradients' bytes, and the checked first step's tensor
    peak exceeds a plain step's by less than that: no copy of the gradient is kept."""
    results = dist_pool.run(_check_on_rank, 2, Layout(), 2, peaks=True, hidden=64)
    _assert_passed(results, "split")
    for rank, res in enumerate(results):
        plain, checked, held, grads = res["peaks"]
        assert held < 0.25 * grads, f"rank {rank}: {held=} {grads=}"
        assert checked - plain < 0.25 * grads, f"rank {rank}: {plain=} {checked=} {grads=}"


def _held_gradients_on_rank() -> dict:
    """The check asked for on a step whose gradient buffer is not zero when it starts (a loop
    that accumulates over schedule calls): what it warned, and how often the step read data."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit.oracle import OracleCase, make_global_batch, microbatch_plan
    from megatron_lossfix.audit.oracle_case import id_ranges
    from megatron_lossfix.audit.tiny_gpt import build_tiny_gpt, init_layout

    init_layout(Layout())
    chunks, config = build_tiny_gpt(Layout(), seq_len=16)
    case, rank = OracleCase(), ps.get_data_parallel_rank()
    sizes = microbatch_plan(case, ps.get_data_parallel_world_size(), 2)[rank]
    batch = make_global_batch(case, config.vocab_size)
    local = {k: v[rank * sum(sizes) : (rank + 1) * sum(sizes)] for k, v in batch.items()}
    parts = {k: torch.split(v, sizes) for k, v in local.items()}
    mbs = [{k: parts[k][i] for k in local} | id_ranges(case) for i in range(2)]
    chunks[0].zero_grad_buffer()
    for param in chunks[0].parameters():
        param.main_grad.fill_(1.0)
    counter = [0, 0]
    schedule = LossFixSchedule(LossFixConfig(reduction="token_mean", self_check=True))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        schedule(
            forward_step_func=partial(_forward_step, "plugin", counter, None),
            data_iterator=iter(mbs),
            model=chunks[0],
            num_microbatches=2,
            seq_length=16,
            micro_batch_size=sizes[0],
            forward_only=False,
        )
    return {
        "warnings": [str(w.message) for w in seen if "self-check" in str(w.message)],
        "calls": counter[0],
        "error": schedule.self_check.last_error,
    }


@pytest.mark.oracle
def test_gradients_held_before_the_step_are_not_checked(dist_pool):
    """The check's runs start from zero: a step that starts with gradients in the buffer is
    run once for training, as it is, on every rank (the check reads its data ahead, without
    a forward-only pass: 2 calls of forward_step), and the asked-for check says why it was
    skipped."""
    for rank, res in enumerate(dist_pool.run(_held_gradients_on_rank, 2)):
        assert res["calls"] == 2 and res["error"] is None, f"rank {rank}: {res}"
        assert any("not zero before the step" in w for w in res["warnings"]), res


@pytest.mark.oracle
def test_micro_batch_one_is_checked_without_growing_a_micro_batch(dist_pool):
    """Micro-batches of one row: the check runs halves of the loss tokens in micro-batches of
    the step's own size, so the checked step's tensor peak stays within 5% of a plain step's
    (merging pairs, as before, doubled the activations)."""
    results = dist_pool.run(_check_on_rank, 2, Layout(), 12, peaks=True, hidden=64, seq=256)
    _assert_passed(results, "halves")
    for rank, res in enumerate(results):
        plain, checked, held, grads = res["peaks"]
        print(f"rank {rank}: {plain=} {checked=} {held=} {grads=}")
        assert checked <= 1.05 * plain, f"rank {rank}: {plain=} {checked=}"


def _world_size() -> int:
    return torch.distributed.get_world_size()


@pytest.mark.oracle
def test_a_model_error_on_one_rank_ends_every_rank():
    """forward_step raises on rank 1 only, in the check's re-split run (halves at micro-batch
    size 1, then split rows): rank 1 ends with one line naming the step's own micro-batch, and
    rank 0, left waiting in a collective, ends with the same line within the collective's
    timeout (20 s here), not with its own collective's error."""
    import time

    from megatron_lossfix.audit.pool import DistPool

    with DistPool(2, timeout_s=20) as pool:
        assert pool.run(_world_size, 2) == [2, 2]  # started: time the runs only
        for m, n, microbatch in [(12, 4, 3), (2, 3, 1)]:
            start = time.monotonic()
            results = pool.run(_check_on_rank, 2, Layout(), m, fail_at=(1, n))
            assert time.monotonic() - start < 20 + 25, "rank 0 did not end within the timeout"
            want = f"forward_step raised RuntimeError: the model failed on forward step {n} on "
            want += f"rank 1 reading micro-batch {microbatch} of the first step"
            for rank, res in enumerate(results):
                assert res["raised"] is not None and want in res["raised"], f"rank {rank}: {res}"
                assert "\n" not in res["raised"]
            assert results[0]["raised"].startswith(results[1]["raised"])  # the same line


def _bridge_loop_on_rank(loss: str, reduction: str) -> dict:
    """Bridge's loop on DP2 without Bridge: ``BridgeLossFix`` around Megatron's schedule, its
    default first-step check, packed micro-batches in Bridge's layout (``cu_seqlens`` ``[1, n]``
    with a negative sentinel) and a loss function taking ``lossfix=`` as Bridge's does;
    ``loss``: ``plugin`` (the plugin's weights) or ``mask_mean`` (a mean over the raw mask)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lossfix.audit.oracle import OracleCase, make_global_batch, microbatch_plan
    from megatron_lossfix.audit.tiny_gpt import build_tiny_gpt, init_layout
    from megatron_lossfix.integrations.bridge.adapter import BridgeLossFix

    init_layout(Layout())
    chunks, config = build_tiny_gpt(Layout(), seq_len=16, no_attention=True)
    case, rank = OracleCase(), ps.get_data_parallel_rank()
    sizes = microbatch_plan(case, ps.get_data_parallel_world_size(), 2)[rank]
    batch = make_global_batch(case, config.vocab_size)
    local = {k: v[rank * sum(sizes) : (rank + 1) * sum(sizes)] for k, v in batch.items()}
    parts = {k: torch.split(v, sizes) for k, v in local.items()}
    mbs = []
    for i, n in enumerate(sizes):
        mb = {k: parts[k][i].reshape(1, -1) for k in ("tokens", "labels", "loss_mask")}
        mb["position_ids"] = parts["position_ids"][i].reshape(1, -1)
        cu = torch.arange(0, 16 * n + 1, 16, dtype=torch.int32)
        mb["cu_seqlens"] = torch.cat([cu, torch.tensor([-1], dtype=torch.int32)])[None]
        mbs.append(mb)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])

        def loss_func(output_tensor, lossfix=None):
            if loss == "mask_mean" or lossfix is None:
                mask = mb["loss_mask"].float()
                return (output_tensor * mask).sum() / mask.sum().clamp(min=1), {}
            return lossfix(output_tensor)

        return output, loss_func

    schedule = BridgeLossFix(LossFixConfig(reduction=reduction), get_forward_backward_func())
    chunks[0].zero_grad_buffer()
    try:
        schedule(forward_step_func=forward_step, data_iterator=iter(mbs), model=chunks,
                 num_microbatches=2, seq_length=16 * sizes[0], micro_batch_size=1,
                 forward_only=False)  # fmt: skip
    except SelfCheckError as exc:
        return {"raised": str(exc), "plan": schedule.self_check.last_plan}
    check = schedule.self_check
    return {"raised": None, "plan": check.last_plan, "error": check.last_error}


@pytest.mark.oracle
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_bridge_loop_checks_packed_micro_batches_by_default(dist_pool, reduction):
    """Bridge's loop checks its first step by default, packed micro-batches included: the
    plugin's loss passes, a mean over the raw mask is stopped on every rank with one line."""
    for rank, res in enumerate(dist_pool.run(_bridge_loop_on_rank, 2, "plugin", reduction)):
        assert res["raised"] is None and res["plan"][0] == "halves", f"rank {rank}: {res}"
        assert res["error"] <= 1e-5, res
    results = dist_pool.run(_bridge_loop_on_rank, 2, "mask_mean", reduction)
    for rank, res in enumerate(results):
        assert res["raised"] is not None and "\n" not in res["raised"], f"rank {rank}: {res}"
        assert (
            "as two runs over halves of the loss tokens of 1 micro-batch of its 2"
            in (res["raised"])
        )
    assert len({res["raised"] for res in results}) == 1


@pytest.mark.unit
def test_the_sketch_block_is_chosen_by_device_and_leaves_the_sketch_as_it_is():
    """Small blocks on a CPU, large ones (1-8 Mi elements) on an accelerator, where each block
    costs a few kernel launches; the random matrices are drawn row by row, so the sketch is the
    same whatever the block (up to fp64 rounding), and a block that is not whole rows is
    refused."""
    from megatron_lossfix.runtime.process_groups import ModelParallelGroups
    from megatron_lossfix.step.selfcheck.gradient_sketch import (
        BLOCK,
        DEVICE_BLOCK,
        WIDTH,
        block_elements,
        sketch_gradients,
    )

    assert block_elements("cpu") == BLOCK == 65_536
    assert block_elements("cuda") == block_elements(torch.device("cuda", 1)) == DEVICE_BLOCK
    assert 2**20 <= DEVICE_BLOCK <= 8 * 2**20 and DEVICE_BLOCK % WIDTH == 0
    gen = torch.Generator().manual_seed(3)
    params = []
    for shape in [(700, 300), (5,), (70_001,), (2, 256)]:
        param = torch.nn.Parameter(torch.zeros(shape))
        param.grad = torch.randn(shape, generator=gen)
        params.append(param)
    shards = ModelParallelGroups(tp=None, mp=None, expert_mp=None)
    sketches = [sketch_gradients(params, shards, block) for block in (WIDTH, BLOCK, 2**20)]
    for other in sketches[1:]:
        torch.testing.assert_close(other.projections, sketches[0].projections, rtol=1e-12, atol=0)
        torch.testing.assert_close(other.sums, sketches[0].sums, rtol=1e-12, atol=1e-12)
    assert sketches[0].projections.abs().sum() > 0
    with pytest.raises(ValueError, match="multiple of 256"):
        sketch_gradients(params, shards, 1000)


@pytest.mark.oracle
def test_a_step_the_halves_cannot_check_says_what_the_check_did(dist_pool):
    """MTP layers add gradient terms outside the loss, which halves of the loss tokens would
    count twice: at micro-batch size 1 the default check compares the replicas only (one line
    on rank 0), the asked-for one refuses on every rank in one line; never a bigger peak."""
    mtp = {"mtp_num_layers": 1, **ROPE}
    for rank, res in enumerate(dist_pool.run(_check_on_rank, 2, Layout(), 12, self_check=None,
                                             **mtp)):  # fmt: skip
        assert res["raised"] is None and res["checked"], f"rank {rank}: {res}"
        assert res["plan"] is None and res["error"] is None and res["spread"] <= 1e-12, res
    with pytest.raises(ValueError, match=r"self-check: no rank can move a row .* multi-token"):
        dist_pool.run(_check_on_rank, 2, Layout(), 12, **mtp)


@pytest.mark.unit
@pytest.mark.parametrize("stack", ["slime", "areal"])
def test_an_adapter_that_writes_the_loss_says_once_that_the_check_stays_out(
    stack, monkeypatch, capsys
):
    """slime's and AReaL's adapters write the loss themselves: their default configuration
    leaves the first-step check out and says so once per process, in one line (design §9);
    their switch turns it on, silently. Neither stack need be installed for their configs."""
    from megatron_lossfix.integrations.areal import adapter as areal
    from megatron_lossfix.integrations.slime import adapter as slime
    from megatron_lossfix.step.selfcheck import check

    module = {"slime": slime, "areal": areal}[stack]
    args = argparse.Namespace(calculate_per_token_loss=True)

    def config() -> LossFixConfig:
        return slime.lossfix_config_for(args) if stack == "slime" else areal.lossfix_config()

    monkeypatch.setattr(check, "_LEFT_OUT", set())
    monkeypatch.delenv(module.SELF_CHECK_ENV, raising=False)
    assert config().self_check is False and config().self_check is False
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("megatron_lossfix self-check: not run in "), lines
    assert f"{module.SELF_CHECK_ENV}=1 runs it" in lines[0], lines
    monkeypatch.setattr(check, "_LEFT_OUT", set())
    monkeypatch.setenv(module.SELF_CHECK_ENV, "1")
    assert config().self_check is True
    assert capsys.readouterr().out == ""
