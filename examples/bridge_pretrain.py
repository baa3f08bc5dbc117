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
import os

import torch
import torch.distributed as dist
from bridge_config import build_config, report_lora_grads
from usage import ExampleArgumentParser

from megatron_lossfix.args import (
    add_lossfix_args,
    from_args,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from megatron_lossfix.integrations.bridge.cpu import enable_cpu_bridge

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
    add_lossfix_args(parser, default_reduction="token_mean")
    args = parser.parse_args(argv)
    if args.lora_rank is None and (args.lora_alpha or args.pretrained_checkpoint):
        parser.error("--lora-alpha and --pretrained-checkpoint need --lora-rank")
    if args.num_experts is None and args.expert_model_parallel_size > 1:
        parser.error("--expert-model-parallel-size needs --num-experts")
    if args.num_experts is not None and args.num_experts % args.expert_model_parallel_size:
        parser.error("--num-experts must be a multiple of --expert-model-parallel-size")
    try:  # the plugin's own refusals, before start-up like the others
        from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


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
