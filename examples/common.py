"""What the example scripts share: Megatron-LM flags, start-up, model and optimizer, one training
step through the plugin's schedule, and the per-iteration metrics record and log line.

The model is built the way a Megatron user builds one (:func:`build_model`): a
``TransformerConfig`` and a layer spec from the flags, a ``model_provider``, Megatron DDP. That
is where your own model provider goes.

``pretrain_gpt.py`` and ``grpo_gpt.py`` differ only in their data and their loss; everything
here is the same code for both, so a layout behaves the same way in either script. Imported as
``from common import ...``: the scripts run as files, which puts this directory on ``sys.path``.

Mistakes end as one line, ``<script>: error: <what to change>``, not as a traceback per rank:
flags and data are checked before torch.distributed starts (every rank checks, global rank 0
prints, every rank exits with status 2), and the plugin's own refusals after start-up
(``ValueError``, a failed self-check) exit with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import torch
import torch.distributed as dist
from byte_data import ByteTokenizer, DataStats
from usage import ExampleArgumentParser, UsageError, exit_before_startup, print_error

import megatron_lossfix
from megatron_lossfix import LossFixConfig, LossFixSchedule, SelfCheckError
from megatron_lossfix.agreement import ProblemOnAnotherRank
from megatron_lossfix.args import (
    add_lossfix_args,
    finite_float,
    from_args,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from megatron_lossfix.audit import training
from megatron_lossfix.audit.training import Layout, init_layout
from megatron_lossfix.cpu_compat import enable_cpu_megatron, quiet_repeated_megatron_warnings

__all__ = [
    "ExampleArgumentParser",
    "ExampleRun",
    "UsageError",
    "add_common_args",
    "add_lossfix_flags",
    "build_model",
    "check_launch",
    "data_log_items",
    "finite_float",
    "init_distributed",
    "non_negative_float",
    "non_negative_int",
    "one_line_errors",
    "positive_int",
]


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """Turn the known kinds of mistakes into one line and a non-zero exit, without a traceback.

    Before torch.distributed starts: :class:`UsageError`, ``ValueError`` (the plugin's config,
    a data file) and ``OSError`` (a file that cannot be read or written); global rank 0 prints,
    every rank exits with 2. After start-up: a ``ValueError`` raised by the plugin or these
    scripts (refusing their input) and a failed self-check exit with 1; rank 0 prints, and
    another rank prints only an error of its own (not one that every rank raises together).
    Anything else keeps its traceback: it is a bug, not a mistake in the input.
    """
    try:
        yield
    except (UsageError, ValueError, OSError, SelfCheckError) as exc:
        started = dist.is_available() and dist.is_initialized()
        if not started:
            if isinstance(exc, SelfCheckError):
                raise
            exit_before_startup(prog, _describe(exc))
        if isinstance(exc, OSError) or not _raised_by_us(exc):
            raise  # a ValueError deep inside Megatron or torch is a bug: keep its traceback
        rank = dist.get_rank()
        # Raised on every rank at once: the self-check verdict is all-reduced, and the plugin's
        # "problem on another rank" points at the rank that prints its own error.
        shared = isinstance(exc, (SelfCheckError, ProblemOnAnotherRank))
        if rank == 0:
            print_error(prog, _describe(exc))
        elif not shared:
            print_error(prog, f"(rank {rank}) {_describe(exc)}")
        sys.exit(1)


_OUR_CODE = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(megatron_lossfix.__file__)),
)


def _raised_by_us(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` is in the plugin or the example scripts."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = os.path.abspath(tb.tb_frame.f_code.co_filename) if tb is not None else ""
    return name.startswith(_OUR_CODE)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)


def add_common_args(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Add the Megatron-LM flags both scripts take; return their groups by name (``model``,
    ``parallelism``, ``training``, ``output``) so a script can add its own flags beside them.

    Script-specific defaults go through ``parser.set_defaults``.
    """
    return {
        "model": _add_model_args(parser),
        "parallelism": _add_parallelism_args(parser),
        "training": _add_training_args(parser),
        "output": _add_output_args(parser),
    }


def _add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=positive_int, default=4, help="transformer layers")
    model.add_argument("--hidden-size", type=positive_int, default=64, help="hidden size")
    model.add_argument(
        "--num-attention-heads", type=positive_int, default=4, help="attention heads"
    )
    model.add_argument("--seq-length", type=positive_int, default=128, help="tokens per sequence")
    model.add_argument(
        "--num-experts", type=positive_int, default=None, help="MoE experts per layer"
    )
    model.add_argument(
        "--moe-aux-loss-coeff",
        type=non_negative_float,
        default=0.0,
        help="MoE load-balancing loss weight",
    )
    model.add_argument(
        "--mtp-num-layers",
        type=positive_int,
        default=None,
        help="multi-token prediction layers (DeepSeek-V3 style): their losses are normalized "
        "by the same --loss-reduction over their own shifted masks",
    )
    model.add_argument(
        "--mtp-loss-scaling-factor",
        type=non_negative_float,
        default=0.1,
        help="weight of the MTP losses (Megatron divides it by --mtp-num-layers)",
    )
    model.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
        help="position embedding; MTP with pipeline parallelism needs rope (Megatron sums "
        "only the word embeddings' gradient over the stages holding a copy)",
    )
    model.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="layer implementation: Megatron's local modules, or Transformer Engine (CUDA "
        "only; its attention supports context parallelism)",
    )
    model.add_argument(
        "--no-attention",
        action="store_true",
        help="replace self-attention by identity (layers mix nothing across tokens): only for "
        "testing context parallelism on CPU where Transformer Engine is absent",
    )
    return model


def _add_parallelism_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=positive_int, default=1, help="TP size")
    par.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1, help="PP size")
    par.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=positive_int,
        default=None,
        help="layers per virtual stage (interleaved 1F1B schedule)",
    )
    par.add_argument("--context-parallel-size", type=positive_int, default=1, help="CP size")
    par.add_argument("--expert-model-parallel-size", type=positive_int, default=1, help="EP size")
    return par


def _add_training_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    train = parser.add_argument_group("training")
    train.add_argument(
        "--micro-batch-size", type=positive_int, default=4, help="sequences per micro-batch"
    )
    train.add_argument(
        "--global-batch-size", type=positive_int, default=16, help="sequences per step"
    )
    train.add_argument("--train-iters", type=positive_int, default=200, help="optimizer steps")
    train.add_argument("--lr", type=non_negative_float, default=3e-3, help="Adam learning rate")
    train.add_argument(
        "--clip-grad", type=non_negative_float, default=1.0, help="gradient clipping norm"
    )
    train.add_argument(
        "--seed", type=non_negative_int, default=1234, help="seed of data order and weights"
    )
    return train


def _add_output_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    output = parser.add_argument_group("data and output")
    output.add_argument(
        "--metrics-out",
        default=None,
        help="write one JSON object per iteration to this file (rank 0; its folder is created)",
    )
    output.add_argument(
        "--log-interval", type=positive_int, default=1, help="iterations between logs"
    )
    return output


def add_lossfix_flags(parser: argparse.ArgumentParser) -> None:
    """The plugin's flags, on by default in the examples (``--loss-reduction token_mean``)."""
    add_lossfix_args(parser)
    parser.set_defaults(loss_reduction="token_mean")


def _world_size() -> int:
    """Ranks in this launch, from torchrun's environment (1 without torchrun)."""
    text = os.environ.get("WORLD_SIZE", "1")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def check_launch(args: argparse.Namespace, world_size: int | None = None) -> None:
    """Refuse, before torch.distributed starts, what Megatron or the plugin would refuse later
    (with a traceback per rank): the layout against the number of ranks, the batch sizes
    against the data-parallel size, model shapes, context parallelism without an attention
    that supports it, the plugin's flags. Creates the folder of ``--metrics-out``.

    Raises :class:`UsageError` (or the plugin's ``ValueError``) saying what to change. The
    checks run in this order, so the first refusal a user sees stays the same.
    """
    world = world_size or _world_size()
    _check_layout(args, world)
    _check_shapes(args)
    _check_experts(args, world)
    _check_attention(args)
    from_args(args)  # the plugin's own refusals (ValueError), e.g. --loss-norm-constant 0
    _prepare_metrics_out(args)


def _check_layout(args: argparse.Namespace, world: int) -> None:
    """The parallel layout against the ranks, the batch sizes against data parallelism."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    model_parallel = tp * pp * cp
    if world % model_parallel:
        raise UsageError(
            f"{world} rank(s) (torchrun --nproc-per-node) cannot hold --tensor-model-parallel-size "
            f"{tp} x --pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = "
            f"{model_parallel}; launch a multiple of {model_parallel} ranks"
        )
    dp = world // model_parallel
    step = dp * args.micro_batch_size
    if args.global_batch_size % step:
        raise UsageError(
            f"--global-batch-size {args.global_batch_size} is not divisible by data-parallel "
            f"size {dp} x --micro-batch-size {args.micro_batch_size} = {step}; use a multiple "
            f"of {step} (data-parallel size = ranks / (TP x PP x CP) = {world} / "
            f"{model_parallel})"
        )
    if args.num_layers % pp:
        raise UsageError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{pp}"
        )
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if per_virtual is not None and (pp < 2 or (args.num_layers // pp) % per_virtual):
        raise UsageError(
            f"--num-layers-per-virtual-pipeline-stage {per_virtual} needs "
            f"--pipeline-model-parallel-size > 1 and must divide the {args.num_layers // pp} "
            f"layers of each pipeline stage"
        )


def _check_shapes(args: argparse.Namespace) -> None:
    """Model shapes that tensor parallelism and multi-token prediction must split."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.hidden_size % args.num_attention_heads:
        raise UsageError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    vocab = ByteTokenizer().padded_vocab_size(8)
    for name, value in (("--num-attention-heads", args.num_attention_heads), ("vocabulary", vocab)):
        if value % tp:
            raise UsageError(
                f"{name} {value} is not divisible by --tensor-model-parallel-size {tp}"
            )
    mtp = getattr(args, "mtp_num_layers", None)
    if mtp and pp > 1 and args.position_embedding_type != "rope":
        raise UsageError(
            f"--mtp-num-layers {mtp} with --pipeline-model-parallel-size {pp} needs "
            "--position-embedding-type rope: the MTP layers on the last stage use a copy of the "
            "position embedding whose gradient Megatron does not sum over the stages"
        )


def _check_experts(args: argparse.Namespace, world: int) -> None:
    """Expert parallelism against the experts and the ranks."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if ep > 1 and args.num_experts is None:
        raise UsageError(f"--expert-model-parallel-size {ep} needs --num-experts")
    if args.num_experts is not None and args.num_experts % ep:
        raise UsageError(
            f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size "
            f"{ep}"
        )
    if world % (tp * ep * pp):
        raise UsageError(
            f"{world} rank(s) cannot hold --tensor-model-parallel-size {tp} x "
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp}"
        )


def _check_attention(args: argparse.Namespace) -> None:
    """The attention implementation, and context parallelism's needs of it."""
    cp = args.context_parallel_size
    if args.transformer_impl == "transformer_engine" and not (
        torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")
    ):
        raise UsageError(
            "--transformer-impl transformer_engine needs CUDA and Transformer Engine; use "
            "--transformer-impl local"
        )
    if cp > 1:
        if args.transformer_impl == "local" and not args.no_attention:
            raise UsageError(
                f"--context-parallel-size {cp} needs --transformer-impl transformer_engine "
                "(CUDA), or --no-attention on CPU: Megatron's local attention refuses context "
                "parallelism"
            )
        if args.seq_length % (2 * cp):
            raise UsageError(
                f"--seq-length {args.seq_length} must be a multiple of 2 x "
                f"--context-parallel-size = {2 * cp} (each rank takes two chunks)"
            )


def _prepare_metrics_out(args: argparse.Namespace) -> None:
    """Refuse a folder as ``--metrics-out``; create the folder the file goes in."""
    if args.metrics_out:
        if os.path.isdir(args.metrics_out):
            raise UsageError(f"--metrics-out {args.metrics_out} is a folder; give a file name")
        folder = os.path.dirname(args.metrics_out)
        if folder:
            os.makedirs(folder, exist_ok=True)


def data_log_items(stats: DataStats) -> list[tuple[str, str]]:
    """Log-line items for what a step's data lost: only the counts that are not zero."""
    items = []
    if stats.truncated:
        items.append(("truncated", f"{stats.truncated} ({stats.cut_loss_tokens} loss tokens cut)"))
    if stats.no_loss_tokens:
        items.append(("no loss tokens", str(stats.no_loss_tokens)))
    if stats.eos_only:
        items.append(("eos only", str(stats.eos_only)))
    if stats.empty_text:
        items.append(("empty text", str(stats.empty_text)))
    return items


def init_distributed() -> str:
    """Start torch.distributed from torchrun's environment; bridge Megatron to CPU if needed."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    enable_cpu_megatron()
    # Ranks of one machine share its cores; oversubscription makes every rank slower. An explicit
    # OMP_NUM_THREADS wins (on a busy machine one thread per rank beats spinning OMP workers).
    threads = os.environ.get("OMP_NUM_THREADS", "")
    share = max(1, (os.cpu_count() or 1) // dist.get_world_size())
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else share)
    return backend


def _layout_of(args: argparse.Namespace) -> tuple[Layout, int | None]:
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
    return layout, vpp


def _to(value: Any, device: torch.device) -> Any:
    """A micro-batch entry on ``device`` (an int, such as ``num_groups``, stays as it is)."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def stock_reported(batch: dict, loss_func: Callable) -> Callable:
    """``loss_func``, and under ``off`` (no weights in ``batch``) one whose report also carries
    what :meth:`ExampleRun.train_step` needs to log stock Megatron's loss: under ``off`` the
    plugin sees nothing of the step but these reports."""
    return loss_func if "loss_weights" in batch else functools.partial(_stock_report, loss_func)


def _stock_report(loss_func: Callable, output: torch.Tensor) -> tuple:
    loss, num_tokens, report = loss_func(output)
    # Copies: Megatron scales the returned loss in place after this call.
    total, n = loss.detach().double(), num_tokens.detach().double()
    return (
        loss,
        num_tokens,
        {
            **report,
            "stock_mean_sum": total / n.clamp(min=1),  # this micro-batch's token mean
            "stock_mean_count": torch.ones_like(n),
            "stock_token_sum": total,
            "num_tokens_sum": n,
        },
    )


def _stock_metrics(metrics: dict, per_token: bool) -> dict:
    """``off``: stock Megatron's loss from the reports of :func:`stock_reported`: the mean of
    the per-micro-batch token means over micro-batches and DP x CP ranks (Megatron's default
    path), or the step's token sum over its tokens (``calculate_per_token_loss``)."""
    mean_sum, count = metrics.pop("stock_mean_sum"), metrics.pop("stock_mean_count")
    token_sum, tokens = metrics.pop("stock_token_sum"), metrics.pop("num_tokens_sum")
    loss = token_sum / max(tokens, 1.0) if per_token else mean_sum / count
    return {**metrics, "loss": loss, "num_tokens": tokens}


@dataclass
class ExampleRun:
    """One training run of an example script: process groups, model chunks, optimizer, the
    plugin's schedule, and the metrics file. Build it with :meth:`start`."""

    args: argparse.Namespace
    config: LossFixConfig
    backend: str
    layout: Layout
    vpp: int | None
    dp: int
    dp_rank: int
    tokenizer: ByteTokenizer
    chunks: list
    model_config: Any
    optimizer: Any
    schedule: LossFixSchedule
    rank0: bool
    device: torch.device
    _out: IO[str] | None = field(default=None, repr=False)

    @classmethod
    def start(cls, args: argparse.Namespace, *, calculate_per_token_loss: bool = False):
        """Initialize distributed and Megatron's parallel state, build the tiny GPT (same global
        weights for every layout), its Adam optimizer and the plugin's schedule."""
        config = from_args(args) or LossFixConfig(reduction="token_mean")
        # Before Megatron is imported: some of its fallback warnings fire at import time.
        quiet_repeated_megatron_warnings()
        backend = init_distributed()

        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        layout, vpp = _layout_of(args)
        layout = init_layout(layout)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if args.global_batch_size % (dp * args.micro_batch_size):
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} must be divisible by data-parallel "
                f"size {dp} x --micro-batch-size {args.micro_batch_size}"
            )
        tokenizer = ByteTokenizer()
        chunks, model_config = build_model(args, layout, tokenizer, calculate_per_token_loss)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=args.lr, clip_grad=args.clip_grad, weight_decay=0.0
            ),
            chunks,
        )
        rank0 = dist.get_rank() == 0
        return cls(
            args=args,
            config=config,
            backend=backend,
            layout=layout,
            vpp=vpp,
            dp=dp,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            chunks=chunks,
            model_config=model_config,
            optimizer=optimizer,
            # --lossfix-self-check (config.self_check) re-splits the first step and fails
            # loudly on a mismatch.
            schedule=LossFixSchedule(config),
            rank0=rank0,
            # Where the model lives (tiny_gpt moves it to the GPU on NCCL runs).
            device=torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu"),
            _out=open(args.metrics_out, "w") if (args.metrics_out and rank0) else None,
        )

    @property
    def cp_group(self) -> Any:
        """The context-parallel group, or None without context parallelism."""
        from megatron.core import parallel_state as ps

        return ps.get_context_parallel_group() if self.layout.cp > 1 else None

    @property
    def microbatches_per_rank(self) -> int:
        return self.args.global_batch_size // (self.dp * self.args.micro_batch_size)

    def banner(self, **extra: Any) -> None:
        """Print the run's layout once (rank 0); ``extra`` items go before the backend."""
        if not self.rank0:
            return
        layout = self.layout
        items = "".join(f"{key}={value} " for key, value in extra.items())
        print(
            f"megatron_lossfix: reduction={self.config.reduction} TP={layout.tp} PP={layout.pp} "
            f"VPP={self.vpp} CP={layout.cp} EP={layout.ep} DP={self.dp} micro-batches/rank="
            f"{self.microbatches_per_rank} {items}backend={self.backend}",
            flush=True,
        )

    def train_step(self, forward_step: Callable, mbs: Sequence[dict]) -> tuple[float, dict]:
        """One optimizer step over this rank's micro-batches; returns the grad norm (before
        clipping, over all shards) and the step's global metrics (``schedule.step_metrics``)."""
        # The data is built on the host; a no-op on CPU runs.
        mbs = [{k: _to(v, self.device) for k, v in mb.items()} for mb in mbs]
        result = training.train_step(
            self.schedule,
            forward_step,
            self.chunks,
            mbs,
            self.optimizer,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
        )
        metrics = self.schedule.step_metrics()
        if self.config.reduction == "off":
            metrics = _stock_metrics(metrics, self.model_config.calculate_per_token_loss)
        return result.grad_norm, metrics

    def report(
        self,
        iteration: int,
        step_time: float,
        grad_norm: float,
        metrics: dict,
        *,
        loss_name: str = "lm loss",
        record: dict | None = None,
        log_items: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Write the iteration's metrics record and print a Megatron-LM style log line (rank 0).

        The record holds docs/design.md §5's fields (plus ``num_sequences``, ``reduction``, and
        ``num_groups`` in the modes over group ids), then ``record``; the line ends with
        ``log_items`` as ``label: value`` pairs."""
        if not self.rank0:
            return
        args = self.args
        line = {
            "iteration": iteration,
            "loss": metrics["loss"],
            "grad_norm": grad_norm,
            "num_tokens": int(metrics["num_tokens"]),
            # `off` shows no sequence count (the plugin does not look at its batches).
            "num_sequences": int(metrics["num_sequences"]) if "num_sequences" in metrics else None,
            # Modes over group ids: the groups (trajectories) with a loss token.
            **({"num_groups": int(metrics["num_groups"])} if "num_groups" in metrics else {}),
            "step_time_s": step_time,
            "reduction": self.config.reduction,
            # Each MTP layer's loss, normalized like the main loss (plugin modes).
            **{k: v for k, v in metrics.items() if k.startswith("mtp_loss_")},
            **(record or {}),
        }
        if self._out is not None:
            self._out.write(json.dumps(line) + "\n")
            self._out.flush()
        # Iteration 1 too: the starting loss is what a run is compared against.
        if iteration % args.log_interval == 0 or iteration == 1:
            mtp = [(f"mtp_{k[9:]} loss", f"{v:.6E}") for k, v in line.items() if "mtp_loss_" in k]
            extra = "".join(f" {label}: {value} |" for label, value in (*mtp, *log_items))
            print(
                f" iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {iteration * args.global_batch_size:10d} |"
                f" elapsed time per iteration (ms): {1000 * step_time:.1f} |"
                f" learning rate: {args.lr:.3E} | global batch size: {args.global_batch_size:5d} |"
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


def build_model(
    args: argparse.Namespace,
    layout: Layout,
    tokenizer: ByteTokenizer,
    calculate_per_token_loss: bool = False,
    bf16: bool = False,
) -> tuple[list, Any]:
    """This rank's GPT chunks (Megatron DDP) from the model flags, with the global weights that
    ``--seed`` gives under any layout, so runs can be compared step by step. ``bf16``:
    Megatron-LM's ``--bf16`` (bf16 model in Float16Module, fp32 main gradients).

    Your model goes here: a ``TransformerConfig``, a layer spec and a ``model_provider``."""
    from megatron.core.distributed import DistributedDataParallelConfig

    vocab_size = tokenizer.padded_vocab_size(8)
    moe = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_aux_loss_coeff=args.moe_aux_loss_coeff)
    config = training.transformer_config(
        layout,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        calculate_per_token_loss=calculate_per_token_loss,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        bf16=bf16,
        **moe,
    )
    # TransformerConfig has no field for these; the scripts building batches read them.
    config.vocab_size, config.seq_length = vocab_size, args.seq_length
    use_te = args.transformer_impl == "transformer_engine"
    spec = training.gpt_layer_spec(
        args.transformer_impl, num_experts=args.num_experts, no_attention=args.no_attention
    )
    model_provider = training.gpt_model_provider(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=args.seq_length,
        use_transformer_engine=use_te,
        position_embedding_type=args.position_embedding_type,
    )
    # Megatron-LM's default under --bf16 (--accumulate-allreduce-grads-in-fp32).
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16)
    chunks = training.build_model(model_provider, config, ddp_config)
    training.set_deterministic_params(chunks, args.seed)
    return chunks, config
