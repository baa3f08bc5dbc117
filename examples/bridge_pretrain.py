"""SFT of a tiny GPT through Megatron Bridge's own training loop (``pretrain()``), with exact,
layout-invariant loss normalization (megatron_lossfix). Runs on CPU (gloo) when no GPU is present.

Bridge's loop, model provider (``GPTModelProvider``, local layer spec), data loader, optimizer and
logging; the plugin enters with two lines: ``enable_bridge(config)`` and ``lossfix_forward_step``
as the forward step. The data are byte-level {"prompt", "response"} / {"text"} records (the
embedded corpus by default) whose loss masks vary from sequence to sequence. Bridge logs its
``lm loss`` every iteration; --metrics-out appends one JSON object per iteration (rank 0).

Launch (two layouts of the same step; their loss and grad norm agree to ~1e-7):
    torchrun --standalone --nproc-per-node 1 examples/bridge_pretrain.py \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --metrics-out out/a.jsonl
    torchrun --standalone --nproc-per-node 2 examples/bridge_pretrain.py \
        --micro-batch-size 1 --global-batch-size 8 --train-iters 3 --metrics-out out/b.jsonl
Add --loss-reduction off to see stock Bridge disagree with itself.

LoRA through Bridge's own PEFT (``megatron.bridge.peft.lora.LoRA``, base frozen; the reported
grad norm is the adapters'), from a model saved by a first run (``ConfigContainer.peft``, which
Bridge allows only with a saved model), or without --pretrained-checkpoint on the seeded base:
    torchrun --standalone --nproc-per-node 1 examples/bridge_pretrain.py \
        --micro-batch-size 8 --global-batch-size 8 --train-iters 1 --save out/base
    torchrun --standalone --nproc-per-node 2 examples/bridge_pretrain.py --micro-batch-size 1 \
        --global-batch-size 8 --train-iters 3 --lora-rank 4 --pretrained-checkpoint out/base
MoE: --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-aux-loss-coeff C
(the aux loss stays stock Megatron's). Needs megatron-bridge (`python -m megatron_lossfix
install-bridge` installs it, also where its full install cannot build).
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
from usage import ExampleArgumentParser

from megatron_lossfix.args import (
    add_lossfix_args,
    from_args,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from megatron_lossfix.integrations.cpu_megatron_bridge import enable_cpu_bridge

PROG = "bridge_pretrain.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ExampleArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=positive_int, default=4, help="transformer layers")
    model.add_argument("--hidden-size", type=positive_int, default=64, help="hidden size")
    model.add_argument(
        "--num-attention-heads", type=positive_int, default=4, help="attention heads"
    )
    model.add_argument("--seq-length", type=positive_int, default=128, help="tokens per sequence")
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=positive_int, default=1, help="TP size")
    par.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1, help="PP size")
    par.add_argument(
        "--expert-model-parallel-size",
        type=positive_int,
        default=1,
        help="EP size: the experts are split over this many data-parallel ranks",
    )
    moe = parser.add_argument_group("mixture of experts (Megatron-Core's MoE layer)")
    moe.add_argument(
        "--num-experts",
        type=positive_int,
        default=None,
        help="experts per MoE layer (every layer); default: dense MLPs",
    )
    moe.add_argument(
        "--moe-router-topk", type=positive_int, default=2, help="experts each token is routed to"
    )
    moe.add_argument(
        "--moe-aux-loss-coeff",
        type=non_negative_float,
        default=0.0,
        help="load-balancing loss coefficient; the aux loss and its gradient stay stock "
        "Megatron's (not renormalized by the plugin)",
    )
    lora = parser.add_argument_group("LoRA (Megatron Bridge's own PEFT)")
    lora.add_argument(
        "--lora-rank",
        type=positive_int,
        default=None,
        help="fine-tune with Bridge's LoRA of this rank on every linear layer (attention and "
        "MLP), base weights frozen: the --pretrained-checkpoint model's, else the seeded base",
    )
    lora.add_argument(
        "--lora-alpha",
        type=positive_int,
        default=None,
        help="LoRA scaling numerator (the adapter output is scaled by alpha / rank); "
        "default: the rank",
    )
    lora.add_argument(
        "--pretrained-checkpoint",
        default=None,
        help="Bridge checkpoint directory whose weights the LoRA run starts from (e.g. one "
        "written by --save); LoRA then goes through Bridge's ConfigContainer.peft",
    )
    train = parser.add_argument_group("training")
    train.add_argument(
        "--micro-batch-size", type=positive_int, default=2, help="sequences per micro-batch"
    )
    train.add_argument(
        "--global-batch-size", type=positive_int, default=8, help="sequences per step"
    )
    train.add_argument("--train-iters", type=positive_int, default=20, help="optimizer steps")
    train.add_argument(
        "--lr", type=non_negative_float, default=3e-3, help="Adam learning rate (constant)"
    )
    train.add_argument(
        "--seed", type=non_negative_int, default=1234, help="seed of data order and weights"
    )
    train.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron's per-token mode: the gradient is divided by the global token count "
        "in finalize_model_grads (the plugin feeds it exactly)",
    )
    output = parser.add_argument_group("data and output")
    output.add_argument(
        "--data-path",
        default=None,
        help='JSONL of {"prompt", "response"} or {"text"} records; default: embedded corpus',
    )
    output.add_argument(
        "--metrics-out", default=None, help="append one JSON object per iteration (rank 0)"
    )
    output.add_argument(
        "--save",
        default=None,
        help="write a Bridge (torch_dist) checkpoint into this directory after the last step "
        "(e.g. the base a LoRA run starts from)",
    )
    add_lossfix_args(parser)
    parser.set_defaults(loss_reduction="token_mean")
    args = parser.parse_args(argv)
    if args.lora_rank is None and (args.lora_alpha or args.pretrained_checkpoint):
        parser.error("--lora-alpha and --pretrained-checkpoint need --lora-rank")
    if args.num_experts is None and args.expert_model_parallel_size > 1:
        parser.error("--expert-model-parallel-size needs --num-experts")
    if args.num_experts is not None and args.num_experts % args.expert_model_parallel_size:
        parser.error("--num-experts must be a multiple of --expert-model-parallel-size")
    if args.lossfix_self_check:
        parser.error("--lossfix-self-check is not wired into Bridge's loop; drop it")
    try:  # the plugin's own refusals, before start-up like the others
        from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


# ---------------------------------------------------------------------------------- data
class ContractOrderDataset(torch.utils.data.Dataset):
    """Samples in the order Bridge's sampler hands them out, arranged so that the global batch
    of iteration i is ``global_batch(records, i, ...)`` with DP rank r taking its r-th contiguous
    slice and micro-batches contiguous slices of that (the examples' data contract).

    Bridge's ``MegatronPretrainingSampler`` gives DP rank d, at micro-step k of iteration i,
    samples ``i*G + k*(m*D) + d*m + p`` (p < m): this dataset stores there sample
    ``d*(G/D) + k*m + p`` of the iteration's global batch.
    """

    def __init__(
        self,
        records: list[dict],
        *,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int,
        seq_length: int,
        seed: int,
    ) -> None:
        self.records = records
        self.num_samples = num_samples
        self.gbs, self.mbs, self.dp = global_batch_size, micro_batch_size, dp_size
        self.seq_length, self.seed = seq_length, seed
        self.tokenizer = ByteTokenizer()
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        iteration, offset = divmod(index, self.gbs)
        step, within = divmod(offset, self.mbs * self.dp)
        dp_rank, p = divmod(within, self.mbs)
        position = dp_rank * (self.gbs // self.dp) + step * self.mbs + p
        if self._cached is None or self._cached[0] != iteration:
            batch = global_batch(
                self.records,
                iteration,
                global_batch_size=self.gbs,
                seq_length=self.seq_length,
                seed=self.seed,
                tokenizer=self.tokenizer,
            )
            self._cached = (iteration, batch)
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
                load_records(self.data_path),
                num_samples=context.train_samples,
                global_batch_size=self.global_batch_size,
                micro_batch_size=self.micro_batch_size,
                dp_size=context.pg_collection.dp.size(),
                seq_length=self.seq_length,
                seed=self.seed,
            )
            return train, None, None

    return MaskedRecords(
        data_path=args.data_path,
        seq_length=args.seq_length,
        seed=args.seed,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        dataloader_type="single",
        num_workers=0,
        persistent_workers=False,
        pin_memory=torch.cuda.is_available(),
    )


# ---------------------------------------------------------------------------------- config
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

    return ConfigContainer(
        model=_model_provider(args, built),
        train=TrainingConfig(
            train_iters=args.train_iters,
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
        ),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.lr,
            weight_decay=0.0,
            clip_grad=1.0,
            bf16=False,
            fp16=False,
            use_distributed_optimizer=False,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="constant",
            lr_warmup_iters=0,
            start_weight_decay=0.0,
            end_weight_decay=0.0,
        ),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=False, overlap_grad_reduce=False, grad_reduce_in_fp32=True
        ),
        dataset=_dataset_config(args),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(
            tokenizer_type="NullTokenizer", vocab_size=ByteTokenizer().vocab_size
        ),
        checkpoint=CheckpointConfig(
            save=args.save,
            save_interval=args.train_iters if args.save else None,
            pretrained_checkpoint=args.pretrained_checkpoint,
            ckpt_format="torch_dist",
        ),
        # Bridge's own PEFT path requires a saved model; without one the model provider applies
        # the same LoRA to the seeded base (_model_provider).
        peft=_lora(args) if args.pretrained_checkpoint else None,
        dist=DistributedInitConfig(
            distributed_backend="nccl" if torch.cuda.is_available() else "gloo"
        ),
        rng=RNGConfig(seed=args.seed),
    )


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
    from megatron_lossfix.audit.training import set_deterministic_params

    def hook(chunks: list) -> list:
        set_deterministic_params(chunks, seed)
        return chunks

    return hook


def _is_adapter(name: str) -> bool:
    return ".adapter." in f".{name}"


def _deterministic_adapters(seed: int, built: list) -> Any:
    from megatron_lossfix.audit.seeded_params import set_deterministic_params

    def hook(chunks: list) -> list:
        set_deterministic_params(chunks, seed, only=_is_adapter)
        built.extend(chunks)
        return chunks

    return hook


def report_lora_grads(chunks: list) -> str:
    """One line naming, on this rank, the parameters whose gradient of the last step is nonzero:
    LoRA adapters only when the base is frozen (Megatron's DDP gives frozen parameters no
    gradient buffer)."""
    from megatron_lossfix.audit.seeded_params import unwrap

    adapters, base = 0, []
    for chunk in chunks:
        for name, param in unwrap(chunk).named_parameters():
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


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Before anything imports Megatron (it probes optional packages at import time).
    enable_cpu_bridge()
    from megatron.bridge.training.pretrain import pretrain

    from megatron_lossfix.integrations.bridge import enable_bridge, lossfix_forward_step

    config = from_args(args)
    if not torch.cuda.is_available():
        # On a shared CPU, one thread per rank beats spinning OMP workers.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    enable_bridge(config, metrics_out=args.metrics_out)
    if dist.is_initialized() is False and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"megatron_lossfix: Megatron Bridge pretrain, reduction={config.reduction} "
            f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
            f"world={os.environ.get('WORLD_SIZE', '1')}",
            flush=True,
        )
    built: list = []
    pretrain(build_config(args, built), lossfix_forward_step)
    if args.lora_rank is not None:
        print(report_lora_grads(built), flush=True)


if __name__ == "__main__":
    main()
