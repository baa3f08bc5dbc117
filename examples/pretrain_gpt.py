"""SFT / pretraining of a small GPT on Megatron-Core with exact, layout-invariant loss
normalization (megatron_lossfix). Runs on CPU (gloo) when no GPU is present, NCCL otherwise.

    torchrun --standalone --nproc-per-node 2 examples/pretrain_gpt.py --train-iters 100

Two layouts of the same run write the same loss and grad norm (to ~1e-7); add
--loss-reduction off to both and stock Megatron disagrees with itself:

    torchrun --standalone --nproc-per-node 1 examples/pretrain_gpt.py \
        --micro-batch-size 12 --global-batch-size 12 --train-iters 3 --metrics-out out/a.jsonl
    torchrun --standalone --nproc-per-node 2 examples/pretrain_gpt.py \
        --micro-batch-size 2 --global-batch-size 12 --train-iters 3 --metrics-out out/b.jsonl

Per-token cross entropy (GPTModel's vocab-parallel loss) on byte-level tokens: the loss counts
only the response bytes of {"prompt", "response"} records, every byte of {"text"} records
(--data-path; by default an embedded corpus of real text). Samples are cut at --seq-length, and
each log line counts what that cost: samples truncated (and their loss tokens), samples left
with no loss token (a prompt that fills the window), samples that train on the eos alone.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from byte_data import ByteTokenizer, DataStats, global_batch, load_records, microbatches
from gpt_model import add_model_args
from train_loop import Run, add_training_args, check_before_start, stock_reported
from usage import ExampleArgumentParser, exit_before_startup

from megatron_lossfix import slice_batch_for_cp, weighted_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a malformed one is one line, before start-up."""
    parser = ExampleArgumentParser(prog="pretrain_gpt.py", description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_training_args(parser)
    parser.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron's per-token path: finalize_model_grads divides by the global token count",
    )
    parser.add_argument("--data-path", default=None, help='JSONL of {"prompt", "response"} or '
                        '{"text"} records; default: the embedded corpus')  # fmt: skip
    return parser.parse_args(argv)


def read_records(args: argparse.Namespace) -> list[dict]:
    """The training records; a file that cannot be read or parsed is one line, before start-up."""
    try:
        return load_records(args.data_path)
    except OSError as exc:
        exit_before_startup("pretrain_gpt.py", f"--data-path {args.data_path}: {exc.strerror}")
    except ValueError as exc:
        exit_before_startup("pretrain_gpt.py", str(exc))


def forward_step(cp_group, data_iterator, model):
    """Megatron's forward_step: whole sequences come in; under CP each rank keeps its shard of
    every per-token tensor, the plugin's weights included."""
    batch = next(data_iterator)
    if cp_group is not None:
        batch = slice_batch_for_cp(batch, cp_group)
    # The mask goes to the model too: Megatron computes the MTP losses inside it.
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])  # fmt: skip
    # The plugin put the step's weights in the batch; under `off` the mask is stock's weight.
    loss_func = partial(weighted_loss, batch.get("loss_weights", batch["loss_mask"]))
    return output, stock_reported(batch, loss_func)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_before_start("pretrain_gpt.py", args)  # the plugin's flags, the batch, --metrics-out
    records = read_records(args)
    tokenizer = ByteTokenizer()
    run = Run(args, tokenizer.padded_vocab_size(8), per_token_loss=args.calculate_per_token_loss)
    run.banner(records=len(records))
    total = DataStats()
    for iteration in range(1, args.train_iters + 1):
        start, stats = time.perf_counter(), DataStats()
        # The same global batch for every layout; DP rank r takes the r-th contiguous slice.
        batch = global_batch(records, iteration - 1, global_batch_size=args.global_batch_size,
                             seq_length=args.seq_length, seed=args.seed, tokenizer=tokenizer,
                             stats=stats)  # fmt: skip
        total.add(stats)
        mbs = microbatches(batch, dp_rank=run.dp_rank, dp_size=run.dp,
                           micro_batch_size=args.micro_batch_size)  # fmt: skip
        grad_norm, metrics = run.step(partial(forward_step, run.cp_group), mbs)
        run.report(iteration, time.perf_counter() - start, grad_norm, metrics,
                   record=stats.as_record(), log_items=stats.log_items())  # fmt: skip
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
