"""Replay fixed rollouts through Megatron-LM's own RL loop (``train_rl.py``) on any machine.

``train_rl.py`` trains GRPO on rollouts its inference engine generates (CUDA, agents over
loopback HTTP). This module replays fixed ones instead, so that the RL step, stock or through
the plugin, runs on a CPU (gloo): run by ``torchrun -m`` in place of ``train_rl.py`` (with
``train_rl.py``'s flags), it replaces ``megatron.rl.rl_utils.get_environment_rollouts`` by a
function that returns the ``TokenRollout`` groups of a *plan*, gives the RL code a small
tokenizer (pad and EOD ids, as Megatron-LM's own RL unit tests do), and runs the checkout's
``train_rl.py`` as ``__main__``: everything else is Megatron-LM's own code (patched by
``python -m megatron_lossfix.patches apply``, which also makes it run on CPU).

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
(:func:`~megatron_lossfix.integrations.megatron_lm_rl.wrap_forward_backward_func`), and its
collection is checked as that mode's would be; so one launch measures stock Megatron-LM and
every mode on the same model (with ``--lr 0`` the weights stay). Without the key the run's own
flags decide. With ``out``, the last rank appends one JSON line per step: ``iteration``,
``loss_reduction``, ``lm_loss`` (what ``train_step`` reduced for the log), ``grad_norm``,
``num_microbatches``, ``num_sequences`` and ``num_tokens`` (the rows with a loss token and the
loss tokens the step read, over the data-parallel ranks) and ``grad``, the paths of a
``torch.save`` per pipeline stage of every parameter and its gradient (``main_grad``) after the
step, tensor parallelism's shards gathered (run with ``--clip-grad 0``: clipping rescales it in
place); under a plugin mode also ``weights`` (paths: the plugin's weights of each micro-batch,
one file per data-parallel rank) and ``lossfix_loss``, ``lossfix_num_tokens``,
``lossfix_num_sequences`` (the step's metrics). :func:`read_records` reads them back.

Commands (``python -m megatron_lossfix rl-replay ...``, or ``-m`` this module)::

    write-plan PLAN MEGATRON_LM_PATH [--set NAME]   # one iteration of the rollout set NAME
    compare MEGATRON_LM_PATH [--set NAME] [--loss-reduction MODE] [--calculate-per-token-loss]
    <train_rl.py flags>                             # a rank (under torchrun, LOSSFIX_RL_PLAN set)

``compare`` runs stock Megatron-LM and the plugin on 1 rank and on 2 data-parallel ranks
(:func:`compare`) and prints what each step trained and their relative differences.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import random
import re
import runpy
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLAN_ENV = "LOSSFIX_RL_PLAN"
#: This module, as ``python -m`` and ``torchrun -m`` run it.
MODULE = "megatron_lossfix.integrations.megatron_lm_rl_replay"
#: ``--vocab-size`` of the runs (NullTokenizer: its EOD id depends on it).
VOCAB_SIZE = 256
#: The rollout sets of :func:`rollout_sets`.
SETS = ("single", "multi", "prefix_chain", "packed")

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


# ------------------------------------------------------------------------------ plans
def checkout_null_tokenizer_eod(
    megatron_lm_path: str | os.PathLike, vocab_size: int = VOCAB_SIZE
) -> int:
    """NullTokenizer's EOD id for ``--vocab-size vocab_size`` in this checkout's own code.

    The installed megatron-core may be another release than the checkout (the id moved in
    0.18); this loads the checkout's ``null_tokenizer.py`` by itself (it imports nothing from
    Megatron).
    """
    import importlib.util

    source = Path(megatron_lm_path) / "megatron/core/tokenizers/text/libraries/null_tokenizer.py"
    spec = importlib.util.spec_from_file_location("_lossfix_checkout_null_tokenizer", source)
    if spec is None or spec.loader is None or not source.is_file():
        raise FileNotFoundError(
            f"{source} not found: is {megatron_lm_path} a Megatron-LM checkout?"
        )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.NullTokenizer(vocab_size).eod)


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
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE),
        "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-rope-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
        "--perform-rl-step", "--grpo-prompts-per-step", "2", "--grpo-group-size", "2",
        "--grpo-iterations", "1", "--grpo-entropy-term-weight", "1",
    ]  # fmt: skip
    return args + (["--calculate-per-token-loss"] if per_token else [])


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
    training.train_step = _recording(training.train_step, plan, settings, megatron_lm_rl)


class _Counting:
    """The step's data iterator, counting the rows with a loss token and the loss tokens of the
    items the step reads (tensors: no host sync until the step is over)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.rows: list = []
        self.tokens: list = []

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        item = next(self.source)
        from megatron.rl.rl_utils import get_rl_runtime_state

        context = get_rl_runtime_state().packing_context
        if context is not None and len(item) == 1:  # a packed bin: (bin_index,)
            index = int(item[0])
            self.tokens.append(context.packed_loss_mask[index, 1:].sum())
            rows = context.packing_info.bin_seq_indices[index]
            self.rows.append(self.tokens[-1].new_tensor(float(len(rows))))
        else:
            mask = item[3][:, 1:].float()  # train_rl.forward_step: loss_mask[:, 1:]
            self.tokens.append(mask.sum())
            self.rows.append((mask.sum(1) > 0).sum().float())
        return item

    def counts(self, group: Any) -> tuple[int, int]:
        """(rows, tokens) the step read over ``group`` (the data-parallel ranks)."""
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")  # fmt: skip
        both = torch.zeros(2, dtype=torch.float64, device=device)
        if self.rows:
            read = [torch.stack(self.rows).sum(), torch.stack(self.tokens).sum()]
            both = torch.stack(read).to(device=device, dtype=torch.float64)
        dist.all_reduce(both, group=group)
        return int(both[0]), int(both[1])


def _counted(forward_backward_func: Any, counting: list) -> Any:
    """``forward_backward_func`` reading its data through a :class:`_Counting` (the same
    GRPO-group record as the iterator it wraps)."""
    from megatron_lossfix.integrations import megatron_lm_rl_groups

    def counted(*args: Any, **kwargs: Any) -> Any:
        source = kwargs.get("data_iterator")
        if source is not None and not isinstance(source, list):
            kwargs["data_iterator"] = megatron_lm_rl_groups.same_rows(_Counting(source), source)
            counting.append(kwargs["data_iterator"])
        return forward_backward_func(*args, **kwargs)

    return counted


def _one_rank_view(model: Sequence) -> dict:
    """This rank's parameters and gradients (``main_grad``) under the names and shapes of the
    one-rank model: ``{"grad": {name: tensor}, "param": {name: tensor}}``. Tensor-parallel shards
    are gathered over the tensor-parallel group, a pipeline stage's layers take their global
    numbers, and the last stage's copy of tied word embeddings is left out."""
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
    rows and tokens the step read, the full gradient and parameters (each pipeline stage's,
    saved by its first rank of data and tensor parallelism), and under a plugin mode the step's
    counts and loss and the weights of every micro-batch (saved by each data-parallel rank of
    the loss stage)."""
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
        counting: list[_Counting] = []
        if out is not None:
            call["forward_backward_func"] = _counted(call["forward_backward_func"], counting)
        result = train_step(**call)
        if out is None:
            return result
        # Every rank takes part in the count, the metrics and the view; the last one writes
        # the record.
        reader = counting[0] if counting else _Counting(iter(()))  # one a step (no VPP)
        rows, tokens = reader.counts(mpu.get_data_parallel_group())
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
            "num_sequences": rows,
            "num_tokens": tokens,
            "grad": stage_paths,
            "weights": dp_paths if plugin is not None else None,
            **{f"lossfix_{k}": metrics[k] for k in ("loss", "num_tokens", "num_sequences")
               if k in metrics},
        }  # fmt: skip
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    return recorded


# ------------------------------------------------------------------------------ compare
#: Largest relative difference between 1 rank and DP2 that counts as the same step.
REL = 1e-6


def _free_port() -> str:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return str(free.getsockname()[1])


def _rank_env(tree: Path, plan: Path, rank: int, nproc: int, port: str) -> dict[str, str]:
    """What ``torchrun --standalone`` gives a rank, with the checkout first on the path."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # this package, installed or not
    paths = [str(tree), package_root, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # Megatron-LM compiles its dataset helpers with `make`, which calls python3: this one.
    bins = [os.path.dirname(sys.executable), os.path.join(sys.base_prefix, "bin")]
    env["PATH"] = os.pathsep.join([*bins, env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env |= {PLAN_ENV: str(plan), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
    return env


def _launch(tree: Path, plan: Path, args: list[str], nproc: int, logs: Path,
            timeout: float) -> list[str]:  # fmt: skip
    """Run this module on ``nproc`` ranks as plain processes (each rank's output of its own,
    so that every rank says why it stopped); the ranks' outputs."""
    port = _free_port()
    procs, files = [], []
    for rank in range(nproc):
        log = logs / f"ranks{nproc}.rank{rank}.log"
        files.append(log)
        with log.open("w") as out:
            cmd = [sys.executable, "-m", MODULE, *args]
            procs.append(subprocess.Popen(cmd, cwd=tree, env=_rank_env(tree, plan, rank, nproc,
                                          port), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))  # fmt: skip
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now  # a rank failed: its peers get a minute to say why, then stop
        if now > deadline or (failed_at is not None and now > failed_at + 60):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.5)
    return [log.read_text(errors="replace") for log in files]


#: The plugin's refusal in a rank's output (torch prefixes a rank's traceback with its rank).
_REFUSAL = re.compile(r"^(?:\[rank\d+\]:\s*)?ValueError: (megatron_lossfix: .*)$", re.M)


def _refusal(outputs: list[str]) -> str | None:
    """The plugin's one-line refusal, when every rank printed the same one."""
    lines = set()
    for output in outputs:
        found = _REFUSAL.findall(output)
        if not found:
            return None
        lines.add(found[-1])
    return lines.pop() if len(lines) == 1 else None


def compare(
    megatron_lm_path: str | os.PathLike,
    *,
    rollout_set: str = "multi",
    loss_reduction: str = "token_mean",
    loss_norm_constant: float | None = None,
    per_token: bool = False,
    out: str | os.PathLike = "out/rl-compare",
    timeout: float = 1800,
    echo: Any = print,
) -> int:
    """Stock Megatron-LM against the plugin, 1 rank against 2 data-parallel ranks, on the
    rollout set ``rollout_set``: one launch per layout, two iterations at learning rate 0
    (stock, then ``loss_reduction``) on the same rollouts. Prints what each step trained and
    the relative differences between the layouts; returns 0 when the plugin's agree to
    :data:`REL`, 1 when they do not, 2 when a launch failed (a refusal: its line)."""
    tree = Path(megatron_lm_path).resolve()
    train_rl = tree / "train_rl.py"
    if not train_rl.is_file() or "megatron_lossfix" not in train_rl.read_text():
        echo(f"megatron_lossfix: {train_rl} is not patched; run python -m "
             f"megatron_lossfix.patches apply {megatron_lm_path} first")  # fmt: skip
        return 2
    folder = Path(out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    sets = rollout_sets(checkout_null_tokenizer_eod(tree))
    steps = [{"rollouts": sets[rollout_set], "loss_reduction": mode,
              "loss_norm_constant": loss_norm_constant if mode else None}
             for mode in (None, loss_reduction)]  # fmt: skip
    records: dict[int, list[dict]] = {}
    refused: dict[int, str | None] = {}
    for nproc in (1, 2):
        records_out = folder / f"ranks{nproc}.jsonl"
        for old in folder.glob(f"ranks{nproc}.*"):
            old.unlink()
        plan = write_plan(folder / f"ranks{nproc}.plan.json", tree, steps, out=records_out)
        outputs = _launch(tree, plan, rl_args(train_iters=2, per_token=per_token), nproc,
                          folder, timeout)  # fmt: skip
        records[nproc] = read_records(records_out) if records_out.is_file() else []
        refused[nproc] = _refusal(outputs) if len(records[nproc]) < 2 else None
        if len(records[nproc]) < 2 and refused[nproc] is None:
            echo(outputs[-1][-4000:])
            echo(f"megatron_lossfix: the {nproc}-rank launch failed; its ranks' output is in "
                 f"{folder}")  # fmt: skip
            return 2
    flags = f"--loss-reduction {loss_reduction}" + (
        " --calculate-per-token-loss" if per_token else ""
    )
    echo(f"train_rl.py, rollout set {rollout_set!r}, learning rate 0: stock, then {flags}")
    echo(f"{'':8}{'ranks':>6}{'sequences':>11}{'tokens':>8}{'loss':>12}{'grad norm':>12}")
    for step, name in enumerate(("stock", "plugin")):
        for nproc in (1, 2):
            if step >= len(records[nproc]):
                echo(f"{name:8}{nproc:>6}  refused: {refused[nproc]}")
                continue
            r = records[nproc][step]
            echo(f"{name:8}{nproc:>6}{r['num_sequences']:>11}{r['num_tokens']:>8}"
                 f"{r['lm_loss']:>12.6g}{r['grad_norm']:>12.6g}")  # fmt: skip
    echo("relative difference, 1 rank against DP2:")
    echo(f"{'':8}{'loss':>10}{'grad norm':>11}{'gradient':>10}{'num_tokens':>12}")
    worst = 0.0
    for step, name in enumerate(("stock", "plugin")):
        if any(step >= len(records[n]) for n in (1, 2)):
            echo(f"{name:8}  refused")
            continue
        one, two = records[1][step], records[2][step]
        diffs = [
            abs(one["lm_loss"] - two["lm_loss"]) / abs(one["lm_loss"]),
            abs(one["grad_norm"] - two["grad_norm"]) / one["grad_norm"],
            float((one["grad"] - two["grad"]).norm() / one["grad"].norm()),
            abs(one["num_tokens"] - two["num_tokens"]) / max(one["num_tokens"], 1),
        ]
        echo(
            f"{name:8}"
            + "".join(f"{d:>{w}.1e}" for d, w in zip(diffs, (10, 11, 10, 12), strict=True))
        )
        if name == "plugin":
            worst = max(diffs)
    if any(refused.values()):
        return 2
    echo(f"plugin: {'exact' if worst <= REL else 'NOT exact'} (largest difference {worst:.1e}, "
         f"tolerance {REL:.0e})")  # fmt: skip
    return 0 if worst <= REL else 1


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
        parser = argparse.ArgumentParser(
            prog=f"{prog} compare",
            description="Stock Megatron-LM against the plugin, 1 rank against 2 data-parallel "
            "ranks, on fixed rollouts (CPU or GPU); exits 0 when the plugin's agree, 1 when "
            "not, 2 when a launch failed or was refused.",
        )
        parser.add_argument("megatron_lm_path", help="the patched Megatron-LM checkout")
        parser.add_argument("--set", default="multi", choices=SETS,
                            help="the rollouts of both steps (rollout_sets)")  # fmt: skip
        parser.add_argument(
            "--loss-reduction",
            default="token_mean",
            help="the plugin's mode (train_rl.py's --loss-reduction)",
        )
        parser.add_argument(
            "--loss-norm-constant",
            type=float,
            default=None,
            help="Dr. GRPO's constant (seq_mean_token_sum_norm)",
        )
        parser.add_argument(
            "--calculate-per-token-loss",
            action="store_true",
            help="run both steps with Megatron-LM's per-token path",
        )
        parser.add_argument(
            "--out", default="out/rl-compare", help="folder of the plans, records and ranks' logs"
        )
        parser.add_argument("--timeout", type=float, default=1800, help="seconds a launch may run")
        options = parser.parse_args(argv[1:])
        return compare(options.megatron_lm_path, rollout_set=options.set,
                       loss_reduction=options.loss_reduction,
                       loss_norm_constant=options.loss_norm_constant,
                       per_token=options.calculate_per_token_loss, out=options.out,
                       timeout=options.timeout)  # fmt: skip
    plan = json.loads(Path(os.environ[PLAN_ENV]).read_text())
    train_rl = Path(plan["train_rl"])
    sys.path.insert(0, str(train_rl.parent))
    sys.argv = [str(train_rl), *argv]
    _install(plan)
    runpy.run_path(str(train_rl), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
