"""A complete Megatron-Core training loop of your own, with the plugin: the recipe of the README's
"Your own training loop" (docs/own_loop.md), as a script that runs.

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --micro-batch-size 2

Data parallelism only; 8 sequences a step with 1 to 16 loss tokens each, the same global batch
for any number of ranks. It uses the plugin's public API and Megatron-Core, nothing else.
"""

import json
import os
from functools import partial

import torch
import torch.distributed as dist
from usage import ExampleArgumentParser  # a bad flag: one line from rank 0, exit 2

import megatron_lossfix as lossfix
from megatron_lossfix.args import non_negative_float, non_negative_int, positive_int

parser = ExampleArgumentParser(description=__doc__.split("\n")[0])
lossfix.add_lossfix_args(parser, default_reduction="token_mean")
add, pos = parser.add_argument, positive_int  # argparse types: a bad value names its flag
add("--micro-batch-size", type=pos, default=2, help="sequences per micro-batch")
add("--global-batch-size", type=pos, default=8, help="sequences per step")
add("--seq-length", type=pos, default=32, help="tokens per sequence")
add("--train-iters", type=pos, default=3, help="optimizer steps")
add("--lr", type=non_negative_float, default=1e-3, help="Adam learning rate")
add("--seed", type=non_negative_int, default=1234, help="seed of the weights and the data")
add("--skip-finalize-model-grads", action="store_true", help="leave it unset, to show the refusal")
args, VOCAB = parser.parse_args(), 128
if args.global_batch_size % (args.micro_batch_size * int(os.environ.get("WORLD_SIZE", "1"))):
    parser.error("argument --global-batch-size: must be a multiple of --micro-batch-size x ranks")
try:  # the plugin's flags are checked here too, before start-up: one line, exit 2
    schedule = lossfix.schedule_from_args(args)  # replaces get_forward_backward_func()
except ValueError as exc:
    parser.error(str(exc))

# 1. Process groups: gloo and the CPU bridge without a GPU, NCCL with one.
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
lossfix.enable_cpu_megatron()  # a no-op where CUDA is available
from megatron.core import parallel_state as ps  # noqa: E402 - after the CPU bridge
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

ps.initialize_model_parallel()  # TP = PP = CP = 1: every rank is a data-parallel rank
dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

# 2. RNG: Megatron's layers draw from its tracked RNG states; without them it fails.
torch.manual_seed(args.seed)
tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

# 3. The model, in Megatron DDP: its buffers hold the gradients that the step reduces.
config = TransformerConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
    hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
    masked_softmax_fusion=False, gradient_accumulation_fusion=False,
)  # fmt: skip
model = GPTModel(
    config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
    max_sequence_length=args.seq_length,
)  # fmt: skip
model = DDP(config, DDPConfig(), model.cuda() if torch.cuda.is_available() else model)
# 4. Megatron's schedule calls these: the DP reduction at the step's end, no_sync in between.
if not args.skip_finalize_model_grads:
    config.finalize_model_grads_func = finalize_model_grads
config.no_sync_func = model.no_sync
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr), [model])


def global_batch(iteration: int) -> list[dict]:
    """This rank's micro-batches of the step: the r-th contiguous slice of the same 8 samples."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + iteration)
    b, s, m = args.global_batch_size, args.seq_length, args.micro_batch_size
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=gen)
    n_loss = torch.randint(1, min(16, s) + 1, (b,), generator=gen)  # 1 to 16 loss tokens each
    mask = (torch.arange(s) >= s - n_loss[:, None]).float()
    per_rank = b // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = dict(tokens=tokens[mine, :-1], labels=tokens[mine, 1:], loss_mask=mask[mine])
    full["position_ids"] = torch.arange(s).expand(per_rank, s)
    return [{k: v[i : i + m].to(device) for k, v in full.items()} for i in range(0, per_rank, m)]


def forward_step(data_iterator, model):
    batch = next(data_iterator)  # the plugin put the step's weights in it (`off`: the mask is)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(lossfix.weighted_loss, batch.get("loss_weights", batch["loss_mask"]))


for iteration in range(1, args.train_iters + 1):
    mbs = global_batch(iteration)
    model.zero_grad_buffer()  # as Megatron-LM: DDP's buffers, then the optimizer's
    optimizer.zero_grad()
    try:
        schedule(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
            num_microbatches=len(mbs), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False,
        )  # fmt: skip
    except (lossfix.StepRefused, lossfix.SelfCheckError) as exc:  # every rank: each says why
        print(f"rank {dist.get_rank()}: {exc}\n", end="", flush=True)  # one write: no interleaving
        dist.barrier()
        raise SystemExit(1) from None
    _, grad_norm, _ = optimizer.step()
    metrics = schedule.step_metrics()  # global: the same on every rank
    if dist.get_rank() == 0:  # one JSON line per step
        # `off` reports only what the loss function did (here nothing): no loss, no tokens.
        line = dict(iteration=iteration, loss=metrics.get("loss"), grad_norm=grad_norm)
        print(json.dumps({**line, "num_tokens": metrics.get("num_tokens")}), flush=True)
# Megatron's teardown: every rank done with the groups, then Megatron's, then torch's.
dist.barrier()
ps.destroy_model_parallel()
dist.destroy_process_group()
