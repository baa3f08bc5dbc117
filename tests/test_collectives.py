"""Collectives of one training step: ``off`` adds none; a plugin mode adds two small all-reduces
over DP x CP on the loss stage (``group_mean`` three) and, with pipeline parallelism, two over
the pipeline group.

Inside the pool's worker ranks every ``torch.distributed`` collective and point-to-point entry
point (and the aliases Megatron binds at import, e.g. ``dist_all_gather_func``) is wrapped by a
counter keyed by the op and the global ranks of its group (``"all_reduce@0,1"``). One training
step -- Megatron's schedule with DDP and ``finalize_model_grads``, then ``optimizer.step()``:
``megatron_lossfix.audit.training.train_step``, the examples' step -- is counted for stock Megatron
(its own ``get_forward_backward_func()`` with the stock loss ``(sum(m*l), m.sum(), report)``)
and for every mode through ``LossFixSchedule``.
``schedule.step_metrics()`` is not part of the step and is not counted.

Expected: ``off`` makes exactly stock Megatron's calls, no more (it is stock, passed through).
Every plugin mode adds, on the loss (last pipeline) stage of a data-parallel run, one all-reduce
over the DP x CP group before the step: the token counts and the step's cross-rank checks (same
reduction everywhere, nothing refused) in one vector; ``group_mean`` one more, after the
verdict, of the per-group token counts (a vector of the step's group count). With pipeline
parallelism every stage adds one more small all-reduce, over the pipeline group, that hands the
verdict to the stages that hold no loss (so that a refusal on the loss stage stops them too
instead of leaving them in Megatron's point-to-point). After the step the same two (DP x CP on
the loss stage, the pipeline group with PP) carry the verdict on errors met inside Megatron's
schedule (a loss function that raised): one small vector each. DP=1 without pipelining adds
nothing. And the counts do not depend on the data: a step where a DP rank holds no loss token at
all does exactly the same collectives.

Masks decided in the loss (``mask_in_loss``, docs/design.md §10) add nothing on the default
path: the kept counts ride in the agreement after the schedule. With context parallelism the
kept tokens of each sequence are summed over the CP group: once per micro-batch for the modes
whose weights need them in the loss (``sequence_mean``, ``token_mean_legacy``), once per step
otherwise. The counting pass adds one more agreement (DP x CP on the loss stage, the pipeline
group with PP), a CP sum of the kept counts with CP, and what Megatron's forward-only schedule
communicates (the forward's tensor-parallel all-reduces, the pipeline's activations).

Host syncs (the calls of ``helpers.host_syncs.HOST_SYNCS``: reads of a value, copies to the
host, tensors built from host data, results sized by the values) are counted the same way:
inside Megatron's schedule (the micro-batch loop) the plugin adds none; per step it reads each
agreement once.

``step_metrics()`` after a step: one collective over DP x CP (an all-reduce; an all-gather where
the reports hold maxima or minima, which it carries with the sums) and one host read, whatever
the number of micro-batches and report entries.
"""

from __future__ import annotations

import collections
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pytest
import torch
from helpers.host_syncs import HostSyncs

from megatron_lossfix import REDUCTIONS
from megatron_lossfix.audit.oracle import OracleCase, make_global_batch
from megatron_lossfix.audit.oracle_case import microbatch_ids
from megatron_lossfix.audit.tiny_gpt import Layout

pytestmark = pytest.mark.oracle

MODES = (*REDUCTIONS, "off")
#: Masks decided in the loss: the mode's config fields (``loss`` keeps a filter's tokens).
KEPT_VARIANTS = {
    "token_mean+kept": {"reduction": "token_mean", "mask_in_loss": True},
    "sequence_mean+kept": {"reduction": "sequence_mean", "mask_in_loss": True},
    "token_mean+kept+counting": {
        "reduction": "token_mean",
        "mask_in_loss": True,
        "counting_pass": True,
    },
}
CASE = OracleCase(global_batch_size=8, seq_length=16)
NUM_MICROBATCHES = 2

# Every entry point of torch.distributed that communicates. Nested calls (all_gather_object ->
# all_gather, batch_isend_irecv -> isend) are counted once, at the outermost call.
_OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)

Counts = dict[str, int]
"""``"op@ranks" -> calls``, ``ranks`` the group's global ranks, e.g. ``"all_reduce@0,1"``."""


def _group_key(op: str, fn: Callable, args: tuple, kwargs: dict) -> str:
    import torch.distributed as dist

    if op == "batch_isend_irecv":
        ops = args[0] if args else kwargs["p2p_op_list"]
        group = ops[0].group if ops else None
    else:
        try:
            group = inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get("group")
        except TypeError:
            group = kwargs.get("group")
    if group is None:
        group = dist.group.WORLD
    # Global ranks, not just the size: a DP and a PP group of the same size must not mix.
    return ",".join(map(str, dist.get_process_group_ranks(group)))


@contextmanager
def count_collectives() -> Iterator[collections.Counter]:
    """Count every collective call of this process, by ``"op@ranks"``, while active.

    Replaces the functions wherever torch.distributed and Megatron modules hold them (module
    attributes), since Megatron binds some at import (``dist_all_gather_func = ...``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    originals = {op: getattr(distributed_c10d, op) for op in _OPS if hasattr(distributed_c10d, op)}
    by_id = {id(fn): op for op, fn in originals.items()}
    counts: collections.Counter = collections.Counter()
    depth = [0]

    def wrap(op: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[f"{op}@{_group_key(op, fn, args, kwargs)}"] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        counted.__name__ = fn.__name__
        return counted

    wrappers = {op: wrap(op, fn) for op, fn in originals.items()}
    patched = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("torch.distributed", "megatron")):
            continue
        if name.startswith("torch.distributed") and module not in (dist, distributed_c10d):
            # Other torch.distributed submodules (FSDP, rpc, ...) are not on a Megatron step's
            # path; their aliases are left alone. torch.distributed.nn (autograd collectives)
            # calls through `dist.`, already patched, but may hold aliases too.
            if not name.startswith("torch.distributed.nn"):
                continue
        for attr, value in list(vars(module).items()):
            op = by_id.get(id(value))
            if op is not None and value is originals[op]:
                patched.append((module, attr, value))
                setattr(module, attr, wrappers[op])
    try:
        yield counts
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


@contextmanager
def count_host_syncs() -> Iterator[collections.Counter]:
    """Count, while active, the calls that make the host wait for the device (the tests' one
    probe, ``helpers.host_syncs``), split into ``"loop"`` (while ``schedule_running`` is set:
    Megatron's schedule, the micro-batch loop) and ``"step"`` (the rest)."""
    with HostSyncs(lambda: "loop" if _SCHEDULE_RUNNING[0] else "step") as syncs:
        yield syncs.counts


_SCHEDULE_RUNNING = [False]


def _marking(schedule: Callable) -> Callable:
    """Megatron's schedule, marking the time it runs for :func:`count_host_syncs`."""

    def run(**kwargs: Any) -> Any:
        _SCHEDULE_RUNNING[0] = True
        try:
            return schedule(**kwargs)
        finally:
            _SCHEDULE_RUNNING[0] = False

    return run


def _stock_forward_step(data_iterator: Any, model: Any) -> tuple:
    """Megatron-LM's loss function: ``(sum(m*l), m.sum(), report)``."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"]

    def loss_func(per_token: torch.Tensor) -> tuple:
        loss = (per_token.float() * mask).sum()
        num_tokens = mask.sum().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}

    return output, loss_func


def _microbatches(batch: dict, dp_rank: int, per_rank: int) -> list[dict]:
    """DP rank ``dp_rank``'s contiguous slice, cut into NUM_MICROBATCHES contiguous pieces."""
    size = per_rank // NUM_MICROBATCHES
    start = dp_rank * per_rank
    return [
        {key: t[start + k * size : start + (k + 1) * size] for key, t in batch.items()}
        | microbatch_ids(CASE, size)
        for k in range(NUM_MICROBATCHES)
    ]


def _plugin_forward_step(data_iterator: Any, model: Any) -> tuple:
    from megatron.core import parallel_state as ps

    from megatron_lossfix import slice_batch_for_cp
    from megatron_lossfix.runtime.losses import weighted_loss

    batch = slice_batch_for_cp(next(data_iterator), ps.get_context_parallel_group())
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    # A filter decided in the loss: tokens whose cross entropy is below 5.6 are kept.
    keep = lambda per_token: per_token < 5.6  # noqa: E731
    weights = batch.get("loss_weights", batch.get("loss_mask"))
    return output, partial(weighted_loss, weights, keep=keep)


def _rank_setup(layout: Layout, per_token: bool, empty_last_dp_rank: bool) -> tuple:
    """This rank's model chunks, Adam optimizer and micro-batches for the counted steps."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_lossfix.audit.tiny_gpt import (
        build_tiny_gpt,
        init_layout,
        set_deterministic_params,
    )

    layout = init_layout(layout)
    model = {"no_attention": True} if layout.cp > 1 else {}  # CP on CPU (docs/design.md §7)
    chunks, config = build_tiny_gpt(
        layout, seq_len=CASE.seq_length, calculate_per_token_loss=per_token, **model
    )
    set_deterministic_params(chunks, CASE.seed)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, weight_decay=0.0), chunks
    )
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = make_global_batch(CASE, config.vocab_size)
    mbs = _microbatches(batch, dp_rank, CASE.global_batch_size // dp)
    if empty_last_dp_rank and dp_rank == dp - 1:
        mbs = [{**mb, "loss_mask": torch.zeros_like(mb["loss_mask"])} for mb in mbs]
    return chunks, optimizer, mbs


def _step_counts(
    layout: Layout, per_token: bool, variants: tuple[str, ...], empty_last_dp_rank: bool
) -> dict[str, Any]:
    """Pool worker: count one training step per variant (``stock`` or a mode) on this rank.

    ``empty_last_dp_rank``: the last DP rank's loss masks are all zero (no loss token on that
    rank; with DP=1 the whole mini-batch is empty)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lossfix.audit.training import train_step
    from megatron_lossfix.runtime.config import LossFixConfig
    from megatron_lossfix.step.schedule import LossFixSchedule

    chunks, optimizer, mbs = _rank_setup(layout, per_token, empty_last_dp_rank)
    micro_batch_size = mbs[0]["tokens"].shape[0]

    def step(variant: str) -> None:
        schedule = _marking(get_forward_backward_func())
        if variant == "stock":
            func, forward_step = schedule, _stock_forward_step
        else:
            fields = KEPT_VARIANTS.get(variant, {"reduction": variant})
            norm = 16.0 if fields["reduction"] == "seq_mean_token_sum_norm" else None
            # The step's own collectives, not the first step's check.
            config = LossFixConfig(**fields, norm_constant=norm, self_check=False)
            func = LossFixSchedule(config, schedule)
            forward_step = _plugin_forward_step
        train_step(
            func,
            forward_step,
            chunks,
            mbs,
            optimizer,
            seq_length=CASE.seq_length,
            micro_batch_size=micro_batch_size,
        )

    def forward_only() -> None:  # what the counting pass runs, stock
        get_forward_backward_func()(
            forward_step_func=_stock_forward_step,
            data_iterator=iter(mbs),
            model=chunks[0],
            num_microbatches=len(mbs),
            seq_length=CASE.seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )

    # One uncounted step first: anything lazily set up on a first step is not the plugin's.
    step("stock")
    # The first deferred scale of a wrapper also checks, once, that the scale changed the
    # gradient (one small all-reduce per group; tests/test_wrappers.py counts on it): warm it up
    # too, so that the counts below are every step's.
    for variant in ("token_mean+kept", "sequence_mean+kept"):
        if variant in variants:
            step(variant)
    counts, syncs = {}, {}
    for variant in variants:
        with count_collectives() as counter, count_host_syncs() as synced:
            step(variant)
        counts[variant], syncs[variant] = dict(counter), dict(synced)
    with count_collectives() as counter, torch.no_grad():
        forward_only()
    counts["stock-forward-only"] = dict(counter)

    def ranks(group: Any) -> str:
        return ",".join(map(str, dist.get_process_group_ranks(group)))

    return {
        "counts": counts,
        "syncs": syncs,
        "dp_cp_ranks": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "cp_ranks": ranks(ps.get_context_parallel_group()),
        "pp_ranks": ranks(ps.get_pipeline_model_parallel_group()),
        "loss_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
    }


def _extra(plugin: Counts, stock: Counts) -> Counts:
    """Calls the plugin step made beyond stock's (negative: fewer)."""
    keys = set(plugin) | set(stock)
    diff = {k: plugin.get(k, 0) - stock.get(k, 0) for k in keys}
    return {k: v for k, v in sorted(diff.items()) if v}


def _expected_extra(mode: str, info: dict[str, Any]) -> Counts:
    """``off``: nothing. A plugin mode: two all-reduces over DP x CP on loss-stage ranks of a
    data-parallel run (counts and checks before the step, the loss stage's verdict after it),
    and ``group_mean`` a third, the per-group token counts; two over the pipeline group on
    every rank with PP. Masks decided in the loss: see the module docstring."""
    if mode == "off":
        return {}
    agreements = 3 if mode.endswith("+counting") else 2
    extra: collections.Counter = collections.Counter()
    cp = "," in info["cp_ranks"]
    if info["loss_stage"] and ("," in info["dp_cp_ranks"]):
        extra[f"all_reduce@{info['dp_cp_ranks']}"] = agreements + (mode == "group_mean")
    if "," in info["pp_ranks"]:
        extra[f"all_reduce@{info['pp_ranks']}"] = agreements
    if mode in KEPT_VARIANTS and cp and info["loss_stage"]:
        per_microbatch = KEPT_VARIANTS[mode]["reduction"] in ("sequence_mean", "token_mean_legacy")
        extra[f"all_reduce@{info['cp_ranks']}"] = NUM_MICROBATCHES if per_microbatch else 1
    if mode.endswith("+counting"):  # and a forward pass: its TP and pipeline traffic
        extra.update(info["counts"]["stock-forward-only"])
    return dict(extra)


def _expected_syncs(mode: str, info: dict[str, Any]) -> int:
    """Host reads per step outside Megatron's schedule beyond stock's: one per agreement."""
    if mode == "off":
        return 0
    return 3 if mode.endswith("+counting") else 2


# (id, layout, world size, calculate_per_token_loss)
CASES = [
    ("tp2-dp1", Layout(tp=2), 2, False),
    ("dp2", Layout(), 2, False),
    ("dp2-per-token", Layout(), 2, True),
    ("tp2-dp2", Layout(tp=2), 4, False),
    ("pp2-dp2", Layout(pp=2), 4, False),
    ("pp2-dp2-per-token", Layout(pp=2), 4, True),
    ("cp2-dp2", Layout(cp=2), 4, False),
]


@pytest.mark.parametrize(
    "layout, world, per_token", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_extra_collectives_per_mode(dist_pool, layout, world, per_token):
    modes = (*MODES, *KEPT_VARIANTS)
    variants = ("stock", *modes)
    normal = dist_pool.run(_step_counts, world, layout, per_token, variants, False)
    empty = dist_pool.run(_step_counts, world, layout, per_token, variants, True)
    for rank, (got, got_empty) in enumerate(zip(normal, empty, strict=True)):
        stock = got["counts"]["stock"]
        assert stock, f"rank {rank}: no collective counted at all; the counter is broken"
        stock_syncs = got["syncs"]["stock"]
        for mode in modes:
            extra = _extra(got["counts"][mode], stock)
            want = _expected_extra(mode, got)
            assert extra == want, f"rank {rank}, {mode}: extra collectives {extra}, want {want}"
            syncs = got["syncs"][mode]
            # None in the micro-batch loop (the counting pass runs the schedule twice: twice
            # stock's own); one host read per agreement otherwise.
            loops = 2 if mode.endswith("+counting") else 1
            assert syncs.get("loop", 0) == loops * stock_syncs.get("loop", 0), (rank, mode, syncs)
            step_extra = syncs.get("step", 0) - stock_syncs.get("step", 0)
            assert step_extra == _expected_syncs(mode, got), (rank, mode, syncs, stock_syncs)
        # Same collectives when a DP rank has no loss token: nothing branches on the data.
        for variant in variants:
            assert got_empty["counts"][variant] == got["counts"][variant], (
                f"rank {rank}, {variant}: {got_empty['counts'][variant]} with an empty DP rank "
                f"vs {got['counts'][variant]}"
            )


def _counter_self_check() -> dict[str, int]:
    import torch.distributed as dist

    with count_collectives() as counter:
        t = torch.ones(2)
        dist.all_reduce(t)
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, 1)  # internally all_gather: counted once, as the outer call
        dist.broadcast(t, src=0)
    dist.all_reduce(t)  # after the context: not counted, functions restored
    return dict(counter)


def test_counter_counts_outermost_calls_once(dist_pool):
    got = dist_pool.run(_counter_self_check, 2)
    assert got == [{"all_reduce@0,1": 1, "all_gather_object@0,1": 1, "broadcast@0,1": 1}] * 2


def _metrics_counts(layout: Layout, extremes: bool) -> dict[str, Any]:
    """Pool worker: one plugin step whose reports hold sums (and, with ``extremes``, a maximum
    and a minimum), then its ``step_metrics()``, counted."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lossfix.audit.training import train_step
    from megatron_lossfix.runtime.config import LossFixConfig
    from megatron_lossfix.step.schedule import LossFixSchedule

    chunks, optimizer, mbs = _rank_setup(layout, False, False)

    def forward_step(data_iterator: Any, model: Any) -> tuple:
        output, loss = _plugin_forward_step(data_iterator, model)

        def with_report(output_tensor: torch.Tensor) -> tuple:
            value, num_tokens, _ = loss(output_tensor)
            report = {"loss_sum": value.detach(), "tokens_count": num_tokens.double()}
            if extremes:
                report.update(loss_max=value.detach(), loss_min=value.detach())
            return value, num_tokens, report

        return output, with_report

    config = LossFixConfig(reduction="token_mean", self_check=False)
    schedule = LossFixSchedule(config, get_forward_backward_func())
    size = mbs[0]["tokens"].shape[0]
    train_step(schedule, forward_step, chunks, mbs, optimizer, seq_length=CASE.seq_length,
               micro_batch_size=size)  # fmt: skip
    with count_collectives() as counter, count_host_syncs() as synced:
        metrics = schedule.step_metrics()
    ranks = dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    return {
        "collectives": dict(counter),
        "syncs": dict(synced),
        "dp_cp_ranks": ",".join(map(str, ranks)),
        "metrics": metrics,
        "contributions": [float(c) for c in schedule.last_step.contributions],
    }


@pytest.mark.parametrize("extremes", [False, True], ids=["sums", "sums+extremes"])
def test_step_metrics_make_one_collective_and_one_host_read(dist_pool, extremes):
    got = dist_pool.run(_metrics_counts, 2, Layout(), extremes)
    op = "all_gather_into_tensor" if extremes else "all_reduce"
    everyone = [c for rank in got for c in rank["contributions"]]
    for rank in got:
        assert rank["collectives"] == {f"{op}@{rank['dp_cp_ranks']}": 1}, rank["collectives"]
        assert rank["syncs"] == {"step": 1}, rank["syncs"]
        metrics = rank["metrics"]
        assert metrics["tokens_count"] == metrics["num_tokens"]
        assert metrics["loss_sum"] == pytest.approx(sum(everyone), rel=1e-6)
        if extremes:
            assert metrics["loss_max"] == pytest.approx(max(everyone))
            assert metrics["loss_min"] == pytest.approx(min(everyone))
        assert metrics == got[0]["metrics"]
