"""Policy-gradient (GRPO / PPO / GSPO) updates of a small GPT on Megatron-Core with exact,
layout-invariant loss normalization (megatron_lossfix). Runs on CPU (gloo) when no GPU is
present, NCCL otherwise.

Where the rollouts come from:

* ``--rollouts PATH`` replays fixed rollouts, a JSONL file of
  ``{"prompt_ids": [int], "response_ids": [int], "advantage": float}`` records, optionally with
  ``"old_logprobs"`` and ``"ref_logprobs"`` (one float per response token). Iteration i trains
  on records ``i*B .. i*B+B-1`` (B = ``--global-batch-size``, wrapping around the file), the same
  sequences in the same order under every layout. Without ``old_logprobs`` a record is on-policy
  (its ratio is 1); ``--kl-coef`` > 0 needs ``ref_logprobs`` on every record. Consecutive
  records with the same ``prompt_ids`` form a prompt group (``--loss-reduction group_mean``).
* Without it, the model samples ``--num-generations`` responses to each of
  ``--prompts-per-step`` prompts of an embedded task (plain autoregressive sampling, PP=1 and
  CP=1), scores them, and takes GRPO advantages (reward minus its group's mean, over the group's
  std unless ``--no-std-normalization``); a prompt's responses are its group for
  ``--loss-reduction group_mean``. The task: each prompt names a character class and
  shows one byte of it ("digits: 7", "lowercase: q", "uppercase: K"); the reward is the fraction
  of the ``--max-new-tokens`` response positions holding a byte of that class (an early
  end-of-text leaves the rest at 0). The initial model scores about 0.1; with the default flags
  it reaches about 1.0 in 150 iterations (about 2 minutes on 2 CPU cores).

Per micro-batch the model returns logits (no labels) and the loss function is
``megatron_lossfix.rl.objective.rl_loss``: ``vocab_parallel_logprobs_entropy`` turns the logits into
the target log-probs and entropies (TP-correct), and ``rl_objective`` returns the weighted sum
``sum(w * (pg + kl_coef * KL - entropy_coef * H))`` with the plugin's weights, so every term is
normalized once, globally. Each iteration logs one line like Megatron-LM and, with
``--metrics-out``, appends one JSON object (rank 0): docs/design.md §5's fields plus pg_loss, kl
(null without a reference), entropy (weighted like the loss), clip_frac_low/high and
dual_clip_frac (per loss token), ratio_mean/min/max and, when sampling, reward_mean,
reward_std, response_length_mean, rollout_time_s (included in step_time_s) and one decoded
sample.

Launch:
    # the embedded task: watch "reward:" rise from about 0.1 to about 1.0
    torchrun --standalone --nproc-per-node 1 examples/grpo_gpt.py
    # replayed rollouts under two layouts: their loss and grad norm agree to ~1e-7
    torchrun --standalone --nproc-per-node 1 examples/grpo_gpt.py --rollouts r.jsonl \
        --micro-batch-size 12 --global-batch-size 12 --train-iters 3 --metrics-out out/a.jsonl
    torchrun --standalone --nproc-per-node 2 examples/grpo_gpt.py --rollouts r.jsonl \
        --micro-batch-size 2 --global-batch-size 12 --train-iters 3 --metrics-out out/b.jsonl
Add --loss-reduction off to see stock Megatron disagree with itself.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_lossfix import grpo_advantages, slice_batch_for_cp, vocab_parallel_logprobs_entropy
from megatron_lossfix.rl.objective import KL_KINDS, POLICY_LOSSES, rl_loss

# `common` and `byte_data` sit beside this script: on sys.path when the script runs as a file, but
# not when a test imports the script by path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_data import ByteTokenizer, iter_jsonl, microbatches  # noqa: E402
from common import (  # noqa: E402
    ExampleArgumentParser,
    ExampleRun,
    UsageError,
    add_common_args,
    add_lossfix_flags,
    build_model,
    check_launch,
    finite_float,
    non_negative_float,
    one_line_errors,
    positive_int,
    stock_reported,
)

from megatron_lossfix.args import positive_float  # noqa: E402

PROG = "grpo_gpt.py"

#: The embedded task: (class name, bytes that earn reward). A prompt names the class and ends
#: with one example byte of it ("digits: 7"), so the first response byte can already follow from
#: the last prompt byte, and every later one from its predecessor: a tiny model learns it fast.
TASKS: tuple[tuple[str, bytes], ...] = (
    ("digits", b"0123456789"),
    ("lowercase", b"abcdefghijklmnopqrstuvwxyz"),
    ("uppercase", b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
)

#: Sequences per step in --rollouts mode when --global-batch-size is not given.
DEFAULT_ROLLOUT_BATCH = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ExampleArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    rl = parser.add_argument_group("reinforcement learning")
    _add_objective_args(rl)
    _add_sampling_args(rl)
    add_lossfix_flags(parser)
    # Sampling re-runs the whole prefix once per new token: a small model and short sequences.
    parser.set_defaults(
        num_layers=2,
        seq_length=32,
        global_batch_size=None,
        micro_batch_size=16,
        train_iters=150,
        lr=2e-3,
    )
    args = parser.parse_args(argv)
    _resolve_batch(parser, args)
    return args


def _add_objective_args(rl: argparse._ArgumentGroup) -> None:
    """Where the rollouts come from and the policy-gradient objective scored on them."""
    rl.add_argument(
        "--rollouts",
        default=None,
        help='JSONL of {"prompt_ids", "response_ids", "advantage"} records (optionally '
        '"old_logprobs", "ref_logprobs") to replay; default: sample from the model',
    )
    rl.add_argument(
        "--policy-loss",
        choices=POLICY_LOSSES,
        default="ppo",
        help="ppo: clipped token ratio; gspo: clipped sequence ratio (geometric mean over the "
        "sequence's loss tokens)",
    )
    rl.add_argument(
        "--clip-eps-low", type=non_negative_float, default=0.2, help="ratio clip below: 1 - eps"
    )
    rl.add_argument(
        "--clip-eps-high", type=non_negative_float, default=0.2, help="ratio clip above: 1 + eps"
    )
    rl.add_argument(
        "--dual-clip-c",
        type=finite_float,
        default=None,
        help="dual-clip PPO: bound the loss of negative-advantage tokens at -A*c (c > 1; ppo only)",
    )
    rl.add_argument(
        "--kl-coef",
        type=non_negative_float,
        default=0.0,
        help="weight of the KL penalty toward the reference policy (the rollouts' ref_logprobs; "
        "when sampling, the initial weights)",
    )
    rl.add_argument(
        "--kl-estimator",
        choices=KL_KINDS,
        default="k3",
        help="per-token KL estimator (Schulman): k1 = log ratio, k2 = half its square, k3 unbiased",
    )
    rl.add_argument(
        "--entropy-coef", type=non_negative_float, default=0.0, help="weight of the entropy bonus"
    )


def _add_sampling_args(rl: argparse._ArgumentGroup) -> None:
    """How responses are sampled when no --rollouts are replayed, and their advantages."""
    rl.add_argument(
        "--num-generations", type=positive_int, default=16, help="G: sampled responses per prompt"
    )
    rl.add_argument(
        "--max-new-tokens", type=positive_int, default=8, help="most tokens sampled per response"
    )
    rl.add_argument(
        "--temperature",
        type=positive_float,
        default=1.0,
        help="sampling temperature; the loss scores the same tempered policy (logits / T)",
    )
    rl.add_argument(
        "--prompts-per-step",
        type=positive_int,
        default=None,
        help="prompts sampled per step; --global-batch-size is this times --num-generations "
        "(default: --global-batch-size / --num-generations, or 4 prompts)",
    )
    rl.add_argument(
        "--no-std-normalization",
        action="store_true",
        help="Dr. GRPO: advantages are reward minus group mean, not divided by the group std "
        "(pair with --loss-reduction seq_mean_token_sum_norm for the full recipe)",
    )


def _resolve_batch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the RL flags and settle --global-batch-size against prompts x generations."""
    if not args.clip_eps_low < 1:
        parser.error(
            f"--clip-eps-low must be < 1 (the ratio is clipped at 1 - eps), got {args.clip_eps_low}"
        )
    if args.dual_clip_c is not None and args.policy_loss != "ppo":
        parser.error("--dual-clip-c applies to --policy-loss ppo only")
    if args.dual_clip_c is not None and not args.dual_clip_c > 1:
        parser.error(f"--dual-clip-c must be > 1, got {args.dual_clip_c}")
    if args.rollouts is not None:
        if args.global_batch_size is None:
            args.global_batch_size = DEFAULT_ROLLOUT_BATCH
        return
    g = args.num_generations
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        parser.error(
            "sampling needs --pipeline-model-parallel-size 1 and --context-parallel-size 1 "
            "(the whole model and sequence on each rank); replay rollouts with --rollouts "
            "to train under PP or CP"
        )
    width0 = _prompt_width()
    if width0 + args.max_new_tokens - 1 > args.seq_length:
        parser.error(
            f"--seq-length {args.seq_length} is too short for prompts of {width0} tokens "
            f"plus --max-new-tokens {args.max_new_tokens}; use at least "
            f"{width0 + args.max_new_tokens - 1}"
        )
    if args.prompts_per_step is None:
        if args.global_batch_size is None:
            args.prompts_per_step = 4
        elif args.global_batch_size % g:
            parser.error(
                f"--global-batch-size {args.global_batch_size} must be a multiple of "
                f"--num-generations {g} when sampling"
            )
        else:
            args.prompts_per_step = args.global_batch_size // g
    expected = args.prompts_per_step * g
    if args.global_batch_size is None:
        args.global_batch_size = expected
    if args.global_batch_size != expected or args.prompts_per_step < 1:
        parser.error(
            f"--global-batch-size {args.global_batch_size} must equal --prompts-per-step "
            f"{args.prompts_per_step} x --num-generations {g} = {expected}"
        )


def _prompt_width() -> int:
    """Tokens of the longest embedded-task prompt: bos + "name: " + one example byte."""
    return max(len(f"{name}: ") + 2 for name, _ in TASKS)


# ------------------------------------------------------------------ rollouts as training data


def _int_list(record: dict, key: str, where: str, vocab: int) -> list[int]:
    value = record.get(key)
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"{where}: {key!r} must be a list of token ids")
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"{where}: {key!r} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        )
    return value


def _float_list(record: dict, key: str, where: str, length: int) -> list[float] | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in value
    ):
        raise ValueError(f"{where}: {key!r} must be a list of numbers")
    if len(value) != length:
        raise ValueError(
            f"{where}: {key!r} has {len(value)} entries but there are {length} response tokens "
            "(one log-prob per response token)"
        )
    return [float(x) for x in value]


def load_rollouts(path: str, *, vocab: int, seq_length: int, need_ref: bool) -> list[dict]:
    """Validated rollout records of a JSONL file (blank lines skipped).

    Raises ``ValueError`` naming the line for malformed JSON, missing or ill-typed fields,
    out-of-vocabulary ids, log-prob lists of the wrong length, a sequence longer than
    ``seq_length + 1`` tokens, or (``need_ref``) a record without ``ref_logprobs``.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for record, where in iter_jsonl(text, path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {record!r:.100}")
        prompt = _int_list(record, "prompt_ids", where, vocab)
        response = _int_list(record, "response_ids", where, vocab)
        if not prompt:
            raise ValueError(
                f"{where}: 'prompt_ids' is empty (the first response token is "
                "predicted from the prompt's last token)"
            )
        advantage = record.get("advantage")
        if (
            isinstance(advantage, bool)
            or not isinstance(advantage, (int, float))
            or not (math.isfinite(advantage))
        ):
            raise ValueError(f"{where}: 'advantage' must be a finite number, got {advantage!r}")
        # The model reads prompt + response minus the last token; truncating would drop loss
        # tokens silently.
        if len(prompt) + len(response) - 1 > seq_length:
            raise ValueError(
                f"{where}: prompt + response is {len(prompt) + len(response)} tokens, longer "
                f"than --seq-length {seq_length} + 1"
            )
        ref = _float_list(record, "ref_logprobs", where, len(response))
        if need_ref and ref is None:
            raise ValueError(
                f'{where}: --kl-coef > 0 needs "ref_logprobs" on every rollout (or set --kl-coef 0)'
            )
        records.append(
            {
                "prompt_ids": prompt,
                "response_ids": response,
                "advantage": float(advantage),
                "old_logprobs": _float_list(record, "old_logprobs", where, len(response)),
                "ref_logprobs": ref,
            }
        )
    if not records:
        raise ValueError(f"{path}: no rollouts (the file is empty)")
    return records


def encode_rollouts(
    records: list[dict], seq_length: int, pad_id: int, *, with_ref: bool
) -> dict[str, torch.Tensor]:
    """Rollouts as one batch of ``[len(records), seq_length]`` tensors for next-token training.

    Row = prompt + response, cut by one (``tokens``) and shifted by one (``labels``): label j is
    token j + 1, so response token k is predicted at position ``len(prompt) - 1 + k``, where the
    loss mask is 1 and the advantage and the record's log-probs sit. ``has_old_logprobs`` is 1
    where ``old_logprobs`` holds a recorded value; elsewhere (on-policy records) the loss uses
    the current log-prob. (A 0/1 flag rather than NaN: ``--lossfix-check-finite`` rejects
    non-finite inputs.)
    """
    n = len(records)
    tokens = torch.full((n, seq_length), pad_id, dtype=torch.int64)
    labels = torch.full_like(tokens, pad_id)
    mask = torch.zeros(n, seq_length)
    advantages = torch.zeros(n, seq_length)
    old = torch.zeros(n, seq_length)
    has_old = torch.zeros(n, seq_length)
    ref = torch.zeros(n, seq_length)
    for i, rec in enumerate(records):
        ids = rec["prompt_ids"] + rec["response_ids"]
        tokens[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        labels[i, : len(ids) - 1] = torch.tensor(ids[1:])
        span = slice(len(rec["prompt_ids"]) - 1, len(ids) - 1)
        mask[i, span] = 1.0
        advantages[i, span] = rec["advantage"]
        if rec.get("old_logprobs") is not None:
            old[i, span] = torch.tensor(rec["old_logprobs"])
            has_old[i, span] = 1.0
        if with_ref and rec.get("ref_logprobs") is not None:
            ref[i, span] = torch.tensor(rec["ref_logprobs"])
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(seq_length).expand(n, -1).contiguous(),
        "loss_mask": mask,
        "advantages": advantages,
        "old_logprobs": old,
        "has_old_logprobs": has_old,
    }
    if with_ref:
        batch["ref_logprobs"] = ref
    return batch


def prompt_groups(records: list[dict]) -> tuple[torch.Tensor, int]:
    """Each record's prompt group in a global batch, for ``--loss-reduction group_mean``: runs
    of consecutive records with the same ``prompt_ids`` (a prompt's responses, as GRPO writes
    them), numbered from 0; and their number."""
    ids, group = [], -1
    for k, rec in enumerate(records):
        if k == 0 or rec["prompt_ids"] != records[k - 1]["prompt_ids"]:
            group += 1
        ids.append(group)
    return torch.tensor(ids), group + 1


def with_group_range(mbs: list[dict], num_groups: int) -> list[dict]:
    """The micro-batches with the step's group count, which the plugin's group modes read
    beside each micro-batch's ``group_ids``."""
    return [{**mb, "num_groups": num_groups} for mb in mbs]


def replay_batch(records: list[dict], iteration: int, global_batch_size: int) -> list[dict]:
    """The records of ``iteration`` (0-based): the next ``global_batch_size`` in file order."""
    start = iteration * global_batch_size
    return [records[(start + k) % len(records)] for k in range(global_batch_size)]


# ------------------------------------------------------------------ the loss


class LossContext(NamedTuple):
    """What the loss function needs besides the micro-batch: RL flags and process groups."""

    args: argparse.Namespace
    tp_group: Any
    cp_group: Any  # None without context parallelism


def forward_step(ctx: LossContext, data_iterator, model):
    """Megatron forward_step: whole sequences come in; with CP each rank keeps its shard of every
    per-token tensor (the plugin's weights included), Megatron-LM's convention."""
    batch = next(data_iterator)
    if ctx.cp_group is not None:
        batch = slice_batch_for_cp(batch, ctx.cp_group)
    # Without labels GPTModel returns the vocab-parallel logits [b, s, V/TP].
    output = model(batch["tokens"], batch["position_ids"], None)
    args = ctx.args
    objective = {
        "policy_loss": args.policy_loss,
        "eps_low": args.clip_eps_low,
        "eps_high": args.clip_eps_high,
        "dual_clip_c": args.dual_clip_c,
        "kl_coef": args.kl_coef,
        "kl_kind": args.kl_estimator,
        "entropy_coef": args.entropy_coef,
    }
    # (sum(w * objective), loss tokens on this rank, stats that step_metrics reduces)
    loss_func = partial(
        rl_loss,
        batch,
        tp_group=ctx.tp_group,
        cp_group=ctx.cp_group,
        temperature=args.temperature,
        objective=objective,
    )
    return output, stock_reported(batch, loss_func)


def rl_metrics(metrics: dict, reduction: str, has_ref: bool) -> dict:
    """The RL numbers of a step from ``step_metrics``: weighted terms of the loss, and
    per-token fractions and ratio statistics over the step's loss tokens."""
    n = metrics["num_tokens"]
    # With `off` the weights are the loss mask, so the weighted sums are token sums: report
    # token means, comparable with the plugin's token_mean.
    norm = max(n, 1) if reduction == "off" else 1.0

    def finite(x: float) -> float | None:  # min/max of a step without loss tokens are +-inf
        return x if math.isfinite(x) else None

    return {
        "pg_loss": metrics["pg_loss_sum"] / norm,
        "kl": metrics["kl_sum"] / norm if has_ref else None,
        "entropy": metrics["entropy_sum"] / norm,
        "clip_frac_low": metrics["clip_low_count"] / max(n, 1),
        "clip_frac_high": metrics["clip_high_count"] / max(n, 1),
        "dual_clip_frac": metrics["dual_clip_count"] / max(n, 1),
        "ratio_mean": metrics["ratio_sum"] / max(n, 1) if n else None,
        "ratio_min": finite(metrics["ratio_min"]),
        "ratio_max": finite(metrics["ratio_max"]),
    }


# ------------------------------------------------------------------ sampling mode


def task_prompts(iteration: int, args: argparse.Namespace, tokenizer: ByteTokenizer) -> list:
    """The global batch's prompts of ``iteration``: ``(prompt_ids, rewarded bytes)`` per
    sequence, each prompt repeated G times (groups are contiguous)."""
    gen = torch.Generator().manual_seed(_iteration_seed(args.seed, iteration))
    picks = torch.randint(len(TASKS), (args.prompts_per_step,), generator=gen).tolist()
    out = []
    for k in picks:
        name, allowed = TASKS[k]
        example = allowed[int(torch.randint(len(allowed), (), generator=gen))]
        prompt = [tokenizer.bos_id, *tokenizer.encode(f"{name}: "), example]
        out += [(prompt, frozenset(allowed))] * args.num_generations
    return out


def _iteration_seed(seed: int, iteration: int) -> int:
    # Its own generator per iteration: sampling never touches the global RNG (which Megatron's
    # RNG tracker and other layouts may consume differently).
    return (seed * 0x9E3779B97F4A7C15 + 7919 * iteration + 1) % 2**63


def task_reward(response: list[int], allowed: frozenset[int], eos_id: int, max_new: int) -> float:
    """Fraction of the ``max_new`` response positions holding a rewarded byte (0 after eos)."""
    body = response[:-1] if response and response[-1] == eos_id else response
    return sum(t in allowed for t in body) / max_new


@torch.no_grad()
def sample(
    model,
    prompts: list[list[int]],
    noise: torch.Tensor,
    *,
    width0: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    tp: int,
) -> list[list[int]]:
    """Sample one response per prompt, token by token, re-running the whole prefix each step.

    ``noise`` is ``[len(prompts), max_new]`` uniform: token = inverse CDF of softmax(logits / T)
    at the noise, so the draws belong to the sequence, not to the rank that samples it. Every
    rank runs the same ``width0 + step`` columns per step (right padding is invisible to causal
    attention), so ranks meeting in collectives (TP, EP) see equal shapes. A response ends after
    eos or ``max_new`` tokens; eos is part of it.
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, max_new = noise.shape
    device = noise.device
    ids = torch.full((b, width0 + max_new), pad_id, dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    ids = ids.to(device)
    start = torch.tensor([len(p) for p in prompts], device=device)
    lengths = start.clone()
    done = torch.zeros(b, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device)
    model.eval()
    try:
        for step in range(max_new):
            width = width0 + step
            positions = torch.arange(width, device=device).expand(b, -1)
            logits = model(ids[:, :width], positions, None)  # [b, width, V/TP]
            if tp > 1:
                logits = gather_from_tensor_model_parallel_region(logits)
            last = logits[rows, lengths - 1].double() / temperature
            cdf = torch.softmax(last, dim=-1).cumsum(dim=-1)
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


@torch.no_grad()
def reference_logprobs(ref_chunks: list, batch: dict, args, tp_group) -> torch.Tensor:
    """Log-probs of the labels under the frozen reference (the initial weights), ``[b, s]``."""
    ref_chunks[0].eval()
    logits = ref_chunks[0](batch["tokens"], batch["position_ids"], None).float()
    logprobs, _ = vocab_parallel_logprobs_entropy(
        logits / args.temperature, batch["labels"], tp_group=tp_group
    )
    return logprobs


class Sampler:
    """Sampling mode: prompts of the embedded task, responses from the current model, rewards,
    GRPO advantages; each DP rank samples its own contiguous slice of the global batch."""

    def __init__(self, run: ExampleRun, tp_group: Any):
        from megatron.core import parallel_state as ps

        args = run.args
        self.run, self.args, self.tp_group = run, args, tp_group
        self.dp_group = ps.get_data_parallel_group()
        # parse_args has checked that prompt + --max-new-tokens fits --seq-length.
        # The KL reference is the initial policy: a second copy of the seeded weights.
        self.ref_chunks = None
        if args.kl_coef > 0:
            self.ref_chunks, _ = build_model(args, run.layout, run.tokenizer)

    def rollouts(self, iteration: int) -> tuple[dict, dict]:
        """This rank's batch for ``iteration`` and the global sampling stats."""
        run, args, tok = self.run, self.args, self.run.tokenizer
        prompts = task_prompts(iteration, args, tok)
        gen = torch.Generator().manual_seed(_iteration_seed(args.seed, iteration) + 1)
        noise = torch.rand(len(prompts), args.max_new_tokens, generator=gen, dtype=torch.float64)
        per_rank = args.global_batch_size // run.dp
        mine = slice(run.dp_rank * per_rank, (run.dp_rank + 1) * per_rank)
        local = prompts[mine]
        width0 = max(len(p) for p, _ in prompts)
        responses = sample(
            run.chunks[0],
            [p for p, _ in local],
            noise[mine].to(run.device),
            width0=width0,
            temperature=args.temperature,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            tp=run.layout.tp,
        )
        local_stats = torch.tensor(
            [
                [task_reward(resp, allowed, tok.eos_id, args.max_new_tokens), len(resp)]
                for resp, (_, allowed) in zip(responses, local, strict=True)
            ],
            dtype=torch.float64,
            device=run.device,
        )
        # Groups may straddle DP ranks: every rank needs all rewards for the advantages.
        gathered = [torch.empty_like(local_stats) for _ in range(run.dp)]
        dist.all_gather(gathered, local_stats, group=self.dp_group)
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
        # Prompt groups are G consecutive sequences of the global batch.
        batch["group_ids"] = torch.arange(len(prompts))[mine] // args.num_generations
        batch = {k: v.to(run.device) for k, v in batch.items()}
        if self.ref_chunks is not None:
            batch["ref_logprobs"] = reference_logprobs(self.ref_chunks, batch, args, self.tp_group)
        summary = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "response_length_mean": float(stats[:, 1].mean()),
            # One example per step to eyeball (rank 0 samples the global batch's first prompt).
            "sample": tok.decode(local[0][0]) + " -> " + repr(tok.decode(responses[0])),
        }
        return batch, summary


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    with one_line_errors(PROG):
        args = parse_args(argv)
        # Every mistake that can be seen before start-up is reported before it.
        check_launch(args)
        if args.mtp_num_layers:
            raise UsageError(
                "--mtp-num-layers is for examples/pretrain_gpt.py: the policy loss here reads "
                "the model's logits, and Megatron computes MTP losses only from labels"
            )
        records = None
        if args.rollouts is not None:
            try:
                records = load_rollouts(
                    args.rollouts,
                    vocab=ByteTokenizer().padded_vocab_size(8),
                    seq_length=args.seq_length,
                    need_ref=args.kl_coef > 0,
                )
            except OSError as exc:
                raise UsageError(f"--rollouts {args.rollouts}: {exc.strerror or exc}") from None
        train(args, records)


def train(args: argparse.Namespace, records: list[dict] | None) -> None:
    """Replay ``records`` (``--rollouts``), or sample from the model when it is None."""
    run = ExampleRun.start(args)
    from megatron.core import parallel_state as ps

    ctx = LossContext(
        args=args, tp_group=ps.get_tensor_model_parallel_group(), cp_group=run.cp_group
    )
    tok = run.tokenizer
    if records is not None:
        # KL is reported whenever every record has a reference; it enters the loss via kl_coef.
        has_ref = all(r["ref_logprobs"] is not None for r in records)
        sampler = None
        empty = sum(not r["response_ids"] for r in records)
        run.banner(rollouts=len(records), **({"empty_responses": empty} if empty else {}))
    else:
        sampler = Sampler(run, ctx.tp_group)
        has_ref = args.kl_coef > 0
        run.banner(task="embedded", prompts=args.prompts_per_step, G=args.num_generations)
    step = partial(forward_step, ctx)
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        extra: dict[str, Any] = {}
        if sampler is None:
            chosen = replay_batch(records, iteration - 1, args.global_batch_size)
            # A rollout without response tokens has no loss token: it trains on nothing.
            extra["no_loss_token_samples"] = sum(not r["response_ids"] for r in chosen)
            batch = encode_rollouts(chosen, args.seq_length, tok.pad_id, with_ref=has_ref)
            batch["group_ids"], num_groups = prompt_groups(chosen)
            mbs = microbatches(
                batch, dp_rank=run.dp_rank, dp_size=run.dp, micro_batch_size=args.micro_batch_size
            )
        else:
            batch, extra = sampler.rollouts(iteration - 1)
            extra["rollout_time_s"] = time.perf_counter() - start
            # Already this rank's slice: contiguous micro-batches of it.
            mbs = microbatches(batch, dp_rank=0, dp_size=1, micro_batch_size=args.micro_batch_size)
            num_groups = args.prompts_per_step
        mbs = with_group_range(mbs, num_groups)
        grad_norm, metrics = run.train_step(step, mbs)
        rl = rl_metrics(metrics, run.config.reduction, has_ref)
        log_items = [] if sampler is None else [("reward", f"{extra['reward_mean']:.4f}")]
        if extra.get("no_loss_token_samples"):
            log_items.append(("no loss tokens", str(extra["no_loss_token_samples"])))
        log_items += [
            ("pg loss", f"{rl['pg_loss']:.6E}"),
            ("entropy", f"{rl['entropy']:.4f}"),
        ]
        if has_ref:
            log_items.append(("kl", f"{rl['kl']:.4E}"))
        log_items.append(
            ("clip frac (low/high)", f"{rl['clip_frac_low']:.4f}/{rl['clip_frac_high']:.4f}")
        )
        run.report(
            iteration,
            time.perf_counter() - start,
            grad_norm,
            metrics,
            loss_name="loss",
            record={**rl, **extra},
            log_items=log_items,
        )
    run.finish()


if __name__ == "__main__":
    main()
