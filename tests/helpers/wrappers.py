"""Data-parallel wrappers whose ``scale_gradients`` does nothing, for the pool's ranks.

``wrapped_step`` runs one masked-in-loss step of the tiny GPT (the deferred scale after the
schedule) with every chunk's class swapped for one of :data:`KINDS`, and returns, per rank,
``(outcome, message, seen)``: the exception class (or ``"ok"``), its message, and whether the
step has seen the chunks' scale work.
"""

from __future__ import annotations

from typing import Any

from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.data_parallel_base import _BaseDataParallel

from megatron_lossfix.audit.options import MASKED_OBJECTIVE
from megatron_lossfix.audit.oracle import OracleCase


class NoOpScaleDDP(DistributedDataParallel):
    """Megatron DDP that falls back to ``_BaseDataParallel``'s no-op ``scale_gradients``."""

    scale_gradients = _BaseDataParallel.scale_gradients


class IdleScaleDDP(DistributedDataParallel):
    """Megatron DDP whose own ``scale_gradients`` leaves the gradients unchanged."""

    def scale_gradients(self, scaling_factor: float) -> None:
        del scaling_factor


KINDS: dict[str, type | None] = {
    "ddp": None,
    "noop-scale": NoOpScaleDDP,
    "idle-scale": IdleScaleDDP,
}


def wrapped_step(kind: str, num_microbatches: int = 2) -> tuple[str, str, bool]:
    from megatron_lossfix.audit import oracle, tiny_gpt
    from megatron_lossfix.step import wrappers
    from megatron_lossfix.step.agreement import StepRefused

    original = tiny_gpt.build_tiny_gpt
    built: list[Any] = []

    def build(layout: Any, **kwargs: Any) -> tuple[list, Any]:
        chunks, config = original(layout, **kwargs)
        for chunk in chunks:
            if KINDS[kind] is not None:
                chunk.__class__ = KINDS[kind]
        built.extend(chunks)
        return chunks, config

    case = OracleCase(
        objective="ppo",
        rl_kwargs=dict(MASKED_OBJECTIVE),
        schedule_kwargs={"mask_in_loss": True},
    )
    tiny_gpt.build_tiny_gpt = build
    try:
        oracle.layout_grads(tiny_gpt.Layout(), case, ("token_mean",), num_microbatches)
        outcome, message = "ok", ""
    except StepRefused as exc:
        outcome, message = type(exc).__name__, str(exc)
    finally:
        tiny_gpt.build_tiny_gpt = original
    return outcome, message, not wrappers.unseen(built)


def measured_layout_grads(*args: Any) -> Any:
    """``oracle.layout_grads`` with every Megatron-FSDP strategy taken as proven at the
    installed release: what the wrapper gives, to hold against ``MEGATRON_FSDP_PROVEN``."""
    from megatron_lossfix.audit.oracle import layout_grads
    from megatron_lossfix.step import wrappers
    from megatron_lossfix.step.megatron_compat import megatron_core_version

    release = megatron_core_version().release[:2]
    saved = dict(wrappers.MEGATRON_FSDP_PROVEN)
    wrappers.MEGATRON_FSDP_PROVEN.update({s: v | {release} for s, v in saved.items()})
    try:
        return layout_grads(*args)
    finally:
        wrappers.MEGATRON_FSDP_PROVEN.update(saved)
