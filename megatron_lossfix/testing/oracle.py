"""The gradient oracle: one training step under a parallel layout versus a one-rank reference.

``layout_grads`` runs inside every rank of a :class:`~megatron_lossfix.testing.pool.DistPool`
call: it builds the tiny GPT for the layout, gives it the same global weights as any other
layout, feeds this rank's share of one deterministic global batch through the plugin's schedule
for each requested mode, and gathers the full gradient on global rank 0. ``reference_grads``
computes, in one process, what every layout must reproduce: one forward and backward of the
whole global batch as a single micro-batch, with the loss ``sum(w * l)`` and the weights of
``loss_weights``. ``relative_error`` compares the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

__all__ = [
    "OracleCase",
    "layout_grads",
    "make_global_batch",
    "reference_grads",
    "relative_error",
    "split_for_rank",
]


@dataclass(kw_only=True, slots=True)
class OracleCase:
    """One data set and model, shared by a layout run and its reference."""

    global_batch_size: int = 24
    """Sequences per optimizer step."""
    seq_length: int = 16
    """Tokens per sequence (divisible by 2 x CP for load-balanced CP sharding)."""
    seed: int = 1234
    """Seed of the data and of the layout-independent weights."""
    norm_constant: float = 16.0
    """C of ``seq_mean_token_sum_norm``."""
    per_token: bool = False
    """Megatron's ``calculate_per_token_loss``."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of ``build_tiny_gpt`` (experts, no_attention, ...)."""
    schedule_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``LossFixConfig`` fields."""
    microbatch_counts: Sequence[int] | None = None
    """Per-DP-rank micro-batch counts (uneven); None: the same count on every rank."""


def make_global_batch(case: OracleCase, vocab_size: int) -> dict[str, torch.Tensor]:
    """Deterministic global batch of variable-length sequences: a prompt (no loss), a response
    (loss) and padding; some sequences hold no loss token at all."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.global_batch_size, case.seq_length
    tokens = torch.randint(0, vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, vocab_size, (b, s), generator=gen)
    prompt = torch.randint(0, s // 2, (b,), generator=gen)
    response = torch.randint(0, s, (b,), generator=gen)
    response[::7] = 0  # zero-token sequences
    pos = torch.arange(s)
    mask = ((pos[None, :] >= prompt[:, None]) & (pos[None, :] < (prompt + response)[:, None]))
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": mask.float(),
        "position_ids": pos.expand(b, s).clone(),
    }


def split_for_rank(
    batch: dict[str, torch.Tensor], dp_rank: int, counts: Sequence[int], sizes: Sequence[int]
) -> list[dict[str, torch.Tensor]]:
    """DP rank ``r`` takes the r-th contiguous slice (``sizes[r]`` sequences), cut into
    ``counts[r]`` contiguous micro-batches (as even as possible)."""
    start = sum(sizes[:dp_rank])
    local = {k: v[start : start + sizes[dp_rank]] for k, v in batch.items()}
    m = counts[dp_rank]
    bounds = [round(i * sizes[dp_rank] / m) for i in range(m + 1)]
    return [{k: v[bounds[i] : bounds[i + 1]] for k, v in local.items()} for i in range(m)]


def _plan(case: OracleCase, dp: int, num_microbatches: int) -> tuple[list[int], list[int]]:
    counts = list(case.microbatch_counts or [num_microbatches] * dp)
    if len(counts) != dp:
        raise ValueError(f"microbatch_counts has {len(counts)} entries for DP={dp}")
    sizes = [case.global_batch_size // dp] * dp
    if sum(sizes) != case.global_batch_size:
        raise ValueError(f"global batch {case.global_batch_size} is not divisible by DP={dp}")
    return counts, sizes


def _forward_step(data_iterator: Any, model: Any) -> tuple:
    from megatron_lossfix.losses import weighted_loss

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(weighted_loss, batch.get("loss_weights"))


def layout_grads(
    layout: Any, case: OracleCase, modes: Sequence[str], num_microbatches: int
) -> dict[str, Any] | None:
    """Run one step per mode under ``layout``; on global rank 0 return
    ``{mode: {"grads": {name: grad}, "metrics": {...}}}`` (None on other ranks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_lossfix.config import LossFixConfig
    from megatron_lossfix.schedule import LossFixSchedule
    from megatron_lossfix.testing.tiny_gpt import (
        build_tiny_gpt,
        gather_full_grads,
        init_layout,
        set_deterministic_params,
    )

    init_layout(layout)
    chunks, config = build_tiny_gpt(
        layout,
        seq_len=case.seq_length,
        calculate_per_token_loss=case.per_token,
        **case.model_kwargs,
    )
    set_deterministic_params(chunks, case.seed)
    dp = ps.get_data_parallel_world_size()
    counts, sizes = _plan(case, dp, num_microbatches)
    batch = make_global_batch(case, config.vocab_size)
    mbs = split_for_rank(batch, ps.get_data_parallel_rank(), counts, sizes)
    sharded = case.schedule_kwargs.get("data_is_cp_sharded", False)
    if sharded:
        mbs = [get_batch_on_this_cp_rank(dict(mb)) for mb in mbs]
    out: dict[str, Any] = {}
    for mode in modes:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        schedule = LossFixSchedule(
            LossFixConfig(reduction=mode, norm_constant=case.norm_constant, **case.schedule_kwargs)
        )
        step = _forward_step
        if not sharded and ps.get_context_parallel_world_size() > 1:
            step = partial(_cp_slicing_forward_step, _forward_step)
        iterators = [iter(mbs) for _ in chunks]
        schedule(
            forward_step_func=step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=counts[ps.get_data_parallel_rank()],
            seq_length=case.seq_length,
            micro_batch_size=max(1, sizes[0] // max(counts)),
            forward_only=False,
        )
        grads = gather_full_grads(chunks)
        metrics = schedule.step_metrics()
        if grads is not None:
            out[mode] = {"grads": grads, "metrics": metrics}
    return out if torch.distributed.get_rank() == 0 else None


def _cp_slicing_forward_step(inner: Any, data_iterator: Any, model: Any) -> tuple:
    """Megatron-LM's convention: the iterator yields whole sequences, forward_step slices them
    (and the weights with them) for this CP rank."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    class _Sliced:
        def __next__(self) -> dict:
            return get_batch_on_this_cp_rank(dict(next(data_iterator)))

    return inner(_Sliced(), model)


def reference_grads(
    case: OracleCase, mode: str, partition: Sequence[int] | None = None
) -> dict[str, Any]:
    """One rank, one micro-batch: the whole global batch, loss ``sum(w * l)``; returns
    ``{"grads": {name: grad}, "loss": L}``.

    ``partition`` (micro-batch sizes in global order) matters only for ``token_mean_legacy``,
    whose weights depend on the micro-batches; ``off`` is compared with ``token_mean``.
    Must run on a rank whose process group has exactly one rank.
    """
    from megatron_lossfix.losses import weighted_sum
    from megatron_lossfix.reduction import loss_weights
    from megatron_lossfix.testing.tiny_gpt import (
        Layout,
        build_tiny_gpt,
        gather_full_grads,
        init_layout,
        set_deterministic_params,
    )

    layout = Layout()
    init_layout(layout)
    chunks, config = build_tiny_gpt(
        layout, seq_len=case.seq_length, calculate_per_token_loss=False, **case.model_kwargs
    )
    set_deterministic_params(chunks, case.seed)
    batch = make_global_batch(case, config.vocab_size)
    target = "token_mean" if mode == "off" else mode
    if target == "token_mean_legacy":
        masks = list(torch.split(batch["loss_mask"], list(partition)))
        weights = torch.cat(loss_weights(masks, target))
    else:
        weights = loss_weights(
            [batch["loss_mask"]], target, norm_constant=case.norm_constant
        )[0]
    model = chunks[0]
    model.zero_grad_buffer()
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = weighted_sum(output, weights)
    loss.backward()
    model.finish_grad_sync()
    return {"grads": gather_full_grads(chunks), "loss": float(loss)}


def relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of the full gradient (all parameters, flattened)."""
    if set(got) != set(ref):
        missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
        raise AssertionError(f"gradient names differ: missing {missing}, unexpected {extra}")
    names = sorted(ref)
    g = torch.cat([got[n].double().flatten() for n in names])
    r = torch.cat([ref[n].double().flatten() for n in names])
    return float((g - r).norm() / r.norm().clamp(min=1e-30))
