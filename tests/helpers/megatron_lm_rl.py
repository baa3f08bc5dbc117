"""Run Megatron-LM's own RL loop (``train_rl.py``) on this machine with fixed rollouts.

``train_rl.py`` trains GRPO on rollouts its inference engine generates (CUDA, agents over
loopback HTTP). This file replays fixed ones instead. Run by ``torchrun`` in place of
``train_rl.py`` (with ``train_rl.py``'s flags), it replaces
``megatron.rl.rl_utils.get_environment_rollouts`` by a function that returns the ``TokenRollout``
groups of a *plan*, gives the RL code a small tokenizer (pad and EOD ids, as Megatron-LM's own RL
unit tests do), and runs the checkout's ``train_rl.py`` as ``__main__``: everything else is
Megatron-LM's own code (patched by ``python -m megatron_lossfix.patches apply``, which also makes
it run on CPU).

A plan is a JSON file named by ``LOSSFIX_RL_PLAN``::

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
(``megatron_lossfix.integrations.megatron_lm_rl.wrap_forward_backward_func``), so one launch
measures stock Megatron-LM and every mode on the same model (with ``--lr 0`` the weights stay).
Without the key the run's own flags decide. With ``out``, the last rank appends one JSON line
per step: ``iteration``, ``loss_reduction``, ``lm_loss`` (what ``train_step`` reduced for the
log), ``grad_norm``, ``num_microbatches`` and ``grad``, the paths of a ``torch.save`` per
pipeline stage of every parameter and its gradient (``main_grad``) after the step, tensor
parallelism's shards gathered (run with ``--clip-grad 0``: clipping rescales it in place);
under a plugin mode also ``weights`` (paths: the plugin's weights of each micro-batch, one
file per data-parallel rank) and ``lossfix_loss``, ``lossfix_num_tokens``,
``lossfix_num_sequences`` (the step's metrics). :func:`read_records` reads them back.

    python tests/helpers/megatron_lm_rl.py write-plan PLAN MEGATRON_LM_PATH [--set NAME]

writes a plan of one iteration with the rollout set ``NAME`` (:func:`rollout_sets`).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import random
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLAN_ENV = "LOSSFIX_RL_PLAN"

__all__ = [
    "PLAN_ENV",
    "SEQ_LENGTH",
    "MockTokenizer",
    "read_records",
    "rl_args",
    "rl_launch",
    "rollout_sets",
    "write_plan",
]


class MockTokenizer:
    """What Megatron-LM's RL data path asks of a tokenizer: pad, EOD, no BOS, detokenize."""

    library = "lossfix-test"

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod, self.pad = vocab_size, eod, eod - 1
        self.bos = None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


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
    """The rollout groups of the tests (token ids 1..200, so never pad or EOD), by name:

    - ``single``: 8 single-turn rollouts (4 groups of 2), responses of 3..18 tokens;
    - ``multi``: 4 rollouts (2 groups of 2), one of them 2 turns that are not a prefix chain
      (the second turn's context is not the first turn's tokens): 5 trajectory rows at every
      release, 49 loss tokens; DP2 pads them to 6 rows;
    - ``prefix_chain``: 4 rollouts, one of them 2 turns where the second extends the first:
      5 rows (one per turn) up to core_v0.19, 4 on main (the chain is one row), 46 tokens;
    - ``packed``: 6 single-turn rollouts (3 groups of 2), 80 loss tokens, which
      ``--rl-sequence-packing-max-sequences-per-bin 2`` packs into 3 bins (DP2 adds an empty
      one) and ``1`` into 6.
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
    pairs = lambda rollouts: [rollouts[i : i + 2] for i in range(0, len(rollouts), 2)]  # noqa: E731
    return {"single": pairs(single), "multi": pairs(multi), "prefix_chain": pairs(prefix_chain),
            "packed": pairs(packed)}  # fmt: skip


# ------------------------------------------------------------------------------ tests' side
def write_plan(
    path: str | os.PathLike,
    megatron_lm_path: str | os.PathLike,
    iterations: Sequence[dict],
    *,
    out: str | os.PathLike | None = None,
) -> Path:
    """Write a plan for the checkout at ``megatron_lm_path`` (see the module docstring)."""
    from helpers.megatron_lm_run import checkout_null_tokenizer_eod

    path = Path(path)
    tree = Path(megatron_lm_path).resolve()
    plan = {"train_rl": str(tree / "train_rl.py"), "eod": checkout_null_tokenizer_eod(tree),
            "out": None if out is None else str(Path(out).resolve()),
            "iterations": list(iterations)}  # fmt: skip
    path.write_text(json.dumps(plan))
    return path


def rl_args(*, train_iters: int, per_token: bool = False, nproc: int = 1) -> list[str]:
    """``train_rl.py`` flags of a tiny GPT on CPU with 4 rollouts per step collected at every
    iteration (a plan's iterations may return another number: Megatron-LM sizes the step by the
    rows it gets), learning rate 0 and no gradient clipping (each iteration's gradient is
    comparable across runs), and an entropy term (weight 1: the loss stays away from 0)."""
    args = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
        "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", str(train_iters), "--lr", "0", "--clip-grad", "0", "--seed", "1234",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
        "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-rope-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
        "--perform-rl-step", "--grpo-prompts-per-step", "2", "--grpo-group-size", "2",
        "--grpo-iterations", "1", "--grpo-entropy-term-weight", "1",
    ]  # fmt: skip
    return args + (["--calculate-per-token-loss"] if per_token else [])


def rl_launch(
    megatron_lm_path: str | os.PathLike, plan: str | os.PathLike, args: Sequence[str], nproc: int
) -> Any:
    """The launch of this file in place of ``train_rl.py`` with ``plan``."""
    from helpers.megatron_lm_run import Launch

    # Its ranks fork from a zygote that imported train_rl.py's modules from the tree once.
    return Launch(megatron_lm_path=megatron_lm_path, args=list(args), nproc=nproc,
                  script=Path(__file__).resolve(), preload=["train_rl"],
                  env={PLAN_ENV: str(Path(plan).resolve())})  # fmt: skip


def read_records(out: str | os.PathLike) -> list[dict]:
    """The ``out`` lines of a run, each with ``grad`` and ``param``: the full gradient and the
    parameters, one float64 vector each (parameters in name order, named in ``grad_names``,
    the pipeline stages' joined; ``stage_files``: the stages' files) and, under a plugin mode,
    ``weights``: the plugin's weights of every micro-batch row (or packed bin), data-parallel
    ranks in order."""
    import torch

    records = []
    for line in Path(out).read_text().splitlines():
        record = json.loads(line)
        record["stage_files"] = record["grad"]
        views = [torch.load(path) for path in record["grad"]]  # one per pipeline stage
        for key in ("grad", "param"):
            tensors = {k: v for view in views for k, v in view[key].items()}
            record[key] = torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])
        record["grad_names"] = sorted(k for view in views for k in view["grad"])
        if record.get("weights"):
            rows = [w for path in record["weights"] for w in torch.load(path)]
            record["weights"] = torch.cat([w.reshape(-1, w.shape[-1]) for w in rows])
        records.append(record)
    return records


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
                "env_id": "lossfix-test",
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

    from megatron_lossfix.integrations import megatron_lm_rl

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
        return get_grpo_data_iterator(model, inference_model, optimizer, iteration, *args,
                                      **kwargs)  # fmt: skip

    rl_utils.get_tokenizer = sequence_packing_utils.get_tokenizer = get_tokenizer
    rl_utils.get_environment_rollouts = get_environment_rollouts
    rl_utils.get_grpo_data_iterator = grpo_data_iterator
    training.train_step = _recording(training.train_step, plan, settings, megatron_lm_rl)


def _one_rank_view(model: Sequence) -> dict:
    """This rank's parameters and gradients (``main_grad``) under the names and shapes of the
    one-rank model: ``{"grad": {name: tensor}, "param": {name: tensor}}``. Tensor-parallel shards
    are gathered over the tensor-parallel group, a pipeline stage's layers take their global
    numbers, and the last stage's copy of tied word embeddings is left out."""
    import re

    import torch
    import torch.distributed as dist
    from megatron.core import mpu

    tp_group = mpu.get_tensor_model_parallel_group()
    tp_size = mpu.get_tensor_model_parallel_world_size()

    def whole(tensor: torch.Tensor, param: Any) -> torch.Tensor:
        tensor = tensor.detach()
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(tensor) for _ in range(tp_size)]
            dist.all_gather(shards, tensor.contiguous(), group=tp_group)
            tensor = torch.cat(shards, dim=param.partition_dim)
        return tensor.cpu().clone()

    view: dict[str, dict] = {"grad": {}, "param": {}}
    for chunk in model:
        layers = {}  # "<...>.layers.<local>." -> "<...>.layers.<global>."
        for name, module in chunk.named_modules():
            local = re.fullmatch(r"(.*\.layers)\.(\d+)", name)
            if local and hasattr(module, "layer_number"):
                layers[f"{name}."] = f"{local[1]}.{module.layer_number - 1}."
        for name, param in chunk.named_parameters():
            if getattr(param, "shared", False):
                continue  # the last stage's copy of the word embeddings
            grad = getattr(param, "main_grad", None)
            prefix = next((k for k in layers if name.startswith(k)), None)
            name = name if prefix is None else layers[prefix] + name[len(prefix) :]
            view["grad"][name] = whole(param.grad if grad is None else grad, param)
            view["param"][name] = whole(param, param)
    return view


def _recording(train_step: Any, plan: dict, settings: Any, megatron_lm_rl: Any) -> Any:
    """``train_step`` with the plan's mode of each iteration, recording what it measured: the
    full gradient and parameters (each pipeline stage's, saved by its first rank of data and
    tensor parallelism), and under a plugin mode the step's counts and loss and the weights of
    every micro-batch (saved by each data-parallel rank of the loss stage)."""
    import torch
    import torch.distributed as dist
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    names = list(inspect.signature(train_step).parameters)
    out = None if plan.get("out") is None else Path(plan["out"])

    def recorded(*args: Any, **kwargs: Any) -> tuple:
        call = dict(zip(names[: len(args)], args, strict=True)) | kwargs
        iteration = int(call.get("iteration") or 0)
        wanted = settings(iteration)
        weights: list = []
        plugin = None
        if "loss_reduction" in wanted:
            inner = call["forward_backward_func"]
            inner = getattr(inner, "inner", inner)  # the run's own plugin wrapper: unwrap it
            if wanted["loss_reduction"] is not None:
                mode_args = copy.copy(get_args())
                mode_args.loss_reduction = wanted["loss_reduction"]
                mode_args.loss_norm_constant = wanted.get("loss_norm_constant")
                mode_args.lossfix_metrics_out = None
                inner = plugin = megatron_lm_rl.wrap_forward_backward_func(inner, mode_args)
                rl_loss = plugin._rl_loss

                def kept_rl_loss(micro_batch_weights: Any, *rest: Any) -> tuple:
                    weights.append(micro_batch_weights.detach().cpu().clone())
                    return rl_loss(micro_batch_weights, *rest)

                plugin._rl_loss = kept_rl_loss
            call["forward_backward_func"] = inner
        result = train_step(**call)
        if out is None:
            return result
        metrics = plugin.schedule.step_metrics() if plugin is not None else {}  # collective
        view = _one_rank_view(call["model"])  # collective over TP
        stem = out.with_name(f"{out.stem}.{iteration + 1}")
        stages = mpu.get_pipeline_model_parallel_world_size()
        stage_paths = [f"{stem}.pp{p}.pt" for p in range(stages)]
        dp_rank, tp_rank = mpu.get_data_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        if dp_rank == 0 and tp_rank == 0:
            torch.save(view, stage_paths[mpu.get_pipeline_model_parallel_rank()])
        dp_paths = [f"{stem}.w.dp{d}.pt" for d in range(mpu.get_data_parallel_world_size())]
        if weights and tp_rank == 0:
            torch.save(weights, dp_paths[dp_rank])
        if dist.get_rank() != dist.get_world_size() - 1:
            return result
        loss_dict, grad_norm = result[0], result[5]
        lm_loss = loss_dict.get("lm loss") if isinstance(loss_dict, dict) else None
        record = {
            "iteration": iteration + 1,
            "loss_reduction": wanted.get(
                "loss_reduction", getattr(get_args(), "loss_reduction", None)
            ),
            "lm_loss": None if lm_loss is None else float(lm_loss),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "num_microbatches": get_num_microbatches(),
            "grad": stage_paths,
            "weights": dp_paths if plugin is not None else None,
            **{f"lossfix_{k}": metrics[k] for k in ("loss", "num_tokens", "num_sequences")
               if k in metrics},
        }  # fmt: skip
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    return recorded


def main(argv: Sequence[str]) -> None:
    if argv[:1] == ["write-plan"]:
        parser = argparse.ArgumentParser(prog="python tests/helpers/megatron_lm_rl.py write-plan")
        parser.add_argument("plan", help="the plan file to write")
        parser.add_argument("megatron_lm_path", help="the (patched) Megatron-LM checkout")
        parser.add_argument(
            "--set",
            default="multi",
            choices=("single", "multi", "prefix_chain", "packed"),
            help="the rollouts of every iteration (rollout_sets)",
        )
        options = parser.parse_args(argv[1:])
        from helpers.megatron_lm_run import checkout_null_tokenizer_eod

        eod = checkout_null_tokenizer_eod(options.megatron_lm_path)
        iterations = [{"rollouts": rollout_sets(eod)[options.set]}]
        print(write_plan(options.plan, options.megatron_lm_path, iterations))
        return
    plan = json.loads(Path(os.environ[PLAN_ENV]).read_text())
    train_rl = Path(plan["train_rl"])
    sys.path.insert(0, str(train_rl.parent))
    sys.argv = [str(train_rl), *argv]
    _install(plan)
    runpy.run_path(str(train_rl), run_name="__main__")


if __name__ == "__main__":
    # Run as a script: its folder (tests/helpers) is sys.path[0]; the helpers package is above.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
