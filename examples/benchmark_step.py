"""One rank's measured training step for ``benchmark.py``, under each variant it compares.

Stock variants reproduce what Megatron-LM's ``pretrain_gpt`` does around
``get_forward_backward_func()``: its loss ``(sum(mask * l), mask.sum(), report)`` and the
all-reduce of the ``lm loss`` report after the step. Plugin variants run ``LossFixSchedule``
and ``step_metrics()``. Kept apart from the driver so that the benchmark's entry point holds
only what it runs and prints, and this file only what it measures.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from byte_data import ByteTokenizer, global_batch, load_records, microbatches
from gpt_model import build_model

from megatron_lossfix import (
    REDUCTIONS,
    LossFixConfig,
    LossFixSchedule,
    enable_cpu_megatron,
    weighted_loss,
)
from megatron_lossfix.rl.objective import rl_loss
from megatron_lossfix.runtime.mode_record import Ids
from megatron_lossfix.runtime.modes import mode_of

CUDA = torch.cuda.is_available()
VARIANTS = {  # name: (plugin mode, None for stock; calculate_per_token_loss)
    "stock": (None, False),
    "stock-repeat": (None, False),  # stock again: its ratios are the noise floor
    "stock-per-token": (None, True),
    **{mode: (mode, False) for mode in ("off", *REDUCTIONS)},
    "token_mean-per-token": ("token_mean", True),
    "token_mean-first-step": ("token_mean", False),  # each step checked as a first step is
}
#: Masks decided in the loss (docs/design.md §10): name -> (mode, mask_in_loss, counting_pass).
#: ``+zeroed``: the masks alone (dropped tokens still count); ``+kept``: dropped tokens leave
#: the normalization, scaled after the schedule; ``+counting``: through the counting pass.
KEPT = {
    "token_mean+zeroed": ("token_mean", False, False),
    "token_mean+kept": ("token_mean", True, False),
    "sequence_mean+kept": ("sequence_mean", True, False),
    "token_mean+counting": ("token_mean", True, True),
}
VARIANTS.update({name: (mode, False) for name, (mode, _, _) in KEPT.items()})
RL_OBJECTIVE = {"policy_loss": "ppo", "kl_coef": 0.01}
#: The masked variants' objective: a token ratio band and off-policy sequence masking (RL), a
#: filter on the per-token loss (SFT).
RL_MASKED = {**RL_OBJECTIVE, "ratio_band": (0.8, 1.25), "offpolicy_kl_threshold": 0.05}
SFT_KEEP = 5.6  # keep the tokens whose loss is below this (about half, untrained)


def baseline(name: str) -> str:
    """The variant ``name`` is compared with: stock (per-token plugin: per-token stock; the
    first step's check: a plain plugin step; a masked variant: ``token_mean`` without masks)."""
    if name in KEPT or name == "token_mean-first-step":
        return "token_mean"
    return "stock-per-token" if name == "token_mean-per-token" else "stock"


def _forward_step(plugin: bool, workload: str, masked: bool, data_iterator, model) -> tuple:
    batch = next(data_iterator)
    if "loss_weights" not in batch:  # stock, and `off` (a pass-through): the loss mask
        batch = {**batch, "loss_weights": batch["loss_mask"]}
    if workload == "sft":
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = weighted_loss if plugin else _megatron_lm_loss
        if masked:
            loss = partial(weighted_loss, keep=lambda per_token: per_token < SFT_KEEP)
        loss_func = partial(loss, batch["loss_weights"])
    else:  # without labels GPTModel returns the logits
        output = model(batch["tokens"], batch["position_ids"], None)
        loss_func = partial(rl_loss, batch, objective=RL_MASKED if masked else RL_OBJECTIVE)
    return output, (loss_func if plugin else partial(_lm_loss_report, loss_func))


def _megatron_lm_loss(mask: torch.Tensor, output: torch.Tensor, **_) -> tuple:
    """Megatron-LM's pretrain_gpt ``loss_func``: ``sum(l * mask)`` and the mask's token count."""
    return torch.sum(output.float() * mask), mask.sum().to(torch.int), {}


def _lm_loss_report(loss_func, output: torch.Tensor, **_) -> tuple:
    """Megatron-LM's report: ``lm loss`` = [loss sum, tokens], all-reduced after the step."""
    loss, num_tokens, _ = loss_func(output)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def _pairs_of_rows(tokens: torch.Tensor) -> torch.Tensor:
    """Rows ``2k`` and ``2k + 1`` of a micro-batch are pair ``k``."""
    return torch.arange(tokens.shape[0], device=tokens.device) // 2


def start() -> None:
    """torch.distributed from torchrun's environment (NCCL with GPUs), then Megatron's parallel
    state: data parallelism only."""
    dist.init_process_group("nccl" if CUDA else "gloo")
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    enable_cpu_megatron()  # a no-op where CUDA is available
    threads = os.environ.get("OMP_NUM_THREADS", "")
    share = max(1, (os.cpu_count() or 1) // dist.get_world_size())
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) else share)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()


def sync() -> None:
    torch.cuda.synchronize() if CUDA else None


def max_over_ranks(value: float) -> float:
    value = torch.tensor([value], dtype=torch.float64, device="cuda" if CUDA else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])


class Bench:
    """One rank's models (one per ``calculate_per_token_loss``), schedules and batches."""

    def __init__(self, args: argparse.Namespace, names: list[str]) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.args, tokenizer = args, ByteTokenizer()
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.models = {}  # DDP fixes its gradient scaling (1/D or 1) when built: one per setting
        for per_token in sorted({VARIANTS[n][1] for n in names}):
            vocab = tokenizer.padded_vocab_size(8)
            chunks, _ = build_model(args, vocab, per_token_loss=per_token, bf16=args.bf16)
            config = OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=1.0, bf16=args.bf16)
            self.models[per_token] = (chunks, get_megatron_optimizer(config, chunks))
        self.schedules = {n: get_forward_backward_func() for n in names if not VARIANTS[n][0]}
        for name in set(names) - set(self.schedules):
            mode = VARIANTS[name][0]
            norm = float(args.seq_length) if mode == "seq_mean_token_sum_norm" else None
            _, in_loss, counting = KEPT.get(name, (mode, False, False))
            # Plain steps, and one variant whose every step runs the default first-step check.
            check = {} if name.endswith("-first-step") else {"self_check": False}
            config = LossFixConfig(
                reduction=mode,
                norm_constant=norm,
                mask_in_loss=in_loss,
                counting_pass=counting,
                **check,
            )
            self.schedules[name] = LossFixSchedule(config)
        records, self.batches, self.paired = load_records(None), [], []
        data = dict(global_batch_size=args.global_batch_size, seq_length=args.seq_length)
        cut = dict(dp_rank=dp_rank, dp_size=dp, micro_batch_size=args.micro_batch_size)
        for i in range(max(args.steps_per_round, args.memory_steps, args.warmup, 1)):
            batch = global_batch(records, i, seed=args.seed, tokenizer=tokenizer, **data)
            gen, (b, s) = torch.Generator().manual_seed(args.seed + i), batch["tokens"].shape
            # Fixed rollouts near the untrained model's log-probs (about -log V): ratios near 1.
            batch["advantages"] = torch.randn(b, generator=gen)
            batch["old_logprobs"] = -5.5 + 0.1 * torch.randn(b, s, generator=gen)
            batch["ref_logprobs"] = -5.5 + 0.1 * torch.randn(b, s, generator=gen)
            device = "cuda" if CUDA else "cpu"
            mbs = [
                {k: t.to(device) if isinstance(t, torch.Tensor) else t for k, t in mb.items()}
                for mb in microbatches(batch, **cut)
            ]
            self.batches.append(mbs)
            # A mode that weighs preference pairs reads each row's pair: two rows a pair, as a
            # chosen and a rejected response (a micro-batch of one row: a pair of its own).
            self.paired.append([mb | {"pair_ids": _pairs_of_rows(mb["tokens"])} for mb in mbs])

    def step(self, name: str, workload: str, index: int) -> dict[str, float]:
        """One training step; this rank's seconds: wall time, the schedule call's, and the CPU
        time of this process (less sensitive than wall time to other work on a shared CPU)."""
        mode, per_token = VARIANTS[name]
        (chunks, optimizer), schedule = self.models[per_token], self.schedules[name]
        pairs = mode is not None and mode_of(mode).ids is Ids.PAIRS
        mbs, args = (self.paired if pairs else self.batches)[index % len(self.batches)], self.args
        if getattr(schedule, "self_check", None) is not None:
            schedule.self_check.checked = False  # this step is checked as the first one
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        sync()
        t1 = time.perf_counter()
        reports = schedule(
            forward_step_func=partial(_forward_step, mode is not None, workload, name in KEPT),
            data_iterator=iter(mbs), model=chunks[0], num_microbatches=len(mbs),
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False,
        )  # fmt: skip
        sync()
        fb_s = time.perf_counter() - t1
        optimizer.step()
        if mode is None:  # Megatron-LM's train_step: sum [loss, tokens], all-reduce over DP
            val = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
            dist.all_reduce(val, group=self.dp_group)
            float(val[0] / val[1].clamp(min=1))  # the logged loss: a host sync, as there
        else:
            schedule.step_metrics()
        sync()
        wall = time.perf_counter() - t0
        return {"step_s": wall, "fb_s": fb_s, "cpu_s": time.process_time() - c0}

    def tensor_peak(self, name: str, workload: str) -> float:
        """Peak bytes of live tensors allocated during one step, above those before it (max over
        ranks): activations, gradients in flight, the plugin's weights. Model, gradient buffers
        and Adam state exist before the step and are the same for every variant."""
        self.step(name, workload, 0)  # same state before the measured step for every variant
        if CUDA:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.step(name, workload, 0)
            return max_over_ranks(torch.cuda.max_memory_allocated() - base)
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step(name, workload, 0)
        allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                allocs.append((event.start_time_ns, event.extra_fields))
        # The allocator's running total carries over from earlier profiles: the peak is taken
        # above its value just before this step's first allocation record.
        allocs = [fields for _, fields in sorted(allocs, key=lambda item: item[0])]
        first = allocs[0].total_allocated - allocs[0].alloc_size if allocs else 0
        return max_over_ranks(max([a.total_allocated for a in allocs], default=first) - first)
