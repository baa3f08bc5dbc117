"""SFT / pretraining of a small GPT on Megatron-Core with exact, layout-invariant loss
normalization (megatron_lossfix). Runs on CPU (gloo) when no GPU is present, NCCL otherwise.

Per-token cross entropy (GPTModel's vocab-parallel loss) on byte-level tokens; the loss counts
only response bytes of {"prompt", "response"} records, every byte of {"text"} records. Without
--data-path it trains on the embedded default corpus. Each iteration logs one line like
Megatron-LM and, with --metrics-out, appends one JSON object (rank 0).

Samples are cut at --seq-length: the log line counts, per step, the samples truncated (and the
loss tokens that cost), those left with no loss token (a prompt that fills the window) and those
that train on the eos alone (an empty response); the metrics record has the same counts.

Launch (two layouts of the same step; their loss and grad norm agree to ~1e-7):
    torchrun --standalone --nproc-per-node 1 examples/pretrain_gpt.py \
        --micro-batch-size 12 --global-batch-size 12 --train-iters 3 --metrics-out out/a.jsonl
    torchrun --standalone --nproc-per-node 2 examples/pretrain_gpt.py \
        --micro-batch-size 2 --global-batch-size 12 --train-iters 3 --metrics-out out/b.jsonl
Add --loss-reduction off to see stock Megatron disagree with itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

from megatron_lossfix import slice_batch_for_cp, weighted_loss

# `common` and `byte_data` sit beside this script: on sys.path when the script runs as a file, but
# not when a test imports the script by path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_data import DataStats, global_batch, load_records, microbatches  # noqa: E402
from common import (  # noqa: E402
    ExampleArgumentParser,
    ExampleRun,
    UsageError,
    add_common_args,
    add_lossfix_flags,
    check_launch,
    data_log_items,
    one_line_errors,
    stock_reported,
)

PROG = "pretrain_gpt.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ExampleArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    groups = add_common_args(parser)
    groups["training"].add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron's per-token mode: the gradient is divided by the global token count "
        "in finalize_model_grads (the plugin feeds it exactly)",
    )
    groups["output"].add_argument(
        "--data-path",
        default=None,
        help='JSONL of {"prompt", "response"} or {"text"} records; default: embedded corpus',
    )
    add_lossfix_flags(parser)
    return parser.parse_args(argv)


def forward_step(cp_group, data_iterator, model):
    """Megatron forward_step: whole sequences come in; with CP each rank keeps its shard (and
    the weights' shard, sliced along with the tokens)."""
    batch = next(data_iterator)
    if cp_group is not None:
        batch = slice_batch_for_cp(batch, cp_group)
    # The loss mask goes to the model too: Megatron computes MTP losses (--mtp-num-layers)
    # inside it, and the plugin weighs each MTP layer through it.
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    # Under `off` no weights come in: the mask is stock's weight.
    loss_func = partial(weighted_loss, batch.get("loss_weights", batch["loss_mask"]))
    return output, stock_reported(batch, loss_func)


def _load(path: str | None) -> list[dict]:
    try:
        return load_records(path)
    except OSError as exc:
        raise UsageError(f"--data-path {path}: {exc.strerror or exc}") from None


def main(argv: list[str] | None = None) -> None:
    with one_line_errors(PROG):
        args = parse_args(argv)
        # Every mistake that can be seen before start-up is reported before it.
        check_launch(args)
        records = _load(args.data_path)
        train(args, records)


def train(args: argparse.Namespace, records: list[dict]) -> None:
    run = ExampleRun.start(args, calculate_per_token_loss=args.calculate_per_token_loss)
    run.banner(records=len(records))
    step = partial(forward_step, run.cp_group)
    total = DataStats()
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        stats = DataStats()
        batch = global_batch(
            records,
            iteration - 1,
            global_batch_size=args.global_batch_size,
            seq_length=args.seq_length,
            seed=args.seed,
            tokenizer=run.tokenizer,
            stats=stats,
        )
        total.add(stats)
        mbs = microbatches(
            batch, dp_rank=run.dp_rank, dp_size=run.dp, micro_batch_size=args.micro_batch_size
        )
        grad_norm, metrics = run.train_step(step, mbs)
        run.report(
            iteration,
            time.perf_counter() - start,
            grad_norm,
            metrics,
            record=stats.as_record(),
            log_items=data_log_items(stats),
        )
    if run.rank0:
        print(
            f"data: {total.samples} samples over {args.train_iters} iterations at --seq-length "
            f"{args.seq_length}: {total.truncated} truncated ({total.cut_loss_tokens} loss tokens "
            f"cut), {total.no_loss_tokens} with no loss token (prompt fills the window), "
            f"{total.eos_only} trained on the eos alone (empty response), {total.empty_text} "
            "empty texts (eos alone)",
            flush=True,
        )
    run.finish()


if __name__ == "__main__":
    main()
