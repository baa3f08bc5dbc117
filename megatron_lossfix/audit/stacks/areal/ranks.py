"""``--stack areal``: what each rank runs, AReaL's Megatron training step under a layout.

The step is AReaL's own ``MegatronEngine.train_batch`` (areal 1.0.4, unchanged): its
micro-batches (``_prepare_mb_list``: packing, padding, ``n_mbs`` rounded to a multiple of PP),
its total loss weight (``compute_total_loss_weight``, all-reduced over DP x CP), its
``forward_backward_batch`` (the packed, context-parallel forward; Megatron-Core's schedule) and
its loss scaling (``_compute_logprobs_and_loss``: ``loss x local / total x DP x micro-batches``),
with ``grpo_loss_fn``. Only what an engine builds from a Hugging Face checkpoint is replaced:
:class:`AuditEngine` holds the audit's tiny GPT (Megatron DDP), an optimizer that keeps the
gradients (the audit compares them) and AReaL's configuration fields the step reads.

AReaL's engine module imports Megatron Bridge (``AutoBridge``, ``LoRA``: the checkpoint
conversion and adapters, never on the loss path), whose package imports Transformer Engine,
which needs CUDA. Where Megatron Bridge is not installed, :func:`provide_megatron_bridge` gives
those two names as stand-ins that refuse to be built.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import types
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.areal import batch as ab

__all__ = [
    "ADAPTED_ROW",
    "AREAL_ROW",
    "EXCLUDED_ROW",
    "ROWS",
    "areal_layout_grads",
    "audit_engine",
    "provide_megatron_bridge",
    "runs",
]

AREAL_ROW, ADAPTED_ROW = "areal", "areal+lossfix"
#: The adapter with the plugin's ``--lossfix-mask-in-loss`` (settings that drop tokens only).
EXCLUDED_ROW = "areal+lossfix+mask-in-loss"
ROWS: tuple[str, ...] = (AREAL_ROW, ADAPTED_ROW, EXCLUDED_ROW)


def runs(
    modes: Sequence[str], settings: Sequence[str], rows: Sequence[str] = ROWS
) -> list[tuple[str, str, str]]:
    """Every ``(row, mode, setting)`` a layout runs; the mask-in-loss row only for the settings
    that drop tokens."""
    return [
        (row, mode, setting)
        for setting in settings
        for mode in modes
        for row in rows
        if row != EXCLUDED_ROW or setting in ab.DROPPING
    ]


class _StandIn:
    """A Megatron Bridge class the audit never builds (checkpoint conversion, LoRA)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{type(self).__name__} is a stand-in: Megatron Bridge is not installed "
            "(the AReaL stack audit needs no checkpoint conversion)"
        )


def provide_megatron_bridge() -> None:
    """Where Megatron Bridge is not installed, give ``megatron.bridge.AutoBridge`` and
    ``megatron.bridge.peft.lora.LoRA`` (what ``areal/engine/megatron_engine.py`` imports at
    its top) as stand-ins; any other ``megatron.bridge`` module stays missing, which AReaL's
    optional Bridge patches expect (they catch the ImportError)."""
    if "megatron.bridge" in sys.modules:
        return
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.bridge"):
        return
    bridge = types.ModuleType("megatron.bridge")
    bridge.__path__ = []  # a package: submodules are looked up (and not found)
    bridge.AutoBridge = type("AutoBridge", (_StandIn,), {})
    peft = types.ModuleType("megatron.bridge.peft")
    peft.__path__ = []
    lora = types.ModuleType("megatron.bridge.peft.lora")
    lora.LoRA = type("LoRA", (_StandIn,), {})
    bridge.peft, peft.lora = peft, lora
    sys.modules.update(
        {"megatron.bridge": bridge, "megatron.bridge.peft": peft, "megatron.bridge.peft.lora": lora}
    )


class _KeepGradients:
    """The engine's optimizer: no loss scaling, no update (the audit reads the gradients)."""

    param_groups: list[dict[str, float]] = [{"lr": 0.0}]

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(())

    def zero_grad(self) -> None:
        return None

    def step(self) -> tuple[bool, None, None]:
        return True, None, None


def audit_engine(chunks: list, layout: Any, num_microbatches: int) -> Any:
    """An AReaL ``MegatronEngine`` on the audit's model chunks: AReaL's methods, unchanged,
    on the fields its training step reads (``__init__`` and ``initialize`` build a model from a
    Hugging Face checkpoint, which the audit replaces)."""
    provide_megatron_bridge()
    from areal.api.cli_args import MicroBatchSpec
    from areal.engine.megatron_engine import MegatronEngine

    engine = MegatronEngine.__new__(MegatronEngine)
    engine.model = list(chunks)
    engine.optimizer = _KeepGradients()
    engine.config = SimpleNamespace(
        mb_spec=MicroBatchSpec(n_mbs=num_microbatches),
        pad_to_maximum=False,
        temperature=1.0,
        is_critic=False,
    )
    engine.parallel_strategy = SimpleNamespace(
        pipeline_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        tensor_parallel_size=layout.tp,
    )
    engine.enable_tree_training = False
    engine.enable_fp8 = False
    engine.is_vision_model = False
    engine.use_padded_seq = False
    engine.is_offload = False
    engine.device = next(chunks[0].parameters()).device
    engine.logger = logging.getLogger("areal.audit")
    return engine


def _switch(row: str) -> Any:
    """The documented switch of ``row`` (none for AReaL as released); returns its undo."""
    from megatron_lossfix.integrations import areal as adapter

    if row == ADAPTED_ROW:
        return adapter.enable()
    if row == EXCLUDED_ROW:
        return adapter.enable(mask_in_loss=True)
    return None


def _run_row(run: tuple[str, str, str], engine: Any, batch: dict) -> None:
    """One AReaL training step (forward and backward, gradients reduced) of ``run``."""
    from areal.trainer.ppo.actor import grpo_loss_fn
    from megatron.core import parallel_state as ps

    row, _, setting = run
    local = ab.rank_slice(batch, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    loss_fn = functools.partial(grpo_loss_fn, **ab.loss_kwargs(setting))
    # AReaL's PPO actor (ppo_update) weighs each micro-batch by its loss tokens.
    undo = _switch(row)
    try:
        engine.train_batch(local, loss_fn, lambda x: x["loss_mask"].count_nonzero())
    finally:
        if undo is not None:
            undo()


def areal_layout_grads(
    layout: Any,
    case: OracleCase,
    modes: Sequence[str],
    num_microbatches: int,
    rows: Sequence[str] = ROWS,
    settings: Sequence[str] = ("grpo",),
) -> dict[tuple[str, str, str], dict[str, torch.Tensor]] | None:
    """Every ``(row, mode, setting)`` step under ``layout`` (:func:`runs`); the full gradients
    on global rank 0."""
    from megatron_lossfix.audit import tiny_gpt

    tiny_gpt.init_layout(layout)
    chunks, config = tiny_gpt.case_tiny_gpt(layout, case)
    engine = audit_engine(chunks, layout, num_microbatches)
    out = {}
    for run in runs(modes, settings, rows):
        batch = ab.areal_batch(case, config.vocab_size, run[2])
        tiny_gpt.set_deterministic_params(chunks, case.seed)
        _run_row(run, engine, batch)
        out[run] = tiny_gpt.gather_full_grads(chunks)
    return out if torch.distributed.get_rank() == 0 else None
