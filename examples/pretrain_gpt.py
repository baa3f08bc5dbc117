"""SFT / pretraining of a small GPT on Megatron-Core with exact, layout-invariant loss
normalization (megatron_lossfix). Runs on CPU (gloo) when no GPU is present, NCCL otherwise.

Per-token cross entropy (GPTModel's vocab-parallel loss) on byte-level tokens; the loss counts
only response bytes of {"prompt", "response"} records, every byte of {"text"} records. Without
--data-path it trains on the embedded default corpus. Each iteration logs one line like
Megatron-LM and, with --metrics-out, appends one JSON object (rank 0).

Launch (two layouts of the same step; their loss and grad norm agree to ~1e-7):
    torchrun --standalone --nproc-per-node 1 examples/pretrain_gpt.py \
        --micro-batch-size 12 --global-batch-size 12 --train-iters 3 --metrics-out /tmp/a.jsonl
    torchrun --standalone --nproc-per-node 2 examples/pretrain_gpt.py \
        --micro-batch-size 2 --global-batch-size 12 --train-iters 3 --metrics-out /tmp/b.jsonl
Add --loss-reduction off to see stock Megatron disagree with itself.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron_lossfix import LossFixConfig, LossFixSchedule, weighted_loss
from megatron_lossfix.args import add_lossfix_args, from_args
from megatron_lossfix.cpu_compat import enable_cpu_megatron
from megatron_lossfix.datasets import ByteTokenizer, global_batch, load_records, microbatches
from megatron_lossfix.testing.tiny_gpt import (
    Layout,
    build_tiny_gpt,
    init_layout,
    set_deterministic_params,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    model.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    model.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    model.add_argument("--seq-length", type=int, default=128, help="tokens per sequence")
    model.add_argument("--num-experts", type=int, default=None, help="MoE experts per layer")
    model.add_argument(
        "--moe-aux-loss-coeff", type=float, default=0.0, help="MoE load-balancing loss weight"
    )
    model.add_argument(
        "--no-attention",
        action="store_true",
        help="replace self-attention by identity (layers mix nothing across tokens): only for "
        "testing context parallelism on CPU where Transformer Engine is absent",
    )
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size")
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size")
    par.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per virtual stage (interleaved 1F1B schedule)",
    )
    par.add_argument("--context-parallel-size", type=int, default=1, help="CP size")
    par.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP size")
    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    train.add_argument("--global-batch-size", type=int, default=16, help="sequences per step")
    train.add_argument("--train-iters", type=int, default=200, help="optimizer steps")
    train.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    train.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping norm")
    train.add_argument("--seed", type=int, default=1234, help="seed of data order and weights")
    train.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron's per-token mode: the gradient is divided by the global token count "
        "in finalize_model_grads (the plugin feeds it exactly)",
    )
    data = parser.add_argument_group("data and output")
    data.add_argument(
        "--data-path",
        default=None,
        help='JSONL of {"prompt", "response"} or {"text"} records; default: embedded corpus',
    )
    data.add_argument(
        "--metrics-out", default=None, help="append one JSON object per iteration (rank 0)"
    )
    data.add_argument("--log-interval", type=int, default=1, help="iterations between logs")
    add_lossfix_args(parser)
    parser.set_defaults(loss_reduction="token_mean")
    return parser.parse_args(argv)


def forward_step(cp_slice: bool, data_iterator, model):
    """Megatron forward_step: whole sequences come in; with CP each rank keeps its shard (and
    the weights' shard, which get_batch_on_this_cp_rank slices along)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = next(data_iterator)
    if cp_slice:
        batch = get_batch_on_this_cp_rank(dict(batch))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(weighted_loss, batch.get("loss_weights"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = from_args(args) or LossFixConfig(reduction="token_mean")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    enable_cpu_megatron()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    vpp = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
    layout = Layout(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        vpp=vpp,
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
    )
    init_layout(layout)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if args.global_batch_size % (dp * args.micro_batch_size):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be divisible by data-parallel "
            f"size {dp} x --micro-batch-size {args.micro_batch_size}"
        )
    tokenizer = ByteTokenizer()
    chunks, model_config = build_tiny_gpt(
        layout,
        num_layers=args.num_layers,
        hidden=args.hidden_size,
        heads=args.num_attention_heads,
        vocab=tokenizer.padded_vocab_size(8),
        seq_len=args.seq_length,
        num_experts=args.num_experts,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        no_attention=args.no_attention,
        calculate_per_token_loss=args.calculate_per_token_loss,
    )
    # Same global weights under every layout, so that runs can be compared step by step.
    set_deterministic_params(chunks, args.seed)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=args.clip_grad, weight_decay=0.0),
        chunks,
    )
    schedule = LossFixSchedule(config)
    records = load_records(args.data_path)
    cp_slice = args.context_parallel_size > 1
    rank0 = dist.get_rank() == 0
    out = open(args.metrics_out, "w") if (args.metrics_out and rank0) else None
    if rank0:
        print(
            f"megatron_lossfix: reduction={config.reduction} TP={layout.tp} PP={layout.pp} "
            f"VPP={vpp} CP={layout.cp} EP={layout.ep} DP={dp} micro-batches/rank="
            f"{args.global_batch_size // (dp * args.micro_batch_size)} "
            f"records={len(records)} backend={backend}",
            flush=True,
        )
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        batch = global_batch(
            records,
            iteration - 1,
            global_batch_size=args.global_batch_size,
            seq_length=args.seq_length,
            seed=args.seed,
            tokenizer=tokenizer,
        )
        mbs = microbatches(
            batch, dp_rank=dp_rank, dp_size=dp, micro_batch_size=args.micro_batch_size
        )
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        iterators = [iter(mbs) for _ in chunks]
        schedule(
            forward_step_func=partial(forward_step, cp_slice),
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(mbs),
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        metrics = schedule.step_metrics()
        step_time = time.perf_counter() - start
        record = {
            "iteration": iteration,
            "loss": metrics["loss"],
            "grad_norm": float(grad_norm),
            "num_tokens": int(metrics["num_tokens"]),
            "num_sequences": int(metrics["num_sequences"]),
            "step_time_s": step_time,
            "reduction": config.reduction,
        }
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()
        if rank0 and iteration % args.log_interval == 0:
            print(
                f" iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {iteration * args.global_batch_size:10d} |"
                f" elapsed time per iteration (ms): {1000 * step_time:.1f} |"
                f" learning rate: {args.lr:.3E} | global batch size: {args.global_batch_size:5d} |"
                f" lm loss: {metrics['loss']:.6E} | grad norm: {float(grad_norm):.6E} |"
                f" num tokens: {int(metrics['num_tokens'])} |",
                flush=True,
            )
    if out is not None:
        out.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
