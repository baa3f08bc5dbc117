"""The plans of the RL replay (:mod:`~megatron_lossfix.integrations.megatron_lm.rl_replay`):
the fixed rollouts it replays, the ``train_rl.py`` flags it runs with, and the plan file.

A plan is a JSON file named by ``LOSSFIX_RL_PLAN`` (:data:`PLAN_ENV`)::

    {"train_rl": PATH, "eod": int, "out": PATH | null,
     "iterations": [{"rollouts": [[ROLLOUT, ...], ...],     # groups (prompts) of rollouts
                     "loss_reduction": null | MODE,         # optional, see below
                     "loss_norm_constant": null | float,
                     "sequence_packing": bool,              # --rl-use-sequence-packing
                     "max_sequences_per_bin": null | int}, ...]}
    ROLLOUT = {"trajectory": [[int, ...], ...],             # one token list per turn
               "generation_mask": [[bool, ...], ...], "reward": float}

Iteration ``i`` of the run collects the rollouts of plan iteration ``i`` (modulo their number;
run with ``--grpo-iterations 1`` and ``--grpo-prompts-per-step`` x ``--grpo-group-size`` equal to
``--global-batch-size``, so that every iteration collects). With a ``loss_reduction`` key the
step of that iteration runs with that mode (``null``: stock Megatron-LM) whatever the flags say:
its forward-backward function is the one the patched ``training.py`` would build for it
(:func:`~megatron_lossfix.integrations.megatron_lm.rl.wrap_forward_backward_func`), and its
collection is checked as that mode's would be; so one launch measures stock Megatron-LM and
every mode on the same model (with ``--lr 0`` the weights stay). Without the key the run's own
flags decide. With ``out``, the last rank appends one JSON line per step
(:mod:`~megatron_lossfix.integrations.megatron_lm.rl_records`).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

from megatron_lossfix.integrations.megatron_lm.tiny_gpt import (
    VOCAB_SIZE,
    checkout_null_tokenizer_eod,
    tiny_gpt_flags,
)

__all__ = [
    "MODULE",
    "PLAN_ENV",
    "SEQ_LENGTH",
    "SETS",
    "VOCAB_SIZE",
    "checkout_null_tokenizer_eod",
    "rl_args",
    "rollout_sets",
    "write_plan",
]

#: The environment variable naming the plan file of a replay's ranks.
PLAN_ENV = "LOSSFIX_RL_PLAN"
#: The replay's module, as ``python -m`` and ``torchrun -m`` run it (a rank of a replay).
MODULE = "megatron_lossfix.integrations.megatron_lm.rl_replay"
#: The rollout sets of :func:`rollout_sets`.
SETS = ("single", "multi", "prefix_chain", "packed", "steps")
#: ``(--grpo-prompts-per-step, --grpo-group-size)`` of a set's collection: 2 x 2 (one step of
#: ``--global-batch-size 4``) unless named here; ``steps``: 4 x 3 rollouts, three steps.
SHAPES = {"steps": (4, 3)}


# ------------------------------------------------------------------------------ rollouts
#: ``--seq-length`` of the runs (and the bin size with sequence packing).
SEQ_LENGTH = 64


def _turn(rng: random.Random, prompt: Sequence[int], generated: int, eod: int) -> tuple:
    """One turn: ``prompt`` then ``generated`` tokens ending in EOD, and its generation mask."""
    response = [rng.randint(1, 200) for _ in range(generated - 1)] + [eod]
    return list(prompt) + response, [False] * len(prompt) + [True] * generated


def _rollout(turns: Sequence[tuple], reward: float) -> dict:
    return {"trajectory": [t for t, _ in turns], "generation_mask": [m for _, m in turns],
            "reward": reward}  # fmt: skip


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(1, 200) for _ in range(length)]


def rollout_sets(eod: int, seed: int = 0) -> dict[str, list]:
    """The rollout sets of the replay and the tests (token ids 1..200, so never pad or EOD):

    - ``single``: 8 single-turn rollouts (4 groups of 2), responses of 3..18 tokens;
    - ``multi``: 4 rollouts (2 groups of 2), one of them 2 turns that are not a prefix chain
      (the second turn's context is not the first turn's tokens): 5 trajectory rows at every
      release, 49 loss tokens; DP2 pads them to 6 rows;
    - ``prefix_chain``: 4 rollouts, one of them 2 turns where the second extends the first:
      5 rows (one per turn) up to core_v0.19, 4 on main (the chain is one row), 46 tokens;
    - ``packed``: 6 single-turn rollouts (3 groups of 2), 80 loss tokens, which
      ``--rl-sequence-packing-max-sequences-per-bin 2`` packs into 3 bins (DP2 adds an empty
      one) and ``1`` into 6;
    - ``steps``: 12 single-turn rollouts (4 groups of 3), which ``--global-batch-size 4``
      trains in three optimizer steps of 4 (:data:`SHAPES`); the second and third groups are
      split between two steps.
    """
    rng = random.Random(seed)
    single = [_rollout([_turn(rng, _prompt(rng, 2 + i % 5), 3 + 2 * i, eod)], float(i % 2))
              for i in range(8)]  # fmt: skip
    first = _turn(rng, _prompt(rng, 4), 8, eod)
    multi = [
        _rollout([_turn(rng, _prompt(rng, 5), 10, eod)], 1.0),
        _rollout([first, _turn(rng, _prompt(rng, 6), 9, eod)], 0.0),
        _rollout([_turn(rng, _prompt(rng, 3), 12, eod)], 0.5),
        _rollout([_turn(rng, _prompt(rng, 7), 10, eod)], 0.0),
    ]
    chain_first = _turn(rng, _prompt(rng, 4), 6, eod)
    chain_second = _turn(rng, chain_first[0] + _prompt(rng, 3), 7, eod)
    prefix_chain = [
        _rollout([_turn(rng, _prompt(rng, 5), 11, eod)], 1.0),
        _rollout([chain_first, chain_second], 0.0),
        _rollout([_turn(rng, _prompt(rng, 3), 12, eod)], 0.5),
        _rollout([_turn(rng, _prompt(rng, 6), 10, eod)], 0.0),
    ]
    packed = [_rollout([_turn(rng, _prompt(rng, 3), n, eod)], float(i % 2))
              for i, n in enumerate((20, 18, 14, 12, 10, 6))]  # fmt: skip
    steps = [_rollout([_turn(rng, _prompt(rng, 2 + i % 4), 4 + (5 * i) % 13, eod)],
                      float((i * 7) % 3) / 2) for i in range(12)]  # fmt: skip
    pairs = lambda rollouts: [rollouts[i : i + 2] for i in range(0, len(rollouts), 2)]  # noqa: E731
    threes = [steps[i : i + 3] for i in range(0, 12, 3)]
    return {"single": pairs(single), "multi": pairs(multi), "prefix_chain": pairs(prefix_chain),
            "packed": pairs(packed), "steps": threes}  # fmt: skip


# ------------------------------------------------------------------------------ plans
def write_plan(
    path: str | os.PathLike,
    megatron_lm_path: str | os.PathLike,
    iterations: Sequence[dict],
    *,
    out: str | os.PathLike | None = None,
) -> Path:
    """Write a plan for the checkout at ``megatron_lm_path`` (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree = Path(megatron_lm_path).resolve()
    plan = {"train_rl": str(tree / "train_rl.py"), "eod": checkout_null_tokenizer_eod(tree),
            "out": None if out is None else str(Path(out).resolve()),
            "iterations": list(iterations)}  # fmt: skip
    path.write_text(json.dumps(plan))
    return path


def rl_args(
    *, train_iters: int, per_token: bool = False, nproc: int = 1, rollout_set: str | None = None
) -> list[str]:
    """``train_rl.py`` flags of the tiny GPT on CPU (:func:`tiny_gpt_flags`) with 4 rollouts
    per step collected at every iteration (a plan's iterations may return another number:
    Megatron-LM sizes the step by the rows it gets), learning rate 0 and no gradient clipping
    (each iteration's gradient is comparable across runs), and an entropy term (weight 1: the
    loss stays away from 0). ``rollout_set``: the collection's shape (:data:`SHAPES`)."""
    args = tiny_gpt_flags(seq_length=SEQ_LENGTH, micro_batch_size=1, global_batch_size=4,
                          train_iters=train_iters, lr="0")  # fmt: skip
    prompts, group = SHAPES.get(rollout_set or "", (2, 2))
    args += [
        "--clip-grad", "0",
        "--perform-rl-step", "--grpo-prompts-per-step", str(prompts),
        "--grpo-group-size", str(group),
        "--grpo-iterations", "1", "--grpo-entropy-term-weight", "1",
    ]  # fmt: skip
    return args + (["--calculate-per-token-loss"] if per_token else [])
