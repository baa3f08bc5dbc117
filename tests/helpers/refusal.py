"""Break one rank's step and record how, and when, every rank of the step ends.

``refusal_case`` runs on the ranks of a :class:`~megatron_lossfix.audit.pool.DistPool` call:
one training step of the tiny GPT under PP2 x DP2 (world 4) through ``LossFixSchedule``, with the
loss-stage input of one rank (by default global rank 3: last pipeline stage, DP rank 1) broken
in the way ``case`` names. Each rank returns ``(outcome, message, seconds)``: the exception class
(or ``"ok"``), its message and the seconds from the common start to the end of its step.

A rank that raised does not leave at once: like a real process that caught the error, or an
NCCL rank whose communicators stay alive, it holds its connections until every rank has ended
its step or ``hold_s`` passed. So a peer that is left waiting on it (in Megatron's
point-to-point or in a collective) shows up as a step that took ``hold_s`` and ended with a
connection error, not as a quick failure caused by the pool tearing the group down.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from megatron_lossfix.audit.oracle import OracleCase, make_global_batch
from megatron_lossfix.audit.oracle_case import microbatch_ids
from megatron_lossfix.audit.tiny_gpt import Layout, build_tiny_gpt, init_layout
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.losses import weighted_loss
from megatron_lossfix.step.agreement import Agreement, StepSettings
from megatron_lossfix.step.schedule import LossFixSchedule

CASES = (
    "none",
    "missing-mask",
    "non-dict",
    "no-iterator",
    "range",
    "oserror",
    "fractional-mask",
    "short",
    "per-token-missing-mask",
    "int-loss",
    "group-id-range",
    "group-id-float",
    "group-ids-missing",
    "group-range-disagree",
)
"""``none`` breaks nothing. ``int-loss`` (the loss function returns a Python int) is found
inside Megatron's schedule, after the pre-step agreement; the agreement after the step refuses
it on every rank. The ``group-*`` cases break the group ids of ``group_mean``: an id out of
range, float ids, no ids, and a rank whose ``num_groups`` differs from its peers'."""


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _meet(store: Any, key: str, world: int, deadline_s: float) -> None:
    """Wait (polling the rendezvous store, not a process group) until ``world`` ranks arrive."""
    store.add(key, 1)
    end = time.monotonic() + deadline_s
    while store.add(key, 0) < world and time.monotonic() < end:
        time.sleep(0.02)


class _FailingIterator:
    """Yields ``batches`` but raises OSError on the second read (an I/O error mid-step)."""

    def __init__(self, batches: list):
        self._it = iter(batches)
        self._reads = 0

    def __iter__(self) -> _FailingIterator:
        return self

    def __next__(self) -> Any:
        self._reads += 1
        if self._reads == 2:
            raise OSError("simulated read error (shard file vanished)")
        return next(self._it)


def _forward_step(int_loss: bool, data_iterator: Any, model: Any) -> tuple:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    if int_loss:
        return output, lambda out: (1, {})
    weights = batch.get("loss_weights")
    if weights is None:  # stock Megatron: Megatron-LM's (sum(m*l), m.sum(), report)
        weights = batch["loss_mask"].float()
    return output, partial(weighted_loss, weights)


def _broken_iterator(case: str, mbs: list[dict]) -> Any:
    """The bad rank's data iterator for ``case`` (the cases that break the loss function itself
    get the good one)."""
    if case in ("missing-mask", "per-token-missing-mask"):
        return iter([{k: v for k, v in mb.items() if k != "loss_mask"} for mb in mbs])
    if case == "non-dict":
        return iter(range(len(mbs)))
    if case == "no-iterator":
        return None
    if case == "range":
        return range(len(mbs))
    if case == "oserror":
        return _FailingIterator(mbs)
    if case == "fractional-mask":
        return iter([{**mb, "loss_mask": mb["loss_mask"] * 0.5} for mb in mbs])
    if case == "short":
        return iter(mbs[:1])
    if case == "group-id-range":  # the last sequence's id is the range itself
        return iter(
            [{**mb, "group_ids": mb["group_ids"].clone().fill_(mb["num_groups"])} for mb in mbs]
        )
    if case == "group-id-float":
        return iter([{**mb, "group_ids": mb["group_ids"].float()} for mb in mbs])
    if case == "group-ids-missing":
        return iter([{k: v for k, v in mb.items() if k != "group_ids"} for mb in mbs])
    if case == "group-range-disagree":
        return iter([{**mb, "num_groups": mb["num_groups"] + 1} for mb in mbs])
    return iter(mbs)


def refusal_case(
    case: str, mode: str = "token_mean", bad_rank: int = 3, hold_s: float = 60.0
) -> tuple[str, str | None, float]:
    """Pool worker (world 4): see the module docstring."""
    return _refusal_step(case, mode, bad_rank, hold_s)[0]


def refusal_and_gradient(
    case: str, mode: str = "token_mean", bad_rank: int = 3, hold_s: float = 60.0
) -> tuple[str, str | None, float, float]:
    """Pool worker (world 4): :func:`refusal_case`'s outcome and the largest absolute gradient
    entry this rank's model holds after the step (0 where nothing was trained)."""
    outcome, chunks = _refusal_step(case, mode, bad_rank, hold_s)
    largest = max(float(p.main_grad.abs().max()) for c in chunks for p in c.parameters())
    return (*outcome, largest)


def _refusal_step(
    case: str, mode: str, bad_rank: int, hold_s: float
) -> tuple[tuple[str, str | None, float], list]:
    import torch.distributed as dist

    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; choose one of {CASES}")
    layout = init_layout(Layout(pp=2))
    per_token = case == "per-token-missing-mask"
    oracle = OracleCase(global_batch_size=8, seq_length=16)
    chunks, config = build_tiny_gpt(
        layout, seq_len=oracle.seq_length, calculate_per_token_loss=per_token
    )
    from megatron.core import parallel_state as ps

    rank, world = dist.get_rank(), dist.get_world_size()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = make_global_batch(oracle, config.vocab_size)
    m, per_rank = 2, oracle.global_batch_size // dp
    size = per_rank // m
    start = dp_rank * per_rank
    mbs = [
        {key: t[start + k * size : start + (k + 1) * size] for key, t in batch.items()}
        | microbatch_ids(oracle, size)
        for k in range(m)
    ]
    iterator = _broken_iterator(case, mbs) if rank == bad_rank else iter(mbs)
    schedule = LossFixSchedule(LossFixConfig(reduction=mode))
    store = _store()
    _meet(store, "start", world, 120.0)
    t0 = time.monotonic()
    try:
        schedule(
            forward_step_func=partial(_forward_step, case == "int-loss" and rank == bad_rank),
            data_iterator=iterator,
            model=chunks[0],
            num_microbatches=m,
            seq_length=oracle.seq_length,
            micro_batch_size=size,
            forward_only=False,
        )
        outcome: tuple[str, str | None, float] = ("ok", None, time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which judges it
        outcome = (type(exc).__name__, str(exc), time.monotonic() - t0)
    # Stay connected (as a live process would) until every rank is done or hold_s passed.
    _meet(store, "done", world, hold_s)
    return outcome, chunks


def _allreduce_seconds(reps: int, *groups: Any, vec: Any = None) -> list[list[float]]:
    """Per group, the seconds of ``reps`` all-reduces of ``vec`` (default: an agreement-sized
    vector), each with its host read (the read is what makes the step wait for the result)."""
    import torch
    import torch.distributed as dist

    if vec is None:
        settings = StepSettings("token_mean", per_token=False)
        vec = Agreement.of_rank(settings, num_counts=2, device=torch.device("cpu")).to_tensor()
    out: list[list[float]] = [[] for _ in groups]
    for _ in range(reps):
        for group, seconds in zip(groups, out, strict=True):
            start = time.perf_counter()
            dist.all_reduce(vec, group=group)
            vec.tolist()
            seconds.append(time.perf_counter() - start)
    return out


def _step_milliseconds(
    variants: tuple[str, ...], chunks: list, mbs: list[dict], seq_length: int, steps: int
) -> dict[str, float]:
    """Median milliseconds of a whole training step (2 micro-batches of 2) per variant:
    ``stock`` (Megatron's schedule) or a mode through ``LossFixSchedule``."""
    import statistics

    from megatron.core.pipeline_parallel import get_forward_backward_func

    step_ms: dict[str, list[float]] = {variant: [] for variant in variants}
    for _ in range(steps):
        for variant in variants:
            func = (
                get_forward_backward_func()
                if variant == "stock"
                else LossFixSchedule(LossFixConfig(reduction=variant, self_check=False))
            )
            for chunk in chunks:
                chunk.zero_grad_buffer()
            start = time.perf_counter()
            func(
                forward_step_func=partial(_forward_step, False),
                data_iterator=iter(mbs),
                model=chunks[0],
                num_microbatches=2,
                seq_length=seq_length,
                micro_batch_size=2,
                forward_only=False,
            )
            step_ms[variant].append((time.perf_counter() - start) * 1e3)
    return {f"{k}_ms": statistics.median(v) for k, v in step_ms.items()}


def verdict_cost(reps: int = 300, steps: int = 8) -> dict[str, float]:
    """Pool worker (world 4, PP2 x DP2): what the pipeline verdict costs on this machine.

    ``allreduce_us`` / ``dp_allreduce_us``: median time of one agreement all-reduce (the
    vector over the pipeline group / the DP x CP group, gloo, with its host read); a plugin step
    makes two of each here, one before and one after Megatron's schedule. ``stock_ms`` /
    ``token_mean_ms``: median time of a whole training step (tiny GPT, 2 micro-batches) stock
    and through the plugin, for scale."""
    import statistics

    from megatron.core import parallel_state as ps

    layout = init_layout(Layout(pp=2))
    oracle = OracleCase(global_batch_size=8, seq_length=16)
    chunks, config = build_tiny_gpt(layout, seq_len=oracle.seq_length)
    times, dp_times = _allreduce_seconds(
        reps,
        ps.get_pipeline_model_parallel_group(),
        ps.get_data_parallel_group(with_context_parallel=True),
    )
    dp_rank = ps.get_data_parallel_rank()
    batch = make_global_batch(oracle, config.vocab_size)
    mbs = [
        {key: t[dp_rank * 4 + k * 2 : dp_rank * 4 + (k + 1) * 2] for key, t in batch.items()}
        for k in range(2)
    ]
    return {
        "allreduce_us": statistics.median(times) * 1e6,
        "dp_allreduce_us": statistics.median(dp_times) * 1e6,
        **_step_milliseconds(("stock", "token_mean"), chunks, mbs, oracle.seq_length, steps),
    }


def group_counts_cost(num_groups: int = 4096, reps: int = 300, steps: int = 8) -> dict[str, float]:
    """Pool worker (DP = world size): what ``group_mean``'s one extra all-reduce costs.

    ``agreement_us`` / ``group_counts_us``: median time of one agreement-sized all-reduce and of
    one all-reduce of ``num_groups`` float64 per-group counts over the DP group (gloo, each with
    a host read). ``token_mean_ms`` / ``group_mean_ms``: median time of a whole training step
    (tiny GPT, 2 micro-batches of 2 sequences) through the plugin, the second with group ids in
    ``[0, num_groups)``, for scale."""
    import statistics

    import torch
    from megatron.core import parallel_state as ps

    layout = init_layout(Layout())
    dp = ps.get_data_parallel_world_size()
    oracle = OracleCase(global_batch_size=4 * dp, seq_length=16)
    chunks, config = build_tiny_gpt(layout, seq_len=oracle.seq_length)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    (agreement,) = _allreduce_seconds(reps, group)
    counts = torch.zeros(num_groups, dtype=torch.float64)
    (per_group,) = _allreduce_seconds(reps, group, vec=counts)
    dp_rank = ps.get_data_parallel_rank()
    batch = make_global_batch(oracle, config.vocab_size)
    # Sequences spread over the whole id range: most groups are empty, as in a large step.
    batch["group_ids"] = torch.arange(oracle.global_batch_size) * (num_groups // 8 // dp)
    mbs = [
        {key: t[dp_rank * 4 + k * 2 : dp_rank * 4 + (k + 1) * 2] for key, t in batch.items()}
        | {"num_groups": num_groups}
        for k in range(2)
    ]
    return {
        "agreement_us": statistics.median(agreement) * 1e6,
        "group_counts_us": statistics.median(per_group) * 1e6,
        **_step_milliseconds(("token_mean", "group_mean"), chunks, mbs, oracle.seq_length, steps),
    }
