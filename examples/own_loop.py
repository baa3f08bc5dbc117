"""A complete Megatron-Core training loop of your own, with the plugin: the recipe of the README's
"Use it in your training script", as a script that runs.

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --micro-batch-size 2

Data parallelism only; 8 sequences a step with 1 to 16 loss tokens each, the same global batch
for any number of ranks. Only the plugin's top-level API and Megatron-Core are used.
"""

import argparse
import json
import os
import sys
from functools import partial

import torch
import torch.distributed as dist

import megatron_lossfix as lossfix

parser = lossfix.add_lossfix_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
parser.add_argument("--global-batch-size", type=int, default=8, help="sequences per step")
parser.add_argument("--seq-length", type=int, default=32, help="tokens per sequence")
parser.add_argument("--train-iters", type=int, default=3, help="optimizer steps")
parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
parser.add_argument("--seed", type=int, default=1234, help="seed of the weights and the data")
SKIP = "leave config.finalize_model_grads_func unset: only to show the plugin's refusal"
parser.add_argument("--skip-finalize-model-grads", action="store_true", help=SKIP)
parser.set_defaults(loss_reduction="token_mean")
args, VOCAB = parser.parse_args(), 128

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

# 3. The model, in Megatron DDP (it holds the gradients the step reduces; on a GPU, build it
# without use_cpu_initialization or move it there with model.cuda() before DDP).
config = TransformerConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
    hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
    masked_softmax_fusion=False, gradient_accumulation_fusion=False,
)  # fmt: skip
model = GPTModel(
    config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
    max_sequence_length=args.seq_length,
)  # fmt: skip
model = DDP(config, DDPConfig(), model)
# 4. What Megatron's schedule calls: the DP gradient reduction at the end of the step (without
# it every rank keeps its own share) and the switch-off of DDP's reduction between micro-batches.
if not args.skip_finalize_model_grads:
    config.finalize_model_grads_func = finalize_model_grads
config.no_sync_func = model.no_sync
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr), [model])
schedule = lossfix.schedule_from_args(args)  # replaces get_forward_backward_func()


def global_batch(iteration: int) -> list[dict]:
    """This rank's micro-batches of the step: the r-th contiguous slice of the same 8 samples."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + iteration)
    b, s = args.global_batch_size, args.seq_length
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=gen)
    n_loss = torch.randint(1, 17, (b,), generator=gen)  # 1 to 16 loss tokens each
    mask = (torch.arange(s) >= s - n_loss[:, None]).float()
    per_rank = b // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = dict(tokens=tokens[mine, :-1], labels=tokens[mine, 1:], loss_mask=mask[mine])
    full["position_ids"] = torch.arange(s).expand(per_rank, s)
    m = args.micro_batch_size
    return [{k: v[i : i + m].to(device) for k, v in full.items()} for i in range(0, per_rank, m)]


def forward_step(data_iterator, model):
    batch = next(data_iterator)  # the plugin put the step's weights in it
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(lossfix.weighted_loss, batch["loss_weights"])


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
    except (
        lossfix.StepRefused
    ) as exc:  # raised on every rank together: each says why, then all stop
        print(f"rank {dist.get_rank()}: {exc}", flush=True)
        dist.barrier()
        sys.exit(1)
    _, grad_norm, _ = optimizer.step()
    metrics = schedule.step_metrics()  # global: the same on every rank
    if dist.get_rank() == 0:  # one JSON line per step
        line = dict(iteration=iteration, loss=metrics["loss"], grad_norm=grad_norm)
        print(json.dumps({**line, "num_tokens": int(metrics["num_tokens"])}), flush=True)
dist.destroy_process_group()
