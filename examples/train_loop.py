"""One training run of the example scripts: the training flags, start-up, the optimizer step
through the plugin's schedule, and one metrics record and log line per iteration.

``pretrain_gpt.py`` and ``grpo_gpt.py`` differ only in their data and their loss; the rest is
here, so a layout behaves the same way in either. The metrics record holds the fields the
examples promise (``iteration, loss, grad_norm, num_tokens, num_sequences, step_time_s``, with
MTP layers ``mtp_loss_<j>``; ``num_groups`` in the modes over group ids), then what the script
adds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from gpt_model import build_model, virtual_stages
from usage import exit_before_startup

import megatron_lossfix as lossfix
from megatron_lossfix.args import non_negative_float, non_negative_int, positive_int

__all__ = ["Run", "add_training_args", "check_before_start", "stock_reported"]


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's training and output flags, and the plugin's (``token_mean`` by default)."""
    # fmt: off
    train = parser.add_argument_group("training").add_argument
    train("--micro-batch-size", type=positive_int, default=4, help="sequences per micro-batch")
    train("--global-batch-size", type=positive_int, default=16, help="sequences per step")
    train("--train-iters", type=positive_int, default=200, help="optimizer steps")
    train("--lr", type=non_negative_float, default=3e-3, help="Adam learning rate")
    train("--clip-grad", type=non_negative_float, default=1.0, help="gradient clipping norm")
    train("--seed", type=non_negative_int, default=1234, help="seed of data order and weights")
    out = parser.add_argument_group("output").add_argument
    out("--metrics-out", default=None, help="write one JSON object per iteration to this file "
        "(rank 0; its folder is created)")
    out("--log-interval", type=positive_int, default=1, help="iterations between log lines")
    # fmt: on
    lossfix.add_lossfix_args(parser, default_reduction="token_mean")


def check_before_start(prog: str, args: argparse.Namespace) -> None:
    """What the scripts themselves rely on, refused in one line before start-up: the plugin's
    flags, the global batch against DP x micro-batch (DP rank r takes the r-th contiguous slice),
    MTP under PP without rope (a wrong gradient, not an error, in Megatron), ``--metrics-out``."""
    try:
        lossfix.schedule_from_args(args)
    except ValueError as exc:
        exit_before_startup(prog, str(exc))
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    step = max(ranks // model_parallel, 1) * args.micro_batch_size
    if args.global_batch_size % step:
        exit_before_startup(
            prog,
            f"--global-batch-size {args.global_batch_size} is not divisible by data-parallel "
            f"size {ranks // model_parallel or 1} x --micro-batch-size {args.micro_batch_size}",
        )
    if args.mtp_num_layers and args.pipeline_model_parallel_size > 1:
        if args.position_embedding_type != "rope":
            exit_before_startup(
                prog,
                "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs "
                "--position-embedding-type rope (Megatron does not sum the gradient of the "
                "last stage's copy of the position embedding)",
            )
    if args.metrics_out:
        if os.path.isdir(args.metrics_out):
            exit_before_startup(prog, f"--metrics-out {args.metrics_out} is a folder; name a file")
        try:
            os.makedirs(os.path.dirname(args.metrics_out) or ".", exist_ok=True)
        except OSError as exc:
            exit_before_startup(prog, f"--metrics-out {args.metrics_out}: {exc.strerror}")


def stock_reported(batch: dict, loss_func: Callable) -> Callable:
    """``loss_func``; under ``off`` (no weights in ``batch``: the plugin does not touch the
    step) one whose report also carries what logging stock Megatron's loss needs."""
    return loss_func if "loss_weights" in batch else functools.partial(_stock_report, loss_func)


def _stock_report(loss_func: Callable, output: torch.Tensor) -> tuple:
    loss, num_tokens, report = loss_func(output)
    # Copies: Megatron scales the returned loss in place after this call.
    total, n = loss.detach().double(), num_tokens.detach().double()
    stock = {
        "stock_mean_sum": total / n.clamp(min=1),  # this micro-batch's token mean
        "stock_mean_count": torch.ones_like(n),
        "stock_token_sum": total,
        "num_tokens_sum": n,
    }
    return loss, num_tokens, {**report, **stock}


def _to(value: Any, device: torch.device) -> Any:
    """A micro-batch entry on ``device`` (an int, such as ``num_groups``, stays as it is)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


class Run:
    """Process groups, model chunks, Adam and the plugin's schedule of one run (every rank)."""

    def __init__(self, args: argparse.Namespace, vocab_size: int, *, per_token_loss: bool = False):
        self.args = args
        self.schedule = lossfix.schedule_from_args(args)  # replaces get_forward_backward_func()
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        lossfix.enable_cpu_megatron()  # a no-op where CUDA is available
        # Ranks of one machine share its cores; an explicit OMP_NUM_THREADS wins.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        share = max(1, (os.cpu_count() or 1) // dist.get_world_size())
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) else share)
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_stages(args),
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
        )
        # Megatron's layers draw from its tracked RNG states; without them it fails.
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.cp_group = ps.get_context_parallel_group() if args.context_parallel_size > 1 else None
        self.chunks, self.model_config = build_model(
            args, vocab_size, per_token_loss=per_token_loss
        )
        optimizer = OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=args.clip_grad)
        self.optimizer = get_megatron_optimizer(optimizer, self.chunks)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.rank0 = dist.get_rank() == 0
        self._out = open(args.metrics_out, "w") if args.metrics_out and self.rank0 else None

    def banner(self, **extra: Any) -> None:
        """The run's layout, once (rank 0)."""
        a = self.args
        items = " ".join(f"{key}={value}" for key, value in extra.items())
        per_rank = a.global_batch_size // self.dp // a.micro_batch_size
        if self.rank0:
            print(
                f"megatron_lossfix: reduction={self.schedule.config.reduction} "
                f"TP={a.tensor_model_parallel_size} PP={a.pipeline_model_parallel_size} "
                f"CP={a.context_parallel_size} EP={a.expert_model_parallel_size} DP={self.dp} "
                f"micro-batches/rank={per_rank} {items}",
                flush=True,
            )

    def step(self, forward_step: Callable, microbatches: Sequence[dict]) -> tuple[float, dict]:
        """One optimizer step over this rank's micro-batches: the grad norm (before clipping,
        over all shards) and the step's global metrics. A refused step ends the run (exit 1)."""
        # An int entry (the step's ``num_groups``) stays as it is.
        mbs = [{k: _to(v, self.device) for k, v in mb.items()} for mb in microbatches]
        for chunk in self.chunks:  # as Megatron-LM: DDP's buffers, then the optimizer's
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        try:
            self.schedule(
                forward_step_func=forward_step,
                # Every model chunk (virtual pipeline stage) reads all the micro-batches.
                data_iterator=[iter(mbs) for _ in self.chunks]
                if len(self.chunks) > 1
                else iter(mbs),
                model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                num_microbatches=len(mbs),
                seq_length=self.args.seq_length,
                micro_batch_size=self.args.micro_batch_size,
                forward_only=False,
            )
        except (lossfix.StepRefused, lossfix.SelfCheckError) as exc:
            # On every rank together; a refusal says on each rank why, a failed self-check once.
            if self.rank0 or isinstance(exc, lossfix.StepRefused):
                print(f"rank {dist.get_rank()}: {exc}\n", end="", file=sys.stderr, flush=True)
            dist.barrier()
            raise SystemExit(1) from None
        _, grad_norm, _ = self.optimizer.step()
        metrics = self.schedule.step_metrics()
        if self.schedule.config.reduction == "off":
            # Stock Megatron's loss: the mean of per-micro-batch token means (or, per-token,
            # the step's token mean), from the reports of stock_reported.
            mean, count = metrics.pop("stock_mean_sum"), metrics.pop("stock_mean_count")
            total, tokens = metrics.pop("stock_token_sum"), metrics.pop("num_tokens_sum")
            per_token = self.model_config.calculate_per_token_loss
            metrics.update(loss=total / max(tokens, 1.0) if per_token else mean / count)
            metrics.update(num_tokens=tokens)
        return float(grad_norm), metrics

    def report(self, iteration: int, seconds: float, grad_norm: float, metrics: dict, *,
               loss_name: str = "lm loss", record: dict | None = None,
               log_items: Sequence[tuple[str, str]] = ()) -> None:  # fmt: skip
        """The iteration's metrics record and a Megatron-LM style log line (rank 0); the line
        ends with ``log_items`` as ``label: value`` pairs."""
        if not self.rank0:
            return
        a = self.args
        line = {
            "iteration": iteration,
            "loss": metrics["loss"],
            "grad_norm": grad_norm,
            "num_tokens": int(metrics["num_tokens"]),
            "num_sequences": int(metrics["num_sequences"]) if "num_sequences" in metrics else None,
            # Modes over group ids: the groups (trajectories) with a loss token.
            **({"num_groups": int(metrics["num_groups"])} if "num_groups" in metrics else {}),
            "step_time_s": seconds,
            "reduction": self.schedule.config.reduction,
            **{k: v for k, v in metrics.items() if k.startswith("mtp_loss_")},
            **(record or {}),
        }
        if self._out is not None:
            self._out.write(json.dumps(line) + "\n")
            self._out.flush()
        if iteration % a.log_interval and iteration != 1:
            return
        mtp = [(f"mtp_{k[9:]} loss", f"{v:.6E}") for k, v in line.items() if "mtp_loss_" in k]
        extra = "".join(f" {label}: {value} |" for label, value in (*mtp, *log_items))
        print(
            f" iteration {iteration:8d}/{a.train_iters:8d} |"
            f" consumed samples: {iteration * a.global_batch_size:10d} |"
            f" elapsed time per iteration (ms): {1000 * seconds:.1f} |"
            f" learning rate: {a.lr:.3E} | global batch size: {a.global_batch_size:5d} |"
            f" {loss_name}: {metrics['loss']:.6E} | grad norm: {grad_norm:.6E} |"
            f" num tokens: {int(metrics['num_tokens'])} |{extra}",
            flush=True,
        )

    def finish(self) -> None:
        """Close the metrics file and leave the process group (every rank)."""
        if self._out is not None:
            self._out.close()
        dist.barrier()
        dist.destroy_process_group()
