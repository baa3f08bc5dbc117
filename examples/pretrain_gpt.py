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
import sys
import time
from functools import partial
from pathlib import Path

from megatron_lossfix import weighted_loss
from megatron_lossfix.datasets import global_batch, load_records, microbatches
from megatron_lossfix.megatron_compat import slice_batch_for_cp

# `common` sits beside this script: on sys.path when the script runs as a file, but not when a
# test imports the script by path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ExampleRun, add_common_args, add_lossfix_flags  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(weighted_loss, batch.get("loss_weights"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = ExampleRun.start(args, calculate_per_token_loss=args.calculate_per_token_loss)
    records = load_records(args.data_path)
    run.banner(records=len(records))
    step = partial(forward_step, run.cp_group)
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        batch = global_batch(
            records,
            iteration - 1,
            global_batch_size=args.global_batch_size,
            seq_length=args.seq_length,
            seed=args.seed,
            tokenizer=run.tokenizer,
        )
        mbs = microbatches(
            batch, dp_rank=run.dp_rank, dp_size=run.dp, micro_batch_size=args.micro_batch_size
        )
        grad_norm, metrics = run.train_step(step, mbs)
        run.report(iteration, time.perf_counter() - start, grad_norm, metrics)
    run.finish()


if __name__ == "__main__":
    main()
