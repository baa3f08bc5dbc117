"""Replay fixed rollouts through Megatron-LM's own RL loop (``train_rl.py``) on any machine.

``train_rl.py`` trains GRPO on rollouts its inference engine generates (CUDA, agents over
loopback HTTP). This module replays fixed ones instead, so that the RL step, stock or through
the plugin, runs on a CPU (gloo): run by ``torchrun -m`` in place of ``train_rl.py`` (with
``train_rl.py``'s flags), it replaces ``megatron.rl.rl_utils.get_environment_rollouts`` by a
function that returns the ``TokenRollout`` groups of a *plan*, gives the RL code a small
tokenizer (pad and EOD ids, as Megatron-LM's own RL unit tests do), and runs the checkout's
``train_rl.py`` as ``__main__``: everything else is Megatron-LM's own code (patched by
``python -m megatron_lossfix.patches apply``, which also makes it run on CPU).

Its parts, one module each:

- :mod:`~megatron_lossfix.integrations.megatron_lm.rl_plans`: the plan (a JSON file named by
  ``LOSSFIX_RL_PLAN``: the rollouts of each iteration and the mode of its step), the rollout
  sets and the ``train_rl.py`` flags of the runs;
- this module: the rank side, which installs the plan's rollouts, tokenizer and modes;
- :mod:`~megatron_lossfix.integrations.megatron_lm.rl_records`: what each step records (a JSON
  line, the gradient and parameters, the plugin's weights) and :func:`read_records`;
- :mod:`~megatron_lossfix.integrations.megatron_lm.rl_compare`: :func:`compare`.

The names of those modules are importable from here too.

Commands (``python -m megatron_lossfix rl-replay ...``, or ``-m`` this module)::

    write-plan PLAN MEGATRON_LM_PATH [--set NAME]   # one iteration of the rollout set NAME
    compare MEGATRON_LM_PATH [--set NAME] [--loss-reduction MODE] [--calculate-per-token-loss]
    <train_rl.py flags>                             # a rank (under torchrun, LOSSFIX_RL_PLAN set)

``compare`` runs stock Megatron-LM and the plugin on 1 rank and on 2 data-parallel ranks
(:func:`compare`) and prints what each step trained and their relative differences.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_lossfix.integrations.megatron_lm import rl_compare as megatron_lm_rl_compare
from megatron_lossfix.integrations.megatron_lm.rl_compare import compare
from megatron_lossfix.integrations.megatron_lm.rl_plans import (
    MODULE,
    PLAN_ENV,
    SEQ_LENGTH,
    SETS,
    VOCAB_SIZE,
    checkout_null_tokenizer_eod,
    rl_args,
    rollout_sets,
    write_plan,
)
from megatron_lossfix.integrations.megatron_lm.rl_records import read_records, recording_train_step

__all__ = [
    "MODULE",
    "PLAN_ENV",
    "SEQ_LENGTH",
    "SETS",
    "VOCAB_SIZE",
    "MockTokenizer",
    "checkout_null_tokenizer_eod",
    "compare",
    "main",
    "read_records",
    "rl_args",
    "rollout_sets",
    "write_plan",
]


class MockTokenizer:
    """What Megatron-LM's RL data path asks of a tokenizer: pad, EOD, no BOS, detokenize."""

    library = "lossfix-replay"

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab_size, eod, eod - 1
        self.bos = None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


# ------------------------------------------------------------------------------ the rank side
def _token_rollouts(groups: list, rollout_class: type, index: int) -> list:
    """The plan's groups as the checkout's ``TokenRollout`` (its fields vary across releases)."""
    fields = set(getattr(rollout_class, "model_fields", {}))
    made = []
    for g, group in enumerate(groups):
        row = []
        for rollout in group:
            turns = len(rollout["trajectory"])
            values = {
                "trajectory": rollout["trajectory"],
                "generation_mask": rollout["generation_mask"],
                # The inference engine's log-probs, one per generated token: only compared with
                # the trainer's for logging (without --rl-inference-logprobs-is-correction).
                "logprobs": [[-1.0] * sum(m) for m in rollout["generation_mask"]],
                "reward": rollout["reward"],
                "env_id": "lossfix-replay",
                "problem_id": f"{index}-{g}",
                "policy_epoch": [[(0, 0)] for _ in range(turns)],
                "kv_cache_epoch": [[(0, 0)] for _ in range(turns)],
                "num_evictions": [0] * turns,
            }
            row.append(rollout_class(**{k: v for k, v in values.items() if k in fields}))
        made.append(row)
    return made


def _install(plan: dict) -> None:
    """Replace the rollouts and the tokenizer; wrap ``train_step`` for the plan's modes."""
    from megatron.rl import rl_utils, sequence_packing_utils
    from megatron.training import get_args, training

    from megatron_lossfix.integrations.megatron_lm import rl as megatron_lm_rl

    try:
        from megatron.rl.agent.api import TokenRollout
    except ImportError:  # main moved it
        from megatron.rl.types.rollout import TokenRollout

    iterations = plan["iterations"]
    settings = lambda i: iterations[i % len(iterations)]  # noqa: E731
    # main returns (rollouts, per-request ledger); the replayed rollouts reference no request.
    ledger = "request_ledger" in inspect.signature(rl_utils.prepare_data_for_update).parameters
    calls = [0]
    tokenizer: list[MockTokenizer] = []

    def get_tokenizer() -> MockTokenizer:
        if not tokenizer:
            tokenizer.append(MockTokenizer(get_args().padded_vocab_size, plan["eod"]))
        return tokenizer[0]

    def get_environment_rollouts(model, inference_model, optimizer, n_prompts, per_group):
        index = calls[0]
        calls[0] += 1
        groups = _token_rollouts(settings(index)["rollouts"], TokenRollout, index)
        return (groups, {}) if ledger else groups

    get_grpo_data_iterator = rl_utils.get_grpo_data_iterator
    frozen: list[bool] = []

    def grpo_data_iterator(model, inference_model, optimizer, iteration, *args, **kwargs):
        if not frozen:
            # The RL loop collects garbage at every iteration (for the GPU's sake); what is
            # built by now (the imports, the model) lives all run: out of the collector's way,
            # each collection scans this iteration's objects only (0.37 s less an iteration).
            gc.freeze()
            frozen.append(True)
        # The iteration's data settings, set where it collects its rollouts (train() reads the
        # packing flag for this call; forward_step and the log read it at every step).
        wanted = settings(iteration)
        margs = get_args()
        if "sequence_packing" in wanted:
            margs.rl_use_sequence_packing = bool(wanted["sequence_packing"])
            kwargs["sequence_packing"] = margs.rl_use_sequence_packing
            margs.consumed_train_bins = getattr(margs, "consumed_train_bins", 0)
        if wanted.get("max_sequences_per_bin"):
            margs.rl_sequence_packing_max_sequences_per_bin = wanted["max_sequences_per_bin"]
        if "loss_reduction" not in wanted:
            return get_grpo_data_iterator(model, inference_model, optimizer, iteration, *args,
                                          **kwargs)  # fmt: skip
        # The collection is checked as that mode's run would check it (the rows it reads).
        own = getattr(margs, "loss_reduction", None)
        margs.loss_reduction = wanted["loss_reduction"]
        try:
            return get_grpo_data_iterator(model, inference_model, optimizer, iteration, *args,
                                          **kwargs)  # fmt: skip
        finally:
            margs.loss_reduction = own

    rl_utils.get_tokenizer = sequence_packing_utils.get_tokenizer = get_tokenizer
    rl_utils.get_environment_rollouts = get_environment_rollouts
    rl_utils.get_grpo_data_iterator = grpo_data_iterator
    training.train_step = recording_train_step(training.train_step, plan, settings, megatron_lm_rl)


def main(argv: Sequence[str] | None = None) -> int:
    """``write-plan``, ``compare``, or (any other first argument) a rank of a replay."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "python -m megatron_lossfix rl-replay"
    if argv[:1] == ["write-plan"]:
        parser = argparse.ArgumentParser(prog=f"{prog} write-plan")
        parser.add_argument("plan", help="the plan file to write")
        parser.add_argument("megatron_lm_path", help="the (patched) Megatron-LM checkout")
        parser.add_argument("--set", default="multi", choices=SETS,
                            help="the rollouts of every iteration (rollout_sets)")  # fmt: skip
        options = parser.parse_args(argv[1:])
        eod = checkout_null_tokenizer_eod(options.megatron_lm_path)
        iterations = [{"rollouts": rollout_sets(eod)[options.set]}]
        print(write_plan(options.plan, options.megatron_lm_path, iterations))
        return 0
    if argv[:1] == ["compare"]:
        return megatron_lm_rl_compare.main(argv[1:], prog)
    if PLAN_ENV not in os.environ:  # --help, or a rank started without a plan
        print(f"usage: {prog} write-plan PLAN MEGATRON_LM_PATH [--set NAME]\n"
              f"       {prog} compare MEGATRON_LM_PATH [flags]\n"
              f"(`{prog} compare --help` lists compare's flags; any other first argument is a "
              f"rank of a replay, started by compare with {PLAN_ENV} set)")  # fmt: skip
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    plan = json.loads(Path(os.environ[PLAN_ENV]).read_text())
    train_rl = Path(plan["train_rl"])
    sys.path.insert(0, str(train_rl.parent))
    sys.argv = [str(train_rl), *argv]
    _install(plan)
    runpy.run_path(str(train_rl), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
