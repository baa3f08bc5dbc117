"""``--stack ms-swift``: what each rank runs, one of ms-swift's Megatron training steps.

The step is ms-swift's own ``BaseMegatronTrainer.train_step`` (ms-swift 4.6.0,
``swift/megatron/trainers/base.py``, unchanged) of the setting's trainer: ``MegatronTrainer``
(SFT), ``MegatronDPOTrainer`` or ``MegatronKTOTrainer``, with their own ``forward_step``
(``get_batch``: labels rolled, packed-sequence parameters, the context-parallel split), their
own ``loss_func`` (DPO: Swift's ``dpo_loss``; KTO: TRL's ``kto_loss``) and the schedule
``get_forward_backward_func()`` gives. Only what a trainer builds from a Hugging Face checkpoint
is replaced (its ``__init__``): the trainer holds the audit's tiny GPT (Megatron DDP), a
reference model (the same tiny GPT, other parameters, frozen), an optimizer that keeps the
gradients, and ms-swift's arguments the step reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.ms_swift import batch as sb

__all__ = ["ADAPTED_ROW", "ROWS", "SWIFT_ROW", "audit_trainer", "swift_layout_grads", "swift_args"]

SWIFT_ROW, ADAPTED_ROW = "ms-swift", "ms-swift+lossfix"
ROWS: tuple[str, ...] = (SWIFT_ROW, ADAPTED_ROW)
#: The reference model's parameter seed, beside the policy's ``case.seed``.
REF_SEED_OFFSET = 7

_TRAINERS = {
    "sft": ("swift.megatron.trainers.trainer", "MegatronTrainer"),
    "dpo": ("swift.megatron.trainers.dpo_trainer", "MegatronDPOTrainer"),
    "kto": ("swift.megatron.trainers.kto_trainer", "MegatronKTOTrainer"),
    "rm": ("swift.megatron.trainers.reward_trainer", "MegatronRewardTrainer"),
}


class _KeepGradients:
    """The trainer's optimizer: no update (the audit reads the gradients)."""

    def zero_grad(self) -> None:
        return None

    def step(self) -> tuple[bool, float, None]:
        return True, 0.0, None


class _NoSchedule:
    def step(self, increment: int) -> None:
        return None


def swift_args(setting: sb.Setting, layout: Any, num_microbatches: int, per_rank: int) -> Any:
    """ms-swift's arguments the step reads (its defaults: ``megatron_args.py``, ``rlhf_args.py``;
    ``calculate_per_token_loss`` as ms-swift sets it: on for SFT, off for RLHF)."""
    rlhf = setting.kind != "sft"
    args = dict(
        # A reward model is a sequence classifier with one label (ms-swift's ``seq_cls``).
        task_type="seq_cls" if setting.kind == "rm" else "causal_lm",
        rlhf_type=None if not rlhf else setting.kind,
        padding_free=setting.packed,
        context_parallel_size=layout.cp,
        pipeline_model_parallel_size=layout.pp,
        sequence_parallel=False,
        is_multimodal=False,
        num_microbatches=num_microbatches,
        micro_batch_size=max(1, per_rank // num_microbatches),
        global_batch_size=per_rank * layout.dp,
        seq_length=sb.SEQ_LEN,
        enable_dft_loss=False,
        enable_channel_loss=False,
        tuner_type="full",
        mcore_ref_adapter=None,
        ref_adapters=[],
        calculate_per_token_loss=not rlhf,
        # DPO (rlhf_args.py's defaults)
        beta=0.1,
        rpo_alpha=None,
        loss_type="sigmoid",
        reference_free=False,
        label_smoothing=0.0,
        f_divergence_type="reverse_kl",
        # KTO
        calculate_KL=True,
        desirable_weight=1.0,
        undesirable_weight=1.0,
        # Reward model
        center_rewards_coefficient=None,
        cp_partition_mode="zigzag",
    )
    if setting.kind == "kto":
        args["loss_type"] = "kto"
    args.update(setting.args)
    return SimpleNamespace(**args)


def audit_trainer(kind: str, args: Any, chunks: list, config: Any, ref_chunks: list) -> Any:
    """One of ms-swift's Megatron trainers on the audit's models: ms-swift's methods, unchanged,
    on the fields its training step reads (its ``__init__`` builds a model from a Hugging Face
    checkpoint, which the audit replaces)."""
    import importlib

    from megatron_lossfix.integrations.ms_swift.cpu import (
        gather_scalars_on_gloo,
        provide_transformer_engine,
    )

    provide_transformer_engine()
    gather_scalars_on_gloo()
    module, name = _TRAINERS[kind]
    mod = importlib.import_module(module)
    trainer = getattr(mod, name).__new__(getattr(mod, name))
    trainer.args = args
    trainer.config = config
    trainer.wrapped_models = list(chunks)
    trainer.unwrapped_models = [c.module for c in chunks]
    trainer.ref_models = [c.module for c in ref_chunks]
    trainer.peft_models = []
    trainer.optimizer = _KeepGradients()
    trainer.opt_param_scheduler = _NoSchedule()
    trainer.enable_routing_replay = False
    if kind == "dpo":
        trainer.dummy_dpo_trainer = mod.DummyDPOTrainer(args)
    elif kind == "kto":
        trainer.dummy_kto_trainer = mod.DummyKTOTrainer(args)
    return trainer


def input_tensor_getter(chunk: torch.nn.Module) -> None:
    """The one method ms-swift's trainers call on their model beyond Megatron's ``GPTModel``:
    ``get_input_tensor``, mcore_bridge's own (its ``GPTModel`` subclass), bound to ``chunk``."""
    import functools

    from megatron_lossfix.integrations.ms_swift.cpu import provide_transformer_engine

    provide_transformer_engine()
    from mcore_bridge.model.gpt_model import GPTModel

    chunk.get_input_tensor = functools.partial(GPTModel.get_input_tensor, chunk)


class ValueHead(torch.nn.Module):
    """A reward model's head as mcore-bridge builds it for ``seq_cls`` with one label
    (``OutputLayerLinear``, ``parallel_mode='duplicated'``): ``hidden -> 1`` without bias, the
    whole weight on every tensor-parallel rank; called as Megatron calls its output layer."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, **kwargs: Any) -> tuple:
        return hidden_states @ self.weight.t(), None


def reward_model_hook(chunk: torch.nn.Module) -> None:
    """:func:`input_tensor_getter`, and on the last pipeline stage the value head in place of the
    vocabulary's output layer (a reward model)."""
    input_tensor_getter(chunk)
    if getattr(chunk, "post_process", False):
        chunk.output_layer = ValueHead(chunk.config.hidden_size)


def _switch(row: str, trainer: Any) -> Any:
    """The documented switch of ``row`` (none for ms-swift as released); returns its undo."""
    if row != ADAPTED_ROW:
        return None
    from megatron_lossfix.integrations import ms_swift as adapter

    return adapter.enable()


def runs_on(setting: sb.Setting, layout: Any) -> bool:
    """Whether ms-swift 4.6.0 runs ``setting`` under ``layout`` without Transformer Engine: its
    reward model gathers packed context-parallel shards with Megatron's
    ``_undo_attention_load_balancing``, which needs Transformer Engine >= 1.10 for packed
    sequences (as released and through the adapter alike)."""
    return not (setting.kind == "rm" and setting.packed and layout.cp > 1)


def swift_layout_grads(
    layout: Any,
    case: OracleCase,
    num_microbatches: int,
    rows: Sequence[str] = ROWS,
    settings: Sequence[str] = ("dpo",),
) -> dict[tuple[str, str], dict[str, torch.Tensor]] | None:
    """Every ``(row, setting)`` step under ``layout``; the full gradients on global rank 0."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit import tiny_gpt

    tiny_gpt.init_layout(layout)
    built: dict[tuple, tuple] = {}

    def models(per_token: bool, reward: bool = False) -> tuple:
        """The policy and reference chunks as ms-swift builds them for ``per_token``
        (``calculate_per_token_loss``: Megatron DDP scales the gradients by it when built),
        with a value head for a ``reward`` model."""
        key = (per_token, reward)
        if key not in built:
            getter = reward_model_hook if reward else input_tensor_getter
            hook = dict(model_hook=getter, calculate_per_token_loss=per_token)
            chunks, config = tiny_gpt.case_tiny_gpt(layout, case, **hook)
            ref_chunks, _ = tiny_gpt.case_tiny_gpt(layout, case, **hook)
            tiny_gpt.set_deterministic_params(ref_chunks, case.seed + REF_SEED_OFFSET)
            for chunk in ref_chunks:
                chunk.requires_grad_(False)
            built[key] = chunks, config, ref_chunks
        return built[key]

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    out = {}
    for name in settings:
        setting = sb.SETTINGS[name]
        if not runs_on(setting, layout):
            continue
        chunks, config, ref_chunks = models(setting.kind == "sft", setting.kind == "rm")
        units = sb.step_units(case, config.vocab_size, setting.kind)
        per_rank = len(units) // dp
        args = swift_args(setting, layout, num_microbatches, per_rank)
        trainer = audit_trainer(setting.kind, args, chunks, config, ref_chunks)
        for row in rows:
            mbs = sb.micro_batches(units, setting.kind, setting.packed, dp_rank, dp,
                                   num_microbatches)  # fmt: skip
            tiny_gpt.set_deterministic_params(chunks, case.seed)
            undo = _switch(row, trainer)
            try:
                trainer.train_step(iter(mbs))
            finally:
                if undo is not None:
                    undo()
            out[(row, name)] = tiny_gpt.gather_full_grads(chunks)
    return out if torch.distributed.get_rank() == 0 else None
