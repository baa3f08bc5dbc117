"""The sampling mode of ``grpo_gpt.py``: an embedded task, responses sampled from the model being
trained, rewards and GRPO advantages.

Each prompt names a character class and shows one byte of it ("digits: 7", "lowercase: q",
"uppercase: K"); the reward is the fraction of the ``--max-new-tokens`` response positions
holding a byte of that class (an early end-of-text leaves the rest at 0). Every byte can follow
from the one before it, so a tiny model learns the task in a few minutes on a CPU.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from byte_data import ByteTokenizer
from gpt_model import build_model
from rollouts import encode_rollouts

from megatron_lossfix import grpo_advantages, vocab_parallel_logprobs_entropy

__all__ = ["TASKS", "Sampler", "prompt_width", "task_reward"]

#: (class name, the bytes that earn reward).
TASKS: tuple[tuple[str, bytes], ...] = (
    ("digits", b"0123456789"),
    ("lowercase", b"abcdefghijklmnopqrstuvwxyz"),
    ("uppercase", b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
)


def prompt_width() -> int:
    """Tokens of the longest prompt: bos + "name: " + one example byte."""
    return max(len(f"{name}: ") + 2 for name, _ in TASKS)


def _iteration_seed(seed: int, iteration: int) -> int:
    # A generator per iteration: sampling never touches the global RNG (which Megatron's RNG
    # tracker and other layouts may consume differently).
    return (seed * 0x9E3779B97F4A7C15 + 7919 * iteration + 1) % 2**63


def task_prompts(iteration: int, args: argparse.Namespace, tokenizer: ByteTokenizer) -> list:
    """The global batch's ``(prompt_ids, rewarded bytes)``, each prompt G times in a row."""
    gen = torch.Generator().manual_seed(_iteration_seed(args.seed, iteration))
    picks = torch.randint(len(TASKS), (args.prompts_per_step,), generator=gen).tolist()
    out = []
    for k in picks:
        name, allowed = TASKS[k]
        example = allowed[int(torch.randint(len(allowed), (), generator=gen))]
        prompt = [tokenizer.bos_id, *tokenizer.encode(f"{name}: "), example]
        out += [(prompt, frozenset(allowed))] * args.num_generations
    return out


def task_reward(response: list[int], allowed: frozenset[int], eos_id: int, max_new: int) -> float:
    """Fraction of the ``max_new`` response positions holding a rewarded byte (0 after eos)."""
    body = response[:-1] if response and response[-1] == eos_id else response
    return sum(t in allowed for t in body) / max_new


@torch.no_grad()
def sample(model, prompts: list[list[int]], noise: torch.Tensor, *, width0: int, temperature: float,
           eos_id: int, pad_id: int, tp: int) -> list[list[int]]:  # fmt: skip
    """One response per prompt, token by token, re-running the whole prefix each step.

    ``noise`` is ``[len(prompts), max_new]`` uniform: a token is the inverse CDF of
    softmax(logits / T) at the noise, so the draws belong to the sequence, not to the rank that
    samples it. Every rank runs the same ``width0 + step`` columns (right padding is invisible
    to causal attention), so ranks meeting in collectives (TP, EP) see equal shapes. A response
    ends after eos (included) or ``max_new`` tokens.
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, max_new = noise.shape
    device = noise.device
    ids = torch.full((b, width0 + max_new), pad_id, dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    ids = ids.to(device)
    start = torch.tensor([len(p) for p in prompts], device=device)
    lengths, rows = start.clone(), torch.arange(b, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    model.eval()
    try:
        for step in range(max_new):
            width = width0 + step
            positions = torch.arange(width, device=device).expand(b, -1)
            logits = model(ids[:, :width], positions, None)  # [b, width, V/TP]
            if tp > 1:
                logits = gather_from_tensor_model_parallel_region(logits)
            cdf = torch.softmax(logits[rows, lengths - 1].double() / temperature, dim=-1).cumsum(-1)
            u = noise[:, step : step + 1].to(cdf.dtype) * cdf[:, -1:]
            token = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
            active = ~done
            ids[rows[active], lengths[active]] = token[active]
            lengths += active.long()
            done |= active & (token == eos_id)
    finally:
        model.train()
    ids, start, lengths = ids.cpu(), start.tolist(), lengths.tolist()
    return [ids[r, start[r] : lengths[r]].tolist() for r in range(b)]


class Sampler:
    """Rollouts of the task from the current model; each DP rank samples its own contiguous
    slice of the global batch, and the rewards of all go into the GRPO advantages."""

    def __init__(self, run: Any, tokenizer: ByteTokenizer) -> None:
        from megatron.core import parallel_state as ps

        self.run, self.args, self.tok = run, run.args, tokenizer
        self.dp_group = ps.get_data_parallel_group()
        # The KL reference is the initial policy: a second copy of the seeded weights.
        self.ref = None
        if self.args.kl_coef > 0:
            self.ref = build_model(self.args, tokenizer.padded_vocab_size(8))[0][0]

    def rollouts(self, iteration: int) -> tuple[dict, dict]:
        """This rank's batch for ``iteration`` (0-based) and the global sampling stats."""
        run, args, tok = self.run, self.args, self.tok
        prompts = task_prompts(iteration, args, tok)
        gen = torch.Generator().manual_seed(_iteration_seed(args.seed, iteration) + 1)
        noise = torch.rand(len(prompts), args.max_new_tokens, generator=gen, dtype=torch.float64)
        per_rank = args.global_batch_size // run.dp
        mine = slice(run.dp_rank * per_rank, (run.dp_rank + 1) * per_rank)
        local = prompts[mine]
        responses = sample(
            run.chunks[0], [p for p, _ in local], noise[mine].to(run.device),
            width0=max(len(p) for p, _ in prompts), temperature=args.temperature,
            eos_id=tok.eos_id, pad_id=tok.pad_id, tp=args.tensor_model_parallel_size,
        )  # fmt: skip
        stats = torch.tensor(
            [[task_reward(resp, allowed, tok.eos_id, args.max_new_tokens), len(resp)]
             for resp, (_, allowed) in zip(responses, local, strict=True)],
            dtype=torch.float64, device=run.device,
        )  # fmt: skip
        # Groups may straddle DP ranks: every rank needs all rewards for the advantages.
        gathered = [torch.empty_like(stats) for _ in range(run.dp)]
        dist.all_gather(gathered, stats, group=self.dp_group)
        stats = torch.cat(gathered).cpu()
        rewards = stats[:, 0]
        advantages = grpo_advantages(
            rewards, group_size=args.num_generations, scale_by_std=not args.no_std_normalization
        )
        records = [
            {"prompt_ids": p, "response_ids": resp, "advantage": float(a)}
            for (p, _), resp, a in zip(local, responses, advantages[mine].tolist(), strict=True)
        ]
        batch = encode_rollouts(records, args.seq_length, tok.pad_id, with_ref=False)
        # Prompt groups (--loss-reduction group_mean) are G consecutive sequences of the global
        # batch.
        batch["group_ids"] = torch.arange(len(prompts))[mine] // args.num_generations
        batch = {k: v.to(run.device) for k, v in batch.items()}
        if self.ref is not None:  # log-probs of the labels under the frozen reference
            self.ref.eval()
            with torch.no_grad():
                logits = self.ref(batch["tokens"], batch["position_ids"], None).float()
                batch["ref_logprobs"], _ = vocab_parallel_logprobs_entropy(
                    logits / args.temperature, batch["labels"], tp_group=run.tp_group
                )
        summary = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "response_length_mean": float(stats[:, 1].mean()),
            # One example per step to eyeball (rank 0 samples the global batch's first prompt).
            "sample": tok.decode(local[0][0]) + " -> " + repr(tok.decode(responses[0])),
        }
        return batch, summary
