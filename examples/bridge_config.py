"""Megatron Bridge's configuration for ``bridge_pretrain.py``: the ``ConfigContainer`` of a tiny
fp32 GPT (Bridge's ``GPTModelProvider`` with the local layer spec), the data in the order the
examples promise, Bridge's own LoRA, and the same starting weights under every layout.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from byte_data import ByteTokenizer, global_batch, load_records
from gpt_model import seed_weights

__all__ = ["ContractOrderDataset", "build_config", "report_lora_grads"]


class ContractOrderDataset(torch.utils.data.Dataset):
    """The examples' data contract in Bridge's sample order: the global batch of iteration i is
    ``global_batch(records, i, ...)``, DP rank r takes its r-th contiguous slice, micro-batches
    are contiguous slices of that. Bridge's ``MegatronPretrainingSampler`` gives DP rank d, at
    micro-step k of iteration i, samples ``i*G + k*(m*D) + d*m + p`` (p < m): this dataset
    stores there sample ``d*(G/D) + k*m + p`` of the iteration's global batch."""

    def __init__(self, records: list[dict], *, num_samples: int, global_batch_size: int,
                 micro_batch_size: int, dp_size: int, seq_length: int, seed: int):  # fmt: skip
        self.records, self.num_samples = records, num_samples
        self.gbs, self.mbs, self.dp = global_batch_size, micro_batch_size, dp_size
        self.data = dict(global_batch_size=global_batch_size, seq_length=seq_length, seed=seed,
                         tokenizer=ByteTokenizer())  # fmt: skip
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        iteration, offset = divmod(index, self.gbs)
        step, within = divmod(offset, self.mbs * self.dp)
        dp_rank, p = divmod(within, self.mbs)
        position = dp_rank * (self.gbs // self.dp) + step * self.mbs + p
        if self._cached is None or self._cached[0] != iteration:
            self._cached = (iteration, global_batch(self.records, iteration, **self.data))
        # Without the group ids: Bridge's collation would lose the step's group count that the
        # group modes need (they refuse here, in one line).
        batch = self._cached[1]
        return {key: value[position] for key, value in batch.items() if key != "group_ids"}


def _dataset_config(args: argparse.Namespace) -> Any:
    from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider

    @dataclass(kw_only=True)
    class MaskedRecords(DatasetProvider):
        """Byte-level records with per-sequence loss masks (Bridge's custom dataset contract)."""

        data_path: str | None = None
        seq_length: int = 128
        seed: int = 1234
        global_batch_size: int = 8
        micro_batch_size: int = 2

        def build_datasets(self, context: DatasetBuildContext) -> tuple:
            train = ContractOrderDataset(
                load_records(self.data_path), num_samples=context.train_samples,
                global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size,
                dp_size=context.pg_collection.dp.size(), seq_length=self.seq_length, seed=self.seed,
            )  # fmt: skip
            return train, None, None

    return MaskedRecords(
        data_path=args.data_path, seq_length=args.seq_length, seed=args.seed,
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        dataloader_type="single", num_workers=0, persistent_workers=False,
        pin_memory=torch.cuda.is_available(),
    )  # fmt: skip


def build_config(args: argparse.Namespace, built: list | None = None) -> Any:
    """Bridge's ConfigContainer for a tiny fp32 GPT (dropout 0, constant learning rate).
    With LoRA, the wrapped model chunks are appended to ``built`` once Bridge has made them."""
    built = [] if built is None else built
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        LoggerConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    vocab_size = ByteTokenizer().vocab_size  # Bridge pads it, as Megatron-LM does
    # fmt: off
    return ConfigContainer(
        model=_model_provider(args, built),
        train=TrainingConfig(train_iters=args.train_iters, micro_batch_size=args.micro_batch_size,
                             global_batch_size=args.global_batch_size),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr, weight_decay=0.0,
                                  clip_grad=1.0, bf16=False, fp16=False,
                                  use_distributed_optimizer=False),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0,
                                  start_weight_decay=0.0, end_weight_decay=0.0),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=False, overlap_grad_reduce=False, grad_reduce_in_fp32=True
        ),
        dataset=_dataset_config(args),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab_size),
        checkpoint=CheckpointConfig(save=args.save, ckpt_format="torch_dist",
                                    save_interval=args.train_iters if args.save else None,
                                    pretrained_checkpoint=args.pretrained_checkpoint),
        # Bridge's own PEFT path requires a saved model; without one the model provider applies
        # the same LoRA to the seeded base (_model_provider).
        peft=_lora(args) if args.pretrained_checkpoint else None,
        dist=DistributedInitConfig(distributed_backend=backend),
        rng=RNGConfig(seed=args.seed),
    )
    # fmt: on


def _model_provider(args: argparse.Namespace, built: list) -> Any:
    """Bridge's GPTModelProvider: local layers, fp32, no dropout and no fused kernels, so the
    run is the same on CPU and GPU."""
    from megatron.bridge.models import GPTModelProvider
    from megatron.bridge.models.gpt_provider import local_layer_spec

    model = GPTModelProvider(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=4 * args.hidden_size,
        seq_length=args.seq_length,
        vocab_size=ByteTokenizer().padded_vocab_size(8),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # Transformer Engine's spec is Bridge's default; the local one runs anywhere.
        transformer_layer_spec=local_layer_spec,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        use_cpu_initialization=True,
        calculate_per_token_loss=args.calculate_per_token_loss,
        **_moe_fields(args),
    )
    # The same global weights under every layout (Bridge seeds each pipeline stage differently).
    model.register_pre_wrap_hook(_deterministic_weights(args.seed))
    if args.lora_rank is not None and args.pretrained_checkpoint is None:
        model.register_pre_wrap_hook(_lora(args))  # Bridge's PEFT call: freeze, add adapters
    if args.lora_rank is not None:
        # Bridge's PEFT hook (registered at setup, after ours) loads the base and adds adapters
        # initialized per rank; seed them like the base, once the model is built.
        model.register_post_wrap_hook(_deterministic_adapters(args.seed, built))
    return model


def _moe_fields(args: argparse.Namespace) -> dict[str, Any]:
    if args.num_experts is None:
        return {}
    return {
        "num_moe_experts": args.num_experts,
        "moe_router_topk": args.moe_router_topk,
        "moe_ffn_hidden_size": 4 * args.hidden_size,
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "moe_aux_loss_coeff": args.moe_aux_loss_coeff,
        "moe_router_load_balancing_type": "aux_loss",
        # Megatron's alltoall dispatcher passes tensor split sizes that gloo refuses.
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        # Megatron's SequentialMLP adds the expert bias in place into a custom Function's output,
        # which autograd refuses: MoE models run without linear biases.
        "add_bias_linear": False,
    }


def _lora(args: argparse.Namespace) -> Any:
    if args.lora_rank is None:
        return None
    from megatron.bridge.peft.lora import LoRA

    return LoRA(
        target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        dim=args.lora_rank,
        alpha=args.lora_alpha or args.lora_rank,
        dropout=0.0,
    )


def _deterministic_weights(seed: int) -> Any:
    def hook(chunks: list) -> list:
        seed_weights(chunks, seed)
        return chunks

    return hook


def _is_adapter(name: str) -> bool:
    return ".adapter." in f".{name}"


def _deterministic_adapters(seed: int, built: list) -> Any:
    def hook(chunks: list) -> list:
        seed_weights(chunks, seed, only=_is_adapter)
        built.extend(chunks)
        return chunks

    return hook


def report_lora_grads(chunks: list) -> str:
    """One line naming, on this rank, the parameters whose gradient of the last step is nonzero:
    LoRA adapters only when the base is frozen (Megatron's DDP gives frozen parameters no
    gradient buffer)."""
    adapters, base = 0, []
    for chunk in chunks:
        while hasattr(chunk, "module"):  # DDP, Float16Module
            chunk = chunk.module
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is None or not bool(grad.abs().sum() > 0):
                continue
            if _is_adapter(name):
                adapters += 1
            else:
                base.append(name)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return f"lora grads: rank {rank}: adapters {adapters}, base {json.dumps(base)}"
