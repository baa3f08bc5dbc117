"""``--stack roll``: what each rank runs, ROLL's Megatron training step under a layout.

The step is ROLL's own ``MegatronTrainStrategy.train_step`` (``roll/distributed/strategy/
megatron_strategy.py`` at 8eb27cc, unchanged): its global token and sample counts
(``_get_batch_num_tokens``, ``_get_global_valid_samples``, all-reduced over DP), its
micro-batches (static chunks, ``make_micro_batch_iter_for_dynamic_batching`` or sequence
packing), its ``inner_forward_step`` (CP slicing, packing, the per-sample loss of a packed row)
with the loss scaled by ``num_microbatches x DP``, and Megatron-Core's schedule; the loss is the
RLVR actor's ``loss_func`` (``roll/pipeline/rlvr/actor_worker.py``) or the DPO worker's
(``roll/pipeline/dpo/actor_worker.py``), unchanged. The batch reaches each DP rank as ROLL's
pipeline hands it over: ``dynamic_batching_shard`` first under dynamic batching, then one
contiguous chunk per DP rank.

Only what ROLL builds from a Hugging Face checkpoint is replaced: :func:`audit_strategy` holds the
audit's tiny GPT (Megatron DDP) in a stand-in of ``mcore_adapter``'s ``VirtualModels``, with
``mcore_adapter``'s own context-parallel slicing bound to it (its ``pin_memory=True`` dropped on
a machine without CUDA), an optimizer that keeps the gradients (the audit compares them) and the
configuration fields the step reads.
"""

from __future__ import annotations

import os
import tempfile
import types
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.roll import batch as rb

__all__ = [
    "ADAPTED_ROW",
    "EXCLUDED_ROW",
    "ROLL_ROW",
    "ROWS",
    "audit_strategy",
    "roll_layout_grads",
    "runs",
]

ROLL_ROW, ADAPTED_ROW = "roll", "roll+lossfix"
#: The adapter with the plugin's ``--lossfix-mask-in-loss`` (settings that drop tokens only).
EXCLUDED_ROW = "roll+lossfix+mask-in-loss"
ROWS: tuple[str, ...] = (ROLL_ROW, ADAPTED_ROW, EXCLUDED_ROW)


def runs(
    modes: Sequence[str],
    settings: Sequence[str],
    batchings: Sequence[str],
    rows: Sequence[str] = ROWS,
) -> list[tuple[str, str, str]]:
    """Every ``(row, mode, setting@batching)`` a layout runs; the mask-in-loss row only for the
    settings that drop tokens, DPO once (it has no ``loss_agg_mode``) and statically batched
    (ROLL's DPO pairs adjacent rows: dynamic batching sorts them apart, packing takes each
    row's loss alone)."""
    out = []
    for setting in settings:
        for batching in batchings:
            if setting == "dpo" and batching != "static":
                continue
            for mode in modes[:1] if setting == "dpo" else modes:
                for row in rows:
                    if row != EXCLUDED_ROW or setting in rb.DROPPING:
                        out.append((row, mode, f"{setting}@{batching}"))
    return out


class _NoPinnedMemory(TorchFunctionMode):
    """Drops ``pin_memory=True`` (it needs a CUDA driver) from tensor factories."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("pin_memory") and not torch.cuda.is_available():
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def _bind_cp_slicing(module: torch.nn.Module) -> None:
    """``mcore_adapter``'s ``PretrainedModel.get_batch_on_this_cp_rank`` on the audit's model
    (ROLL's strategy slices its non-packed micro-batches for CP through it)."""
    from mcore_adapter.models.model_factory import PretrainedModel

    def get_batch_on_this_cp_rank(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _NoPinnedMemory():
            return PretrainedModel.get_batch_on_this_cp_rank(self, *args, **kwargs)

    module.get_batch_on_this_cp_rank = types.MethodType(get_batch_on_this_cp_rank, module)


def _logits_as_on_gpu(module: torch.nn.Module) -> None:
    """The last stage's logits in float64 (exact for float32 values). ``mcore_adapter``'s
    log-probs call ``.float()`` on the logits and then work on them in place: on a GPU's bf16
    logits that is a copy; on the CPU's float32 logits it is the logits themselves, and the packed
    samples (views of one output) then overwrite what autograd saved. A float64 output makes
    ``.float()`` copy again, as it does on a GPU."""
    if getattr(module, "post_process", False):
        module.register_forward_hook(lambda _mod, _args, out: out.double())


class _Models(list):
    """``mcore_adapter``'s ``VirtualModels`` as the strategy's step uses it: the model chunks
    (Megatron DDP), ``train``, ``get_models`` and the config."""

    def __init__(self, chunks: list, config: Any) -> None:
        super().__init__(chunks)
        self.config = config

    def train(self) -> None:
        for chunk in self:
            chunk.train()

    def get_models(self) -> list:
        return list(self)


class _KeepGradients:
    """The strategy's optimizer: no update; ``step`` gathers the full gradient (the step zeroes
    the gradient buffers right after it)."""

    def __init__(self, chunks: list) -> None:
        self.chunks = chunks
        self.grads: dict[str, torch.Tensor] | None = None

    def reload_states(self, include: Any = None, non_blocking: bool = False) -> None:
        return None

    def step(self) -> tuple[bool, float, None]:
        from megatron_lossfix.audit.tiny_gpt import gather_full_grads

        self.grads = gather_full_grads(self.chunks)
        return True, 0.0, None

    def zero_grad(self) -> None:
        return None


def _worker(kind: str, pipeline: dict[str, Any], strategy: Any) -> Any:
    """ROLL's RLVR actor or DPO worker (its ``loss_func``, unchanged) on ``strategy``."""

    from roll.configs.base_config import (
        TrainInferCorrectionConfig,
        TrainInferFilterConfig,
    )

    if kind == "dpo":
        from roll.pipeline.dpo.actor_worker import ActorWorker
    else:
        from roll.pipeline.rlvr.actor_worker import ActorWorker
    worker = ActorWorker.__new__(ActorWorker)
    filters = []
    if pipeline.pop("filter", False):
        low, high = rb.FILTER_BAND
        filters.append(
            TrainInferFilterConfig(enabled=True, agg_type="token", ratio_low=low, ratio_high=high)
        )
    worker.pipeline_config = SimpleNamespace(
        **pipeline, train_infer_correction=TrainInferCorrectionConfig(filters=filters)
    )
    worker.strategy = strategy
    worker._logprobs_cache = {}
    return worker


def audit_strategy(
    chunks: list, config: Any, layout: Any, batching: str, mbs: int, num_microbatches: int
) -> Any:
    """A ROLL ``MegatronTrainStrategy`` on the audit's model chunks: ROLL's methods, unchanged,
    on the fields its training step reads (``__init__`` and ``initialize`` build a model from
    a Hugging Face checkpoint, which the audit replaces)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from roll.configs.worker_config import SequencePackingConfig
    from roll.distributed.strategy.megatron_strategy import MegatronTrainStrategy

    dynamic, packed = rb.BATCHINGS[batching]
    strategy = MegatronTrainStrategy.__new__(MegatronTrainStrategy)
    unwrapped = [chunk.module for chunk in chunks]
    for module in unwrapped:
        _bind_cp_slicing(module)
        _logits_as_on_gpu(module)
    strategy.model = _Models(chunks, config)
    strategy.models_unwrapped = unwrapped
    strategy.forward_backward_func = get_forward_backward_func()
    strategy.seq_length = rb.SEQ_LENGTH
    strategy.use_sequence_packing = packed
    strategy.enable_router_replay = False
    strategy.is_multimodal = False
    strategy.optimizer = _KeepGradients(chunks)
    strategy.scheduler = SimpleNamespace(step=lambda: None)
    strategy.megatron_train_args = SimpleNamespace(
        gradient_accumulation_steps=num_microbatches, cross_entropy_loss_fusion=False
    )
    strategy.worker_config = SimpleNamespace(
        name="actor_train",
        use_dynamic_batching_in_train=dynamic,
        use_sequence_packing=packed,
        apply_loss_scale=True,
        logits_in_fp32=True,
        training_args=SimpleNamespace(per_device_train_batch_size=mbs),
        strategy_args=SimpleNamespace(strategy_config={}),
        sequence_packing_args=SequencePackingConfig(),
    )
    strategy.worker = SimpleNamespace(
        rank_info=SimpleNamespace(tp_size=layout.tp, cp_size=layout.cp),
    )
    return strategy


def _rank_batch(batch: dict[str, torch.Tensor], setting: str, batching: str, lay: Any) -> Any:
    """This DP rank's share of the step, as ROLL's pipeline hands it to the actor's train step."""
    from megatron.core import parallel_state as ps
    from roll.distributed.scheduler.protocol import DataProto
    from roll.utils.dynamic_batching import (
        dynamic_batching_shard,
        make_mini_batch_iter_for_dynamic_batching,
    )

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    data = DataProto.from_dict(tensors={k: v.clone() for k, v in batch.items()})
    dynamic, _ = rb.BATCHINGS[batching]
    if dynamic:
        data, _ = dynamic_batching_shard(
            data, dp, rb.DYNAMIC_TOKENS, rb.DYNAMIC_ROUND, lay.pp, None, "audit"
        )
    local = data.chunk(dp)[rank]
    keys = [] if setting.startswith("dpo") else ["response_mask"]
    local.meta_info.update(
        loss_mask_keys=keys, is_offload_optimizer_states_in_train_step=False, global_step=0
    )
    if dynamic:
        (local,) = make_mini_batch_iter_for_dynamic_batching(
            local, epochs=1, ga_steps=len(local.meta_info["micro_batch_indices"])
        )
    return local


def _switch(row: str) -> Any:
    """The documented switch of ``row`` (none for ROLL as released); returns its undo."""
    from megatron_lossfix.integrations import roll as adapter

    if row == ADAPTED_ROW:
        return adapter.enable()
    if row == EXCLUDED_ROW:
        return adapter.enable(mask_in_loss=True)
    return None


def roll_layout_grads(
    layout: Any,
    case: OracleCase,
    modes: Sequence[str],
    num_microbatches: int,
    rows: Sequence[str] = ROWS,
    settings: Sequence[str] = ("plain",),
    batchings: Sequence[str] = ("static",),
) -> dict[tuple[str, str, str], dict[str, torch.Tensor]] | None:
    """Every ``(row, mode, setting@batching)`` step under ``layout`` (:func:`runs`); the full
    gradients on global rank 0."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit import tiny_gpt

    # ROLL's logger writes a file per process, by default under ./output/logs.
    os.environ.setdefault("ROLL_LOG_DIR", os.path.join(tempfile.gettempdir(), "roll-audit-logs"))
    tiny_gpt.init_layout(layout)
    chunks, config = tiny_gpt.case_tiny_gpt(layout, case)
    out = {}
    for run in runs(modes, settings, batchings, rows):
        row, mode, key = run
        setting, batching = key.split("@")
        batch = rb.roll_batch(case, config.vocab_size, setting)
        mbs = case.global_batch_size // ps.get_data_parallel_world_size() // num_microbatches
        strategy = audit_strategy(chunks, config, layout, batching, mbs, num_microbatches)
        kind = "dpo" if setting == "dpo" else "rlvr"
        worker = _worker(kind, rb.pipeline_settings(mode, setting), strategy)
        strategy.worker.pipeline_config = worker.pipeline_config
        local = _rank_batch(batch, setting, batching, layout)
        tiny_gpt.set_deterministic_params(chunks, case.seed)
        undo = _switch(row)
        try:
            strategy.train_step(local, worker.loss_func)
        finally:
            if undo is not None:
                undo()
        out[run] = strategy.optimizer.grads
    return out if torch.distributed.get_rank() == 0 else None
