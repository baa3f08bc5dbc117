"""Policy-gradient (GRPO / PPO / GSPO) updates of a small GPT on Megatron-Core with exact,
layout-invariant loss normalization (megatron_lossfix). Runs on CPU (gloo) when no GPU is
present, NCCL otherwise.

    # the embedded task (grpo_task.py): "reward:" rises from about 0.1 to about 1.0
    torchrun --standalone --nproc-per-node 1 examples/grpo_gpt.py
    # fixed rollouts (rollouts.py) under two layouts: loss and grad norm agree to ~1e-7
    torchrun --standalone --nproc-per-node 1 examples/grpo_gpt.py --rollouts r.jsonl \
        --micro-batch-size 12 --global-batch-size 12 --train-iters 3 --metrics-out out/a.jsonl
    torchrun --standalone --nproc-per-node 2 examples/grpo_gpt.py --rollouts r.jsonl \
        --micro-batch-size 2 --global-batch-size 12 --train-iters 3 --metrics-out out/b.jsonl

The model returns logits; the loss is ``megatron_lossfix.rl.objective.rl_loss``: vocab-parallel
log-probs and entropies, then ``sum(w * (pg + kl_coef * KL - entropy_coef * H))`` with the
plugin's weights, so every term is normalized once, globally. The metrics record adds pg_loss,
kl, entropy, clip_frac_low/high, dual_clip_frac, ratio_mean/min/max and, when sampling,
reward_mean/std, response_length_mean, rollout_time_s and one decoded sample.
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial

from byte_data import ByteTokenizer, microbatches
from gpt_model import add_model_args
from grpo_task import Sampler, prompt_width
from rollouts import encode_rollouts, load_rollouts, prompt_groups, replay_batch, with_group_range
from train_loop import Run, add_training_args, check_before_start, stock_reported
from usage import ExampleArgumentParser, exit_before_startup

from megatron_lossfix import slice_batch_for_cp
from megatron_lossfix.args import finite_float, non_negative_float, positive_float, positive_int
from megatron_lossfix.rl.objective import KL_KINDS, POLICY_LOSSES, rl_loss

PROG = "grpo_gpt.py"


def _add_rl_args(parser: argparse.ArgumentParser) -> None:
    # fmt: off
    rl = parser.add_argument_group("reinforcement learning").add_argument
    rl("--rollouts", default=None, help='JSONL of {"prompt_ids", "response_ids", "advantage"} '
       '(optionally "old_logprobs", "ref_logprobs") to replay; default: sample from the model')
    rl("--policy-loss", choices=POLICY_LOSSES, default="ppo", help="ppo: clipped token ratio; "
       "gspo: clipped sequence ratio (geometric mean over the sequence's loss tokens)")
    rl("--clip-eps-low", type=non_negative_float, default=0.2, help="ratio clip below: 1 - eps")
    rl("--clip-eps-high", type=non_negative_float, default=0.2, help="ratio clip above: 1 + eps")
    rl("--dual-clip-c", type=finite_float, default=None,
       help="dual-clip PPO: bound the loss of negative-advantage tokens at -A*c (c > 1; ppo)")
    rl("--kl-coef", type=non_negative_float, default=0.0, help="weight of the KL penalty toward "
       "the reference (the rollouts' ref_logprobs; when sampling, the initial weights)")
    rl("--kl-estimator", choices=KL_KINDS, default="k3", help="per-token KL estimator: k1 = log "
       "ratio, k2 = half its square, k3 unbiased (Schulman)")
    rl("--entropy-coef", type=non_negative_float, default=0.0, help="weight of the entropy bonus")
    rl("--num-generations", type=positive_int, default=16, help="G: responses per prompt")
    rl("--max-new-tokens", type=positive_int, default=8, help="most tokens sampled per response")
    rl("--temperature", type=positive_float, default=1.0, help="sampling temperature; the loss "
       "scores the same tempered policy (logits / T)")
    rl("--prompts-per-step", type=positive_int, default=None, help="prompts sampled per step: "
       "--global-batch-size / --num-generations (default: that, or 4)")
    rl("--no-std-normalization", action="store_true", help="Dr. GRPO: advantages are reward "
       "minus group mean, not divided by the group std")
    # fmt: on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a mistake in them is one line, before start-up."""
    parser = ExampleArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_training_args(parser)
    _add_rl_args(parser)
    # Sampling re-runs the whole prefix once per new token: a small model, short sequences.
    parser.set_defaults(num_layers=2, seq_length=32, global_batch_size=None, micro_batch_size=16,
                        train_iters=150, lr=2e-3)  # fmt: skip
    args = parser.parse_args(argv)
    error = parser.error
    if not args.clip_eps_low < 1:
        error(
            f"--clip-eps-low must be < 1 (the ratio is clipped at 1 - eps), got {args.clip_eps_low}"
        )
    if args.dual_clip_c is not None and (args.policy_loss != "ppo" or not args.dual_clip_c > 1):
        error("--dual-clip-c applies to --policy-loss ppo only, and must be > 1")
    if args.mtp_num_layers:
        error("--mtp-num-layers is for pretrain_gpt.py: Megatron computes MTP losses from labels")
    if args.rollouts is not None:
        args.global_batch_size = args.global_batch_size or 16
    else:  # sampling: the whole model and sequence on each rank
        if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
            error("sampling needs --pipeline-model-parallel-size 1 and --context-parallel-size 1; "
                  "replay rollouts with --rollouts to train under PP or CP")  # fmt: skip
        if prompt_width() + args.max_new_tokens - 1 > args.seq_length:
            error(f"--seq-length {args.seq_length} is too short for prompts of {prompt_width()} "
                  f"tokens plus --max-new-tokens {args.max_new_tokens}")  # fmt: skip
        g, gbs = args.num_generations, args.global_batch_size
        if args.prompts_per_step is None:
            if (gbs or 0) % g:
                error(f"--global-batch-size {gbs} must be a multiple of --num-generations {g}")
            args.prompts_per_step = gbs // g if gbs else 4
        if gbs not in (None, args.prompts_per_step * g):
            error(f"--global-batch-size {gbs} must equal --prompts-per-step x --num-generations")
        args.global_batch_size = args.prompts_per_step * g
    return args


def forward_step(run: Run, data_iterator, model):
    """Megatron's forward_step: under CP each rank keeps its shard of every per-token tensor."""
    batch = next(data_iterator)
    if run.cp_group is not None:
        batch = slice_batch_for_cp(batch, run.cp_group)
    output = model(batch["tokens"], batch["position_ids"], None)  # no labels: the logits
    a = run.args
    objective = dict(policy_loss=a.policy_loss, eps_low=a.clip_eps_low, eps_high=a.clip_eps_high,
                     dual_clip_c=a.dual_clip_c, kl_coef=a.kl_coef, kl_kind=a.kl_estimator,
                     entropy_coef=a.entropy_coef)  # fmt: skip
    # (sum(w * objective), this rank's loss tokens, statistics that step_metrics reduces)
    loss_func = partial(rl_loss, batch, tp_group=run.tp_group, cp_group=run.cp_group,
                        temperature=a.temperature, objective=objective)  # fmt: skip
    return output, stock_reported(batch, loss_func)


def rl_metrics(metrics: dict, reduction: str, has_ref: bool) -> dict:
    """The step's RL numbers: the loss's weighted terms, per-token fractions and ratios."""
    n = metrics["num_tokens"]
    # Under `off` the weights are the mask: report token means, comparable with token_mean.
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


def main(argv: list[str] | None = None) -> None:
    args, tok = parse_args(argv), ByteTokenizer()
    check_before_start(PROG, args)
    records = None
    if args.rollouts is not None:  # checked before start-up too: one line naming the line
        try:
            vocab, need_ref = tok.padded_vocab_size(8), args.kl_coef > 0
            records = load_rollouts(args.rollouts, vocab=vocab, seq_length=args.seq_length,
                                    need_ref=need_ref)  # fmt: skip
        except (OSError, ValueError) as exc:
            why = f"--rollouts {args.rollouts}: {exc.strerror}" if isinstance(exc, OSError) else exc
            exit_before_startup(PROG, str(why))
    run = Run(args, tok.padded_vocab_size(8))
    sampler = Sampler(run, tok) if records is None else None
    # KL is reported whenever every record has a reference; it enters the loss via kl_coef.
    has_ref = args.kl_coef > 0
    if records is not None:
        has_ref = all(r["ref_logprobs"] is not None for r in records)
    run.banner(**({"rollouts": len(records)} if records else {"task": "embedded"}))
    for iteration in range(1, args.train_iters + 1):
        start, extra = time.perf_counter(), {}
        if sampler is None:
            chosen = replay_batch(records, iteration - 1, args.global_batch_size)
            # A rollout without response tokens has no loss token: it trains on nothing.
            extra["no_loss_token_samples"] = sum(not r["response_ids"] for r in chosen)
            batch = encode_rollouts(chosen, args.seq_length, tok.pad_id, with_ref=has_ref)
            batch["group_ids"], num_groups = prompt_groups(chosen)
            mbs = microbatches(batch, dp_rank=run.dp_rank, dp_size=run.dp,
                               micro_batch_size=args.micro_batch_size)  # fmt: skip
        else:  # already this rank's slice: contiguous micro-batches of it
            batch, extra = sampler.rollouts(iteration - 1)
            extra["rollout_time_s"] = time.perf_counter() - start
            mbs = microbatches(batch, dp_rank=0, dp_size=1, micro_batch_size=args.micro_batch_size)
            num_groups = args.prompts_per_step
        mbs = with_group_range(mbs, num_groups)
        grad_norm, metrics = run.step(partial(forward_step, run), mbs)
        rl = rl_metrics(metrics, run.schedule.config.reduction, has_ref)
        items = [] if sampler is None else [("reward", f"{extra['reward_mean']:.4f}")]
        if extra.get("no_loss_token_samples"):
            items.append(("no loss tokens", str(extra["no_loss_token_samples"])))
        items += [("pg loss", f"{rl['pg_loss']:.6E}"), ("entropy", f"{rl['entropy']:.4f}")]
        items += [("kl", f"{rl['kl']:.4E}")] if has_ref else []
        clip = f"{rl['clip_frac_low']:.4f}/{rl['clip_frac_high']:.4f}"
        items.append(("clip frac (low/high)", clip))
        run.report(iteration, time.perf_counter() - start, grad_norm, metrics, loss_name="loss",
                   record={**rl, **extra}, log_items=items)  # fmt: skip
    run.finish()


if __name__ == "__main__":
    main()
