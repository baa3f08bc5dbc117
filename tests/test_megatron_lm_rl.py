"""Megatron-LM's own RL loop (``train_rl.py``) through the plugin: exact under every layout.

Unit tests (no Megatron-LM): the refusals, the RL micro-batches the plugin reads, and the loss
callable the patched ``loss_func`` calls (its values, its reports, no host sync).

End to end, with ``MEGATRON_LM_ARCHIVES``: the real, patched ``train_rl.py`` of the installed
release's tag (and of ``main`` on Python >= 3.12) trains on CPU with fixed rollouts (the
package's replay, ``integrations.megatron_lm.rl_replay``): its real ``train() ->
get_grpo_data_iterator -> prepare_data_for_update -> train_step`` with
``train_rl.forward_step``/``loss_func``. One launch per layout and
``--calculate-per-token-loss`` setting runs every rollout set under stock Megatron-LM and each
mode, one iteration each at learning rate 0 (:func:`_plan`); the tests read its records:

- every mode but ``token_mean_legacy`` agrees between 1 rank and DP2, and between 3 and 6
  packed bins on one rank, to 1e-6 (loss, grad norm, full gradient), with and without the flag;
- stock Megatron-LM's DP2 gradient is its 1-rank gradient times the factor its padding implies
  (5/6 for a padding row, 3/4 for an empty bin; 49/50 and 80/81 per token): the same check
  fails there, and would fail for the plugin without the fix;
- ``token_mean_legacy`` is stock's mean of per-micro-batch means (layout-dependent by design);
- a packed bin's sequences are the rows of the unpacked step (the same gradient);
- what the plugin cannot make exact is refused before the first step on every rank (before
  core_v0.19.0 also a multi-turn step that would train a layout-dependent subset of its rows),
  and the CPU commands of ``docs/megatron_lm_rl.md`` run as printed;
- TP2, PP2 and TP2 x DP2 started from one rank's initial weights agree with one rank (stock and
  plugin; stock's TP2 x DP2 moves with its padding), the plugin's weights and counts bit for
  bit; PP2 from its own random weights (Megatron-LM seeds each stage apart) is another model
  (:func:`test_train_rl_tensor_and_pipeline_parallel`, in the model-parallel section below).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.host_syncs import HostSyncs
from helpers.inputs import skip_missing
from helpers.launch import slots
from helpers.megatron_lm_run import archive_tags, archives_folder, skip_reason, tags_to_test

from megatron_lossfix.integrations.megatron_lm import rl as megatron_lm_rl
from megatron_lossfix.integrations.megatron_lm import rl_groups as megatron_lm_rl_groups
from megatron_lossfix.integrations.megatron_lm import rl_steps as megatron_lm_rl_steps
from megatron_lossfix.integrations.megatron_lm import training as megatron_lm
from megatron_lossfix.integrations.megatron_lm.training import add_args_provider
from megatron_lossfix.runtime.config import LossFixConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "megatron_lm_rl.md"


# ------------------------------------------------------------------------------ unit
def _args(*flags: str, **extra: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--distributed-backend", default="nccl")
    args = add_args_provider()(parser).parse_args(list(flags))
    args.perform_rl_step = True
    vars(args).update(extra)
    return args


@pytest.mark.unit
def test_check_args_refuses_with_one_line_naming_the_flag(capsys, monkeypatch) -> None:
    from megatron_lossfix.step.selfcheck import check

    monkeypatch.setattr(check, "_LEFT_OUT", set())
    assert megatron_lm_rl.check_args(_args()) is None  # no flag: stock train_rl.py
    config = megatron_lm_rl.check_args(_args("--loss-reduction", "sequence_mean"))
    assert config.reduction == "sequence_mean"
    assert config.self_check is False  # the default first-step check stays out here...
    megatron_lm_rl.check_args(_args("--loss-reduction", "sequence_mean"))
    said = capsys.readouterr().out.splitlines()  # ... and says so once
    assert len(said) == 1 and said[0].startswith(
        "megatron_lossfix self-check: not run in Megatron-LM's RL loop (train_rl.py): the plugin "
        "writes its loss"
    ), said
    refused = {
        "--context-parallel-size": _args("--loss-reduction", "token_mean",
                                         context_parallel_size=2),
        "--rl-training-cuda-graphs": _args("--loss-reduction", "token_mean",
                                           rl_training_cuda_graphs=True),
        "--lossfix-self-check": _args("--loss-reduction", "token_mean", "--lossfix-self-check"),
        "--loss-norm-constant": _args("--loss-reduction", "seq_mean_token_sum_norm"),
        "--hybrid-context-parallel": _args("--loss-reduction", "sum",
                                           hybrid_context_parallel=True),
    }  # fmt: skip
    for flag, args in refused.items():
        with pytest.raises(ValueError) as info:
            megatron_lm_rl.check_args(args)
        message = str(info.value)
        assert flag in message and "\n" not in message, message


@pytest.mark.unit
def test_the_training_hook_builds_the_rl_step() -> None:
    """The patched ``training.py`` calls ``megatron_lm.wrap_forward_backward_func``: with
    ``--perform-rl-step`` it is the RL step; without ``--loss-reduction`` the function itself."""

    def stock(**kwargs: object) -> list:
        return []

    assert megatron_lm.wrap_forward_backward_func(stock, _args()) is stock
    wrapped = megatron_lm.wrap_forward_backward_func(stock, _args("--loss-reduction", "sum"))
    assert isinstance(wrapped, megatron_lm_rl.MegatronLMRLLossFix) and wrapped.inner is stock
    with pytest.raises(ValueError, match="--context-parallel-size 2"):
        megatron_lm.wrap_forward_backward_func(
            stock, _args("--loss-reduction", "sum", context_parallel_size=2)
        )


class _Context:
    """What ``rl_micro_batch`` reads of Megatron-LM's ``PackingContext``."""

    def __init__(self, mask: torch.Tensor, seq_starts: dict) -> None:
        self.packed_loss_mask = mask

        class Info:
            pass

        self.packing_info = Info()
        self.packing_info.seq_starts = seq_starts


@pytest.mark.unit
def test_rl_micro_batch_rows_and_packed_bins(monkeypatch: pytest.MonkeyPatch) -> None:
    mask = torch.tensor([[0.0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    item = [torch.zeros(2, 5), torch.zeros(2), torch.zeros(2, 4), mask]
    monkeypatch.setattr(megatron_lm_rl, "_packing_context", lambda: None)
    batch = megatron_lm_rl.rl_micro_batch(item, "loss_mask", "cu_seqlens")
    # The log-prob positions: position j scores token j + 1, as train_rl.forward_step slices.
    assert torch.equal(batch["loss_mask"], mask[:, 1:]) and "cu_seqlens" not in batch
    assert batch[megatron_lm_rl.ITEM_KEY] is item
    # Bin 0 holds trajectories of 3 and 4 tokens (then padding); bin 1 is an empty bin.
    bins = torch.tensor([[0.0, 1, 1, 0, 1, 1, 1, 0, 0], [0] * 9])
    context = _Context(bins, {0: [0, 3, 7], 1: []})
    monkeypatch.setattr(megatron_lm_rl, "_packing_context", lambda: context)
    packed = megatron_lm_rl.rl_micro_batch((torch.tensor(0),), "loss_mask", "cu_seqlens")
    assert torch.equal(packed["loss_mask"], bins[0:1, 1:])
    # Shifted like the mask: positions 0..1 score tokens 1..2 (trajectory 0), 2..5 tokens
    # 3..6 (trajectory 1), 6..7 the padding after them.
    assert packed["cu_seqlens"].tolist() == [0, 2, 6]
    empty = megatron_lm_rl.rl_micro_batch((torch.tensor(1),), "loss_mask", "cu_seqlens")
    assert empty["loss_mask"].sum() == 0 and empty["cu_seqlens"].tolist() == [0, 0]


class _Rollout:
    def __init__(self, turns: int) -> None:
        self.trajectory = [[1]] * turns


@pytest.mark.unit
def test_rows_keep_their_grpo_group_at_every_release() -> None:
    """Each training row's group, as ``prepare_data_for_update`` forms and splits the rows:
    from core_v0.19 the rows (one per turn) are padded to DP x micro-batch size and split;
    before, the rollouts are split and then expanded; on main a prefix chain is one row and a
    zero-turn rollout none. Unpacked micro-batches read the rank's rows in order, cycling."""
    grouped = [[_Rollout(1), _Rollout(2)], [_Rollout(1), _Rollout(0)], [_Rollout(3)]]
    rows = megatron_lm_rl_groups.row_groups
    padded = rows(grouped, data_parallel_size=2, data_parallel_rank=1, micro_batch_size=1,
                  pads_rows=True)  # fmt: skip
    assert padded.global_rows == [0, 0, 0, 1, 2, 2, 2, 0] and padded.local_rows == [2, 2, 2, 0]
    assert padded.count == 3
    main = rows(grouped, data_parallel_size=2, data_parallel_rank=0, micro_batch_size=1,
                pads_rows=True, collapsible=lambda r: len(r.trajectory) == 3)  # fmt: skip
    assert main.global_rows == [0, 0, 0, 1, 2, 0] and main.local_rows == [0, 0, 0]
    split = rows(grouped, data_parallel_size=2, data_parallel_rank=1, micro_batch_size=1,
                 pads_rows=False)  # fmt: skip
    assert split.global_rows == [0, 0, 0, 1] and split.local_rows == [1]
    two = rows(grouped, data_parallel_size=1, data_parallel_rank=0, micro_batch_size=2,
               pads_rows=True)  # fmt: skip
    read = megatron_lm_rl_groups.micro_batch_groups
    assert [read(two, 2) for _ in range(5)] == [[0, 0], [0, 1], [2, 2], [2, 0], [0, 0]]
    # A packed bin: one id per packed row (an empty bin: one, for its empty sequence).
    assert read(two, 1, [5, 2]) == [2, 0] and read(two, 1, [3]) == [1]
    assert read(two, 1, []) == [0]


@pytest.mark.unit
def test_rl_loss_weighs_and_reports_without_phantom_tokens_or_host_sync() -> None:
    wrapper = megatron_lm_rl.MegatronLMRLLossFix(LossFixConfig(reduction="sum"), lambda **k: [])
    wrapper._indicator_pending = True
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # the second row: a padding row
    weights = mask * 0.25
    losses = torch.tensor([[2.0, 4.0, 9.0], [9.0, 9.0, 9.0]], requires_grad=True)
    kl = torch.tensor([[0.5, 1.5, 7.0], [7.0, 7.0, 7.0]])
    truncated = torch.tensor([[True, False, True], [True, True, True]])
    terms = {"rl/kl_term": kl, "rl/truncated_from_above": truncated}
    with HostSyncs() as syncs:
        loss, num_tokens, report = wrapper._rl_loss(weights, losses, mask, terms)
    assert syncs.calls == []
    assert float(loss.detach()) == pytest.approx(1.5) and int(num_tokens) == 2
    assert report[megatron_lm.LOSS_KEY].tolist() == [1.5, 1.0]  # [L's share, indicator]
    # Token means of the terms over real tokens only (stock counts a padding row as 1 token).
    assert report["rl/kl_term"].tolist() == [2.0, 2.0]
    assert report["rl/truncated_from_above"].tolist() == [1.0, 2.0]
    _, num_tokens, report = wrapper._rl_loss(weights * 0, losses, mask * 0, terms)
    assert int(num_tokens) == 0 and report["rl/kl_term"].tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------ end to end
ARCHIVES = archives_folder()
TAGS = tags_to_test(ARCHIVES) if ARCHIVES else []
if ARCHIVES and sys.version_info >= (3, 12) and "main" in archive_tags(ARCHIVES):
    # main needs Python >= 3.12; MEGATRON_LM_TAGS, when set, decides alone.
    if "main" not in TAGS and not __import__("os").environ.get("MEGATRON_LM_TAGS"):
        TAGS = [*TAGS, "main"]
needs_megatron_lm = pytest.mark.skipif(not TAGS, reason=skip_reason(ARCHIVES))

MODES = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "sum", "group_mean",
         "token_mean_legacy")  # fmt: skip
#: The modes that are layout-invariant (token_mean_legacy is the old per-micro-batch mean).
INVARIANT = MODES[:5]
NORM_CONSTANT = 32.0
REL = 1e-6
#: (set, sequence packing, sequences per bin, modes (None: stock)) of the launches' iterations,
#: in order: without packing Megatron-LM asserts that the micro-batch count never decreases.
STEPS = (
    ("prefix_chain", False, None, (None, "token_mean", "sequence_mean", "group_mean")),
    ("multi", False, None, (None, *MODES)),
    ("packed", False, None, INVARIANT),  # the packed set's rows, unpacked
    ("single", False, None, (None, *MODES)),
    ("packed", True, 2, (None, *MODES)),  # 3 bins (DP2: 4, one empty)
    ("packed", True, 1, (None, *MODES)),  # 6 bins: more micro-batches
)
#: Sets that Megatron-LM pads only from core_v0.19 on (before, its DP split of multi-turn
#: rollouts leaves the ranks uneven numbers of rows).
PADDED_SETS = ("prefix_chain", "multi")
LAUNCHES = ((1, False), (2, False), (1, True), (2, True))  # (ranks, --calculate-per-token-loss)


def _pads_rows(tree: Path) -> bool:
    """Whether this checkout's RL data path pads its rows to a multiple of the data-parallel
    size (core_v0.19.0 and later)."""
    return "pad_to_multiple" in (tree / "megatron/rl/rl_utils.py").read_text()


def _steps(tree: Path) -> list[tuple]:
    """The steps this checkout runs: (set, packing, per_bin, mode), one per iteration."""
    pads_rows = _pads_rows(tree)
    return [(name, packing, per_bin, mode) for name, packing, per_bin, modes in STEPS
            if pads_rows or name not in PADDED_SETS for mode in modes]  # fmt: skip


def _plan(steps: list[tuple], sets: dict) -> list[dict]:
    return [{"rollouts": sets[name], "sequence_packing": packing, "max_sequences_per_bin": per_bin,
             "loss_reduction": mode,
             "loss_norm_constant": NORM_CONSTANT if mode == "seq_mean_token_sum_norm" else None}
            for name, packing, per_bin, mode in steps]  # fmt: skip


class _RLRuns:
    """Each tag's four launches, run once per session; the tests read their records."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, Path] = {}
        self.runs: dict[str, tuple[list[tuple], dict]] = {}

    def tree(self, tag: str) -> Path:
        if tag not in self.trees:
            from helpers.megatron_lm_run import prepare_tree

            self.trees[tag] = prepare_tree(ARCHIVES, tag, self.root / tag)[0]
        return self.trees[tag]

    def get(self, tag: str) -> tuple[list[tuple], dict]:
        """(steps, {(ranks, per_token): records}) of ``tag``."""
        if tag not in self.runs:
            from helpers.megatron_lm_rl import RLRun, rollout_sets, run_waves
            from helpers.megatron_lm_run import checkout_null_tokenizer_eod

            tree = self.tree(tag)
            steps = _steps(tree)
            plan = _plan(steps, rollout_sets(checkout_null_tokenizer_eod(tree)))
            runs = {key: RLRun(key[0], plan, per_token=key[1]) for key in LAUNCHES}
            self.runs[tag] = (steps, run_waves(tree, self.root, tag, [runs]))
        return self.runs[tag]


@pytest.fixture(scope="module")
def rl_runs(tmp_path_factory: pytest.TempPathFactory) -> _RLRuns:
    return _RLRuns(tmp_path_factory.mktemp("megatron-lm-rl"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of ``b`` from ``a``."""
    return float((a - b).norm() / a.norm())


def _agreement(a: dict, b: dict) -> float:
    """The largest relative difference of loss, grad norm and full gradient of two records."""
    loss = abs(a["lm_loss"] - b["lm_loss"]) / abs(a["lm_loss"])
    norm = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
    return max(loss, norm, _rel(a["grad"], b["grad"]))


def _index(steps: list[tuple], name: str, packing: bool, per_bin: int | None, mode) -> int:
    return steps.index((name, packing, per_bin, mode))


#: The rows of the table (docs/megatron_lm_rl.md): (label, set, packing, bins compared).
TABLE = (
    ("8 single-turn rollouts, micro-batch 1", "single", False, None),
    ("5 rows, one multi-turn rollout (DP2 adds a padding row)", "multi", False, None),
    ("a 2-turn prefix chain: 5 rows (4 on main)", "prefix_chain", False, None),
    ("sequence packing, 3 bins (DP2 adds an empty bin)", "packed", True, None),
    ("the same, 3 against 6 bins on one rank", "packed", True, 1),
)


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", TAGS or ["none"])
def test_train_rl_plugin_is_layout_invariant(rl_runs: _RLRuns, tag: str, report_figure) -> None:
    """Every invariant mode, with and without ``--calculate-per-token-loss``: 1 rank against
    DP2 (padding rows and empty bins there), and 3 against 6 packed bins on one rank, agree to
    1e-6 in loss, grad norm and full gradient. Reports the table of docs/megatron_lm_rl.md:
    stock's relative L2 gradient distance beside the plugin's largest difference."""
    steps, records = rl_runs.get(tag)
    report_figure(f"Megatron-LM RL {tag}: | data | stock | stock, per-token | plugin | "
                  "plugin, per-token |")  # fmt: skip
    for label, name, packing, more in TABLE:
        per_bin = 2 if packing else None
        if (name, packing, per_bin, None) not in steps:
            continue  # a set this checkout does not pad (before core_v0.19)
        cells = {}
        for per_token in (False, True):
            first = records[1, per_token]
            # 1 rank against DP2 on the same step, or on one rank 3 bins against 6.
            second = first if more else records[2, per_token]
            bins = more or per_bin
            stock = _index(steps, name, packing, per_bin, None)
            twin = _index(steps, name, packing, bins, None)
            cells["stock", per_token] = _rel(first[stock]["grad"], second[twin]["grad"])
            worst = 0.0
            for mode in (m for m in INVARIANT if (name, packing, per_bin, m) in steps):
                i, j = (_index(steps, name, packing, b, mode) for b in (per_bin, bins))
                counts = first[i]["num_microbatches"], second[j]["num_microbatches"]
                assert counts[1] == 2 * counts[0] if more else counts[0] != counts[1], counts
                diff = _agreement(first[i], second[j])
                assert diff <= REL, (tag, label, mode, per_token, diff)
                if mode == "group_mean":  # the groups weigh: not the token mean of the step
                    mean = first[_index(steps, name, packing, per_bin, "token_mean")]
                    assert _agreement(mean, first[i]) > 1e-3, (tag, label, per_token)
                worst = max(worst, diff)
            cells["plugin", per_token] = worst
        row = " | ".join(f"{cells[k, pt]:.1e}" for k in ("stock", "plugin") for pt in (0, 1))
        report_figure(f"Megatron-LM RL {tag}: | {label} | {row} |")


def _padding(tag: str, name: str, packing: bool) -> tuple[int, int, int]:
    """(micro-batches, padding micro-batches, loss tokens) of a set's step at DP2, 1 row or 1
    bin of 2 sequences per micro-batch (``rollout_sets``); main merges a prefix chain."""
    rows = {"single": 8, "multi": 5, "prefix_chain": 4 if tag == "main" else 5, "packed": 6}
    tokens = {"single": 80, "multi": 49, "prefix_chain": 46, "packed": 80}
    count = 3 if packing else rows[name]  # 6 sequences, 2 per bin
    return count, -count % 2, tokens[name]


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", TAGS or ["none"])
def test_train_rl_stock_moves_with_the_padding(rl_runs: _RLRuns, tag: str) -> None:
    """Stock Megatron-LM's DP2 gradient is its 1-rank gradient times the factor its padding
    implies: micro-batches / (micro-batches + padding) on the default path (5/6: a padding row;
    3/4: an empty bin), tokens / (tokens + padding) per token (a phantom token each: 49/50,
    80/81); 1 where nothing is padded. The plugin's check above fails on these."""
    steps, records = rl_runs.get(tag)
    for i, (name, packing, per_bin, mode) in enumerate(steps):
        if mode is not None or per_bin == 1:
            continue
        count, padding, tokens = _padding(tag, name, packing)
        for per_token in (False, True):
            one, two = records[1, per_token][i]["grad"], records[2, per_token][i]["grad"]
            factor = tokens / (tokens + padding) if per_token else count / (count + padding)
            assert _rel(factor * one, two) <= REL, (tag, name, packing, per_token, factor)
            moved = _rel(one, two)
            assert (moved > 1e-3) == (padding > 0), (tag, name, packing, per_token, moved)


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", TAGS or ["none"])
def test_train_rl_modes_mean_what_they_say(rl_runs: _RLRuns, tag: str) -> None:
    """The logged loss is the mode's global loss: ``token_mean`` logs what stock logs on one
    rank without padding (sum / tokens), ``sum`` that times the token count. A packed bin's
    sequences are the unpacked step's rows (same gradient for every invariant mode).
    ``token_mean_legacy`` is stock's default mean of per-micro-batch means, in every layout and
    with either setting of ``--calculate-per-token-loss``."""
    steps, records = rl_runs.get(tag)
    for per_token in (False, True):
        for name in ("multi", "single", "packed"):
            if ("multi", False, None, None) not in steps and name == "multi":
                continue
            packing = name == "packed"
            per_bin = 2 if packing else None
            run = records[1, per_token]
            token_mean = run[_index(steps, name, packing, per_bin, "token_mean")]["lm_loss"]
            stock = run[_index(steps, name, packing, per_bin, None)]["lm_loss"]
            total = run[_index(steps, name, packing, per_bin, "sum")]["lm_loss"]
            tokens = _padding(tag, name, packing)[2]
            assert token_mean == pytest.approx(stock, rel=REL)
            assert total == pytest.approx(token_mean * tokens, rel=REL)
            for ranks in (1, 2):
                run = records[ranks, per_token]
                legacy = run[_index(steps, name, packing, per_bin, "token_mean_legacy")]["grad"]
                default = records[ranks, False][_index(steps, name, packing, per_bin, None)]
                assert _rel(default["grad"], legacy) <= REL, (name, ranks, per_token)
        for mode in INVARIANT:
            for ranks in (1, 2):
                rows = records[ranks, per_token][_index(steps, "packed", False, None, mode)]
                bins = records[ranks, per_token][_index(steps, "packed", True, 2, mode)]
                assert _agreement(rows, bins) <= REL, (mode, ranks, per_token)


@pytest.mark.e2e
@needs_megatron_lm
def test_train_rl_refuses_before_the_first_step(rl_runs: _RLRuns) -> None:
    """The patched ``train_rl.py`` itself, as the 2 ranks of one job: context parallelism, and
    Dr. GRPO without its constant, are refused on every rank with one line naming the flag,
    before any step trains. The ranks run as plain processes (torchrun's environment by hand):
    torchrun would end a rank's peer as soon as that rank fails, before the peer says why."""
    import socket

    from helpers.megatron_lm_rl import rl_args
    from helpers.megatron_lm_run import megatron_lm_env

    tree = rl_runs.tree(TAGS[0])
    cases = {
        "--context-parallel-size 2": ["--context-parallel-size", "2",
                                      "--loss-reduction", "token_mean"],
        "--loss-norm-constant": ["--loss-reduction", "seq_mean_token_sum_norm"],
    }  # fmt: skip
    procs = []
    with slots(2):  # each pair of ranks imports, refuses and exits: the pairs may share
        for flags in cases.values():
            with socket.socket() as free:
                free.bind(("127.0.0.1", 0))
                port = str(free.getsockname()[1])
            for rank in (0, 1):
                job = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
                env = megatron_lm_env(tree) | {k: str(v) for k, v in job.items()}
                cmd = [sys.executable, str(tree / "train_rl.py"), *rl_args(train_iters=1), *flags]
                procs.append(subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))  # fmt: skip
        outputs = [proc.communicate(timeout=1200)[0] for proc in procs]
    results = [(proc.returncode, out) for proc, out in zip(procs, outputs, strict=True)]
    for k, flag in enumerate(cases):
        for rank in (0, 1):
            returncode, output = results[2 * k + rank]
            assert returncode != 0, (flag, rank, output[-4000:])
            assert not re.search(r"iteration\s+1/", output), output[-4000:]  # nothing trained
            errors = [ln for ln in output.splitlines() if ln.startswith("ValueError: ")]
            assert len(errors) == 1 and flag in errors[0], (flag, rank, output[-4000:])
            assert errors[0].startswith("ValueError: megatron_lossfix: "), errors[0]


def _doc_cpu_command() -> str:
    """The ``bash`` block of the doc's "On a CPU" paragraph."""
    text = DOC.read_text()
    section = text[text.index("**On a CPU.**") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


#: The environment the page's install line makes, and that its commands run in.
PAGE_VENV = ".venv-rl"


@pytest.mark.unit
def test_doc_cpu_block_makes_and_activates_its_environment() -> None:
    """The page's CPU block opens with the one line that makes its environment (CI runs it as
    printed: ``noxfile.py``'s ``PAGE_TESTS``) and activates it; every command after runs in it."""
    from helpers import doc_pages

    commands = doc_pages.block_commands("bash", _doc_cpu_command())
    name, line = doc_pages.install_line("docs/megatron_lm_rl.md")
    assert commands[0] == line and name == PAGE_VENV.removeprefix(".venv-"), commands[0]
    assert '-e ".[megatron-lm]"' in line and "megatron-core==0.19.2" in line, line
    assert commands[1] == f"source {PAGE_VENV}/bin/activate", commands[1]
    assert not any(c.startswith(("pip ", "python3")) for c in commands[2:]), commands


def _page_environment(root: Path, work: Path) -> None:
    """``work/.venv-rl``: the virtualenv the page's install line made in ``root`` (CI runs the
    line as printed, then this test with that virtualenv's Python), else a stand-in whose
    ``activate`` puts this interpreter first on PATH (a checkout where the line was not run)."""
    made = root / PAGE_VENV
    if made.is_dir():
        (work / PAGE_VENV).symlink_to(made)
        return
    bin_dir = work / PAGE_VENV / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')


@pytest.mark.e2e
@needs_megatron_lm
def test_doc_cpu_command_runs_as_printed(tmp_path: Path) -> None:
    """``docs/megatron_lm_rl.md``'s CPU commands, as printed, on a fresh (unpatched) checkout
    of the suite's tag (core_v0.19.0 or main, which the page names), in the environment its
    first line makes (which CI runs as printed; this test runs the lines after it): the patch
    applies, ``compare`` prints stock against the plugin, 1 rank against DP2, and finds the
    plugin exact, and ``train_rl.py --loss-reduction sequence_mean`` trains on 2 CPU ranks with
    the mode's metrics: 5 sequences (rows), 49 loss tokens, the logged loss L. Everything lands
    in ``out/``."""
    import os

    from helpers import doc_pages
    from helpers.megatron_lm_run import reuse_installed_helpers, unpack_tag

    tree = unpack_tag(ARCHIVES, TAGS[0], tmp_path / "checkout")
    if not _pads_rows(tree):
        pytest.skip(f"the page's CPU block is for core_v0.19.0 and main, not {TAGS[0]}")
    reuse_installed_helpers(tree)
    work = tmp_path / "work"  # the repository root as the reader has it; outputs land here
    work.mkdir()
    for name in ("megatron_lossfix", "patches"):
        (work / name).symlink_to(ROOT / name)
    _page_environment(ROOT, work)
    commands = doc_pages.block_commands("bash", _doc_cpu_command())
    assert doc_pages.INSTALL_LINE.match(commands[0]), commands[0]
    script = "\n".join(commands[1:]).replace("/path/to/Megatron-LM", str(tree))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")])
    with slots(2):
        proc = subprocess.run(["bash", "-c", f"set -e\n{script}"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=1800)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    made = sorted(p.name for p in work.iterdir())
    assert made == [PAGE_VENV, "megatron_lossfix", "out", "patches"], made
    # compare's table: stock moves with DP2's padding row, the plugin does not.
    differences = output[output.index("relative difference, 1 rank against DP2:") :]
    rows = dict(re.findall(r"^(stock|plugin) +([0-9.e+-]+) ", differences, re.M))  # loss
    assert float(rows["stock"]) > 1e-3 and float(rows["plugin"]) <= REL, output[-3000:]
    assert re.search(r"^plugin: exact \(largest difference", output, re.M), output[-3000:]
    metrics = work / "out" / "rl-metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2], output[-4000:]
    for record in records:
        assert record["reduction"] == "sequence_mean"
        assert (record["num_sequences"], record["num_tokens"]) == (5, 49)
        assert record["lm_loss"] == pytest.approx(record["loss"], rel=REL)


@pytest.mark.unit
def test_cpu_attention_runs_each_packed_segment_alone() -> None:
    """On CPU, ``thd`` packed-sequence parameters are served one ``cu_seqlens`` segment at a
    time, each causal; a micro-batch of more than one row is refused with one line."""
    from megatron_lossfix.integrations.megatron_lm.cpu import _attend_per_segment

    calls = []

    def local_attention(self, query, key, value, mask, attn_mask_type=None,
                        attention_bias=None, packed_seq_params=None):  # fmt: skip
        # What Megatron's DotProductAttention returns: [s, b, heads * dim].
        assert packed_seq_params is None and query.shape[1] == 1
        calls.append((query.shape[0], mask.clone()))
        return (query + key + value).flatten(2) * query.shape[0]

    class Packed:
        qkv_format = "thd"
        cu_seqlens_q = cu_seqlens_kv = torch.tensor([0, 2, 2, 5, 5])
        cu_seqlens_q_padded = cu_seqlens_kv_padded = None

    attend = _attend_per_segment(local_attention)
    q, k, v = (torch.randn(5, 2, 3) for _ in range(3))
    out = attend(None, q, k, v, None, packed_seq_params=Packed())
    assert [n for n, _ in calls] == [2, 3]  # the empty segment is skipped
    assert all(torch.equal(m[0, 0], torch.ones(n, n, dtype=torch.bool).triu(1)) for n, m in calls)
    want = torch.cat([(q + k + v)[:2].flatten(1) * 2, (q + k + v)[2:].flatten(1) * 3])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="--micro-batch-size 1") as info:
        attend(None, q[:, None], k[:, None], v[:, None], None, packed_seq_params=Packed())
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------ rows read
def _rollouts(*turns: int) -> list[list[_Rollout]]:
    """Groups of 2 rollouts of these numbers of turns."""
    rollouts = [_Rollout(n) for n in turns]
    return [rollouts[i : i + 2] for i in range(0, len(rollouts), 2)]


@pytest.mark.unit
def test_a_step_that_reads_a_layout_dependent_subset_of_rows_is_found() -> None:
    """Before core_v0.19.0 the step reads ``rollouts // DP`` rows on each rank (it counts
    rollouts), from the rows of that rank's rollouts: the ``multi`` set (turns 1, 2, 1, 1) holds
    5 rows, of which 1 rank reads 4 and DP2 (3 and 2 rows) 2 each; packed, the ranks' rows are
    gathered as equal blocks. Single-turn rollouts are read once at every layout."""
    unread = megatron_lm_rl_groups.unread_rows
    multi = _rollouts(1, 2, 1, 1)
    one = unread(multi, data_parallel_size=1, sequence_packing=False)
    assert "5 rows" in one and "holds 5 rows and reads 4" in one and "core_v0.19.0" in one
    two = unread(multi, data_parallel_size=2, sequence_packing=False)
    assert "hold 3, 2 and read 2 each" in two and "\n" not in two
    assert unread(multi, data_parallel_size=1, sequence_packing=True) is None
    assert "hold 3, 2" in unread(multi, data_parallel_size=2, sequence_packing=True)
    # Every rank holds as many rows: packing reads each once; unpacked still drops rows.
    even = _rollouts(2, 1, 2, 1)
    assert unread(even, data_parallel_size=2, sequence_packing=True) is None
    assert unread(even, data_parallel_size=2, sequence_packing=False) is not None
    for size in (1, 2, 4):
        for packing in (False, True):
            assert unread(_rollouts(*[1] * 8), data_parallel_size=size,
                          sequence_packing=packing) is None  # fmt: skip
    dropped = unread(_rollouts(1, 1, 1, 1, 1, 1), data_parallel_size=4, sequence_packing=True)
    assert "6 rollouts" in dropped and "drops the last 2" in dropped


class _RLUtils:
    """What ``install`` wraps: a ``prepare_data_for_update`` recording that it ran."""

    def __init__(self, pads_rows: bool) -> None:
        self.calls: list[int] = []
        if pads_rows:
            self.PAD_TURN_UNIT = None

        def prepare_data_for_update(model, ref_state_dict, rollouts, tokenizer,
                                    sequence_packing, is_correction):  # fmt: skip
            self.calls.append(len(rollouts))
            return _Rollout(0)  # stands for the data iterator (the record is keyed by it)

        self.prepare_data_for_update = prepare_data_for_update


@pytest.mark.unit
@pytest.mark.parametrize("world", [1, 2])
def test_the_rl_step_refuses_a_layout_dependent_subset_before_it_trains(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    """Under ``--loss-reduction``, a Megatron-LM that does not pad rows refuses the ``multi``
    rollouts in ``prepare_data_for_update``, before it builds the step, in one line naming the
    release that pads them; without the flag (stock), or where the rows are padded, it runs."""
    import types

    from megatron.core import mpu

    args = argparse.Namespace(loss_reduction="sequence_mean", micro_batch_size=1)
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setattr(mpu, "get_data_parallel_world_size", lambda: world)
    monkeypatch.setattr(mpu, "get_data_parallel_rank", lambda: 0)

    def call(utils: _RLUtils) -> object:
        return utils.prepare_data_for_update(None, {}, _rollouts(1, 2, 1, 1), None, False, False)

    before = _RLUtils(pads_rows=False)
    megatron_lm_rl_groups.install(before)
    with pytest.raises(ValueError) as info:
        call(before)
    line = str(info.value)
    assert line.startswith("megatron_lossfix: --loss-reduction: ") and "\n" not in line
    assert "core_v0.19.0" in line and before.calls == []
    args.loss_reduction = None  # stock Megatron-LM: unchanged
    call(before)
    args.loss_reduction = "sequence_mean"
    padded = _RLUtils(pads_rows=True)
    megatron_lm_rl_groups.install(padded)
    call(padded)
    assert before.calls == padded.calls == [2]


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", TAGS or ["none"])
def test_train_rl_refuses_a_multi_turn_step_before_core_v0_19(
    rl_runs: _RLRuns, tag: str, tmp_path: Path
) -> None:
    """Before core_v0.19.0 stock Megatron-LM trains a layout-dependent subset of the ``multi``
    set's 5 rows (4 on 1 rank, 4 others on DP2); the package's ``compare`` (stock, then the
    plugin, on 1 rank and DP2) shows it, and the plugin's step is refused on every rank with
    one line naming core_v0.19.0, before it trains. From core_v0.19.0 the rows are padded:
    ``test_train_rl_plugin_is_layout_invariant`` checks the set there."""
    from helpers.megatron_lm_rl import compare

    tree = rl_runs.tree(tag)
    if _pads_rows(tree):
        pytest.skip(f"{tag} pads the rows: the layout test checks the multi set there")
    printed: list[str] = []
    with slots(2):
        code = compare(tree, rollout_set="multi", loss_reduction="sequence_mean",
                       out=tmp_path, echo=printed.append)  # fmt: skip
    text = "\n".join(printed)
    assert code == 2, text
    for nproc in (1, 2):
        (stock,) = [json.loads(line) for line in (tmp_path / f"ranks{nproc}.jsonl").open()]
        assert stock["loss_reduction"] is None and stock["num_sequences"] == 4, (nproc, stock)
        for rank in range(nproc):
            output = (tmp_path / f"ranks{nproc}.rank{rank}.log").read_text()
            lines = re.findall(r"ValueError: (megatron_lossfix: .*)", output)
            assert len(lines) == 1 and "core_v0.19.0" in lines[0], (nproc, rank, output[-3000:])
            assert "layout-dependent subset of this step's 5 rows" in lines[0], lines[0]
    assert "refused: megatron_lossfix: --loss-reduction: " in text, text


# ------------------------------------------------------------------ tensor and pipeline parallel
#: Model-parallel layouts of the RL step, each against one rank: name -> (ranks, flags).
MP_LAYOUTS = {
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
    "TP2 x DP2": (4, ["--tensor-model-parallel-size", "2"]),
}
#: The modes of those launches: one per count the weights use (tokens, sequences, groups);
#: ``sum`` and ``seq_mean_token_sum_norm`` are these counts times constants.
MP_MODES = ("token_mean", "sequence_mean", "group_mean")
#: Their steps: (set, sequence packing, sequences per bin), each under stock Megatron-LM and
#: every mode of MP_MODES, in an order whose micro-batch count never decreases.
MP_STEPS = (("prefix_chain", False, None), ("multi", False, None), ("single", False, None),
            ("packed", True, 2))  # fmt: skip
#: Where the model-parallel launches run: on main only when MEGATRON_LM_TAGS asks for it (one
#: release keeps the suite's time down).
MP_TAGS = [t for t in TAGS if t != "main" or __import__("os").environ.get("MEGATRON_LM_TAGS")]
#: The launch that starts PP2 from its own random weights (Megatron-LM seeds stage p with
#: seed + 100 p): the reproduction of what makes PP2 differ without a shared checkpoint.
PP2_SEEDED = "PP2, own initial weights"
#: Its iterations: the multi-turn set (else the first of the release), stock and token_mean.
SEEDED_SET = "multi"


def _mp_steps(tree: Path) -> list[tuple]:
    """(set, packing, per_bin, mode) of each iteration of the model-parallel launches."""
    pads_rows = _pads_rows(tree)
    return [(name, packing, per_bin, mode) for name, packing, per_bin in MP_STEPS
            if pads_rows or name not in PADDED_SETS for mode in (None, *MP_MODES)]  # fmt: skip


def _seeded(steps: list[tuple]) -> list[int]:
    """The indices in ``steps`` of the iterations of the PP2 launch from its own weights."""
    name = SEEDED_SET if any(step[0] == SEEDED_SET for step in steps) else steps[0][0]
    return [
        i for i, step in enumerate(steps) if step[0] == name and step[3] in (None, "token_mean")
    ]


class _LayoutRuns:
    """Per tag: one rank (which saves its initial weights), then TP2, PP2 and TP2 x DP2 started
    from them, and PP2 from its own random weights; all with ``--calculate-per-token-loss``
    (what Megatron-LM's RL examples use). The tests read their records."""

    def __init__(self, root: Path, trees: _RLRuns) -> None:
        self.root = root
        self.trees = trees  # the patched checkouts (and so the zygotes) of the DP launches
        self.runs: dict[str, tuple[list[tuple], dict]] = {}

    def get(self, tag: str) -> tuple[list[tuple], dict]:
        """(steps, {layout: records}) of ``tag``; layout ``"1"`` is the one-rank run."""
        if tag not in self.runs:
            from helpers.megatron_lm_rl import RLRun, rollout_sets, run_waves
            from helpers.megatron_lm_run import checkout_null_tokenizer_eod

            tree = self.trees.tree(tag)
            eod = checkout_null_tokenizer_eod(tree)
            steps = _mp_steps(tree)
            plan = _plan(steps, rollout_sets(eod))
            initial = self.root / f"{tag}-initial"
            # TP2 pads the vocabulary to a multiple of 2 x this: the same size as one rank's.
            vocab = ["--make-vocab-size-divisible-by", str(-(-(eod + 1) // 2))]
            load = ["--load", str(initial), "--finetune", "--no-load-optim", "--no-load-rng"]
            save = ["--save", str(initial), "--save-interval", str(len(steps))]
            seeded = [plan[i] for i in _seeded(steps)]
            # The one-rank run first: at learning rate 0 it saves its initial weights.
            waves = [{"1": RLRun(1, plan, vocab + save)},
                     {**{name: RLRun(n, plan, vocab + flags + load)
                         for name, (n, flags) in MP_LAYOUTS.items()},
                      PP2_SEEDED: RLRun(2, seeded, vocab + MP_LAYOUTS["PP2"][1])}]  # fmt: skip
            self.runs[tag] = (steps, run_waves(tree, self.root, tag, waves))
        return self.runs[tag]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory, rl_runs: _RLRuns) -> _LayoutRuns:
    return _LayoutRuns(tmp_path_factory.mktemp("megatron-lm-rl-layouts"), rl_runs)


def _real_rows(weights: torch.Tensor) -> list[tuple]:
    """The rows (or packed bins) of a step's weights that hold a loss token, in a canonical
    order (data-parallel ranks split the rows and add padding rows and empty bins)."""
    return sorted(map(tuple, weights[weights.ne(0).any(dim=1)].tolist()))


def _loss_diff(a: float, b: float) -> float:
    """How far apart two step losses are: relative to ``max(|a|, 1)``. The modes' losses are
    means (weights summing to 1) of per-token losses of order 1 whose terms largely cancel
    (advantages of both signs): relative to a loss near 0, float32 rounding looks large."""
    return abs(a - b) / max(abs(a), 1.0)


def _norm_diff(a: dict, b: dict) -> float:
    return abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", MP_TAGS or ["none"])
def test_train_rl_tensor_and_pipeline_parallel(
    layout_runs: _LayoutRuns, tag: str, report_figure
) -> None:
    """TP2, PP2 and TP2 x DP2 against one rank, every layout started from the same weights
    (one rank's initial ones, through a checkpoint), with ``--calculate-per-token-loss``, on
    every rollout set: each starts from exactly one rank's parameters; under each of MP_MODES
    the plugin's weights of every real row or bin and its counts are exactly one rank's,
    and the loss (:func:`_loss_diff`), the grad norm and the full gradient agree to 1e-6.
    Stock Megatron-LM agrees too where nothing is padded (TP2, PP2); under TP2 x DP2 its
    gradient is one rank's times tokens / (tokens + padding rows or empty bins)."""
    steps, records = layout_runs.get(tag)
    one = records["1"]
    report_figure(f"Megatron-LM RL {tag}, per-token, against 1 rank: | layout | stock grad "
                  "norm | stock gradient | plugin grad norm | plugin gradient |")  # fmt: skip
    for layout in MP_LAYOUTS:
        worst = {"stock": [0.0, 0.0], "plugin": [0.0, 0.0]}
        for i, (name, packing, _, mode) in enumerate(steps):
            a, b = one[i], records[layout][i]
            assert b["grad_names"] == a["grad_names"], (layout, i)
            assert torch.equal(b["param"], a["param"]), (layout, i)  # the same model
            cell = worst["stock" if mode is None else "plugin"]
            cell[:] = max(cell[0], _norm_diff(a, b)), max(cell[1], _rel(a["grad"], b["grad"]))
            if mode is None:
                _, padding, tokens = _padding(tag, name, packing) if "DP2" in layout else (0, 0, 1)
                factor = tokens / (tokens + padding)
                assert _rel(factor * a["grad"], b["grad"]) <= REL, (layout, name, factor)
                continue
            assert _real_rows(b["weights"]) == _real_rows(a["weights"]), (layout, name, mode)
            for count in ("lossfix_num_tokens", "lossfix_num_sequences"):
                assert b[count] == a[count], (layout, name, mode, count)
            for loss in ("lossfix_loss", "lm_loss"):
                assert _loss_diff(a[loss], b[loss]) <= REL, (layout, name, mode, loss)
            assert _norm_diff(a, b) <= REL and _rel(a["grad"], b["grad"]) <= REL, (layout, mode)
        cells = " | ".join(f"{v:.1e}" for key in ("stock", "plugin") for v in worst[key])
        report_figure(f"Megatron-LM RL {tag}, per-token, against 1 rank: | {layout} | {cells} |")
    seeded = records[PP2_SEEDED]
    cells = [
        max(
            f(one[i], b)
            for i, b in zip(_seeded(steps), seeded, strict=True)
            if (steps[i][3] is None) == s
        )
        for s in (True, False)
        for f in (_norm_diff, lambda a, b: _rel(a["grad"], b["grad"]))
    ]
    report_figure(f"Megatron-LM RL {tag}, per-token, against 1 rank: | {PP2_SEEDED} | "
                  + " | ".join(f"{v:.1e}" for v in cells) + " |")  # fmt: skip


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", MP_TAGS or ["none"])
def test_train_rl_pp2_differs_by_its_initial_weights_alone(
    layout_runs: _LayoutRuns, tag: str
) -> None:
    """What makes PP2 from its own random weights differ from one rank: Megatron-LM seeds
    pipeline stage p with ``--seed`` + 100 p, so the second stage's layers start from other
    random matrices (the first stage's parameters, the norms and the biases are one rank's).
    The step itself is not the cause: the plugin's weights and counts of every row are still
    exactly one rank's; the gradient, which the grad norm hides (about 1e-3 apart), is
    another."""
    steps, records = layout_runs.get(tag)
    stages = records[PP2_SEEDED][0]["stage_files"]
    assert len(stages) == 2
    stage_names = [set(torch.load(path)["param"]) for path in stages]
    first = torch.load(records["1"][0]["stage_files"][0])["param"]  # one rank: one stage, all of it
    second_stage = {**torch.load(stages[0])["param"], **torch.load(stages[1])["param"]}
    moved = {name for name in first if not torch.equal(first[name], second_stage[name])}
    assert moved and all(name in stage_names[1] for name in moved), moved
    assert all(re.search(r"layers\.1\..*weight$", name) for name in moved), moved
    for i, b in zip(_seeded(steps), records[PP2_SEEDED], strict=True):
        a = records["1"][i]
        assert _rel(a["grad"], b["grad"]) > 0.1, i
        if steps[i][3] is not None:
            assert _real_rows(b["weights"]) == _real_rows(a["weights"]), i
            for count in ("lossfix_num_tokens", "lossfix_num_sequences"):
                assert b[count] == a[count], (i, count)


# ------------------------------------------------------------------ steps of a collection
def _stock_rows(row_rollouts: list[int], steps: int, size: int, mbs: int) -> list[list[int]]:
    """The rows stock Megatron-LM (core_v0.19.0 on) trains in each step of a collection: the
    rows padded to a multiple of DP x micro-batch size, one contiguous slice per rank, and
    step i reading the i-th part of every rank's slice (``ceil(rows / S)`` rows per step)."""
    rows = list(range(len(row_rollouts)))
    rows += [-1] * (-len(rows) % (size * mbs))
    slice_ = len(rows) // size
    per_step = -(-len(rows) // steps) // size
    return [sorted(r for k in range(size)
                   for r in rows[k * slice_ + i * per_step : k * slice_ + (i + 1) * per_step]
                   if r >= 0) for i in range(steps)]  # fmt: skip


def _planned_rows(plan: megatron_lm_rl_steps.StepRows, mbs: int) -> list[list[int]]:
    """What each step reads from a layout of :func:`plan_rows`, read as Megatron-LM reads it:
    rank r's contiguous slice, ``rows_per_step / (DP x mbs)`` micro-batches of ``mbs`` rows a
    step, cycling."""
    size = plan.data_parallel_size
    slice_ = len(plan.order) // size
    assert plan.rows_per_step % (size * mbs) == 0
    per_step = plan.rows_per_step // size
    return [sorted(o for k in range(size)
                   for o in plan.order[k * slice_ + i * per_step : k * slice_ + (i + 1) * per_step]
                   if o >= 0) for i in range(plan.steps)]  # fmt: skip


@pytest.mark.unit
def test_each_step_of_a_collection_reads_its_rollouts_rows_under_every_layout() -> None:
    """Under ``--loss-reduction`` step i of a collection reads the rows of the rollouts
    ``[i N / S, (i + 1) N / S)`` once, under every DP size and micro-batch size (multi-turn
    rollouts: several rows; padding rows fill each step to the same count). Stock Megatron-LM
    reads other rows under DP: the same check fails there."""
    turns = [1, 2, 1, 1, 3, 1, 1, 1, 2, 1, 1, 1]  # 12 rollouts, 16 rows
    row_rollouts = [k for k, n in enumerate(turns) for _ in range(n)]
    for steps in (1, 2, 3, 4):
        want = [[row for row, k in enumerate(row_rollouts) if k * steps // 12 == i]
                for i in range(steps)]  # fmt: skip
        for size in (1, 2, 4):
            for mbs in (1, 2):
                plan = megatron_lm_rl_steps.plan_rows(
                    row_rollouts, 12, steps=steps, data_parallel_size=size, micro_batch_size=mbs
                )
                assert _planned_rows(plan, mbs) == want, (steps, size, mbs)
                assert len(plan.order) == steps * plan.rows_per_step
    # Stock: step 1 of 2 on DP2 is not one rank's step 1 (the two steps of 8 rows).
    one, two = _stock_rows(list(range(8)), 2, 1, 1), _stock_rows(list(range(8)), 2, 2, 1)
    assert one == [[0, 1, 2, 3], [4, 5, 6, 7]] and two == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # A collection of fewer rollouts than sampled (main filters groups): still one share each.
    assert megatron_lm_rl_steps.step_of_rollouts(7, 3) == [0, 0, 1, 1, 2, 2, 2]


@pytest.mark.unit
def test_several_steps_per_collection_are_refused_before_core_v0_19_under_dp() -> None:
    """Before core_v0.19.0 (no patch of the rows) several optimizer steps per collection under
    DP train layout-dependent rows: one line naming core_v0.19.0 and the batch size that has
    one step; one DP rank, or one step per collection, runs. A global batch size that does not
    divide the collection is refused by ``check_args`` at every release."""
    args = argparse.Namespace(grpo_prompts_per_step=2, grpo_group_size=4, global_batch_size=4)
    line = megatron_lm_rl_groups.several_steps(args, 2)
    assert line is not None and "\n" not in line
    assert "core_v0.19.0" in line and "2 optimizer steps" in line and "--global-batch-size" in line
    assert megatron_lm_rl_groups.several_steps(args, 1) is None
    args.global_batch_size = 8
    assert megatron_lm_rl_groups.several_steps(args, 4) is None
    with pytest.raises(ValueError) as info:
        megatron_lm_rl.check_args(_args("--loss-reduction", "token_mean", global_batch_size=3,
                                        grpo_prompts_per_step=2, grpo_group_size=4))  # fmt: skip
    assert "--global-batch-size 3" in str(info.value) and "\n" not in str(info.value)
    stock = _args(global_batch_size=3, grpo_prompts_per_step=2, grpo_group_size=4)
    assert megatron_lm_rl.check_args(stock) is None  # stock: unchanged


#: The collection's layouts against one rank, all started from one rank's initial weights:
#: name -> (ranks, flags). The suite runs DP2, TP2 x DP2 and PP2 x DP2 (PP2 x DP2 added 6 s to
#: the launches' 36 s on two busy cores); MEGATRON_LM_TAGS (the full run that regenerates
#: docs/megatron_lm_rl.md's figures) adds DP4.
STEP_LAYOUTS = {
    "DP2": (2, []),
    "TP2 x DP2": (4, ["--tensor-model-parallel-size", "2"]),
    "DP4": (4, []),
    "PP2 x DP2": (4, ["--pipeline-model-parallel-size", "2"]),
}
FULL_RUN = bool(__import__("os").environ.get("MEGATRON_LM_TAGS"))
STEP_RUN_LAYOUTS = list(STEP_LAYOUTS) if FULL_RUN else ["DP2", "TP2 x DP2", "PP2 x DP2"]
#: The tags of the collection tests: those whose rows the patch lays out (core_v0.19.0 on),
#: main included in the Python 3.12 suite (56 s for its launches on two busy cores).
STEP_TAGS = [t for t in TAGS if t in ("core_v0.19.0", "main")]
#: Each collection of the ``steps`` set is three optimizer steps: (packing, mode) per collection.
COLLECTIONS = tuple((packing, mode) for packing in (False, True)
                    for mode in (None, "token_mean", "group_mean"))  # fmt: skip
#: The Adam trajectory (learning rate 1e-3): two collections, unpacked then packed.
ADAM = ((False, "token_mean"), (True, "group_mean"))
ADAM_LR = "1e-3"
#: Adam may amplify float32 rounding (its first steps move every weight by about lr): the
#: trajectories agree to this (measured: 4.4e-7), where stock's are 1e-2 apart after a step.
ADAM_REL = 1e-5


def _collection_plan(collections: tuple, rollouts: list) -> list[dict]:
    per = megatron_lm_rl_steps.steps_per_collection(argparse.Namespace(
        grpo_prompts_per_step=4, grpo_group_size=3, global_batch_size=4))  # fmt: skip
    return [{"rollouts": rollouts, "sequence_packing": packing, "max_sequences_per_bin": 2,
             "loss_reduction": mode}
            for packing, mode in collections for _ in range(per)]  # fmt: skip


class _StepRuns:
    """Per tag: one rank at learning rate 0 (saving its initial weights), then every layout of
    STEP_RUN_LAYOUTS at learning rate 0 and 1 rank and DP2 with Adam, all from those weights,
    with ``--calculate-per-token-loss``, on the ``steps`` set (three steps per collection)."""

    def __init__(self, root: Path, trees: _RLRuns) -> None:
        self.root, self.trees = root, trees
        self.runs: dict[str, dict] = {}
        self.seconds: dict[str, float] = {}

    def get(self, tag: str) -> dict:
        if tag not in self.runs:
            import time

            from helpers.megatron_lm_rl import RLRun, rollout_sets, run_waves
            from helpers.megatron_lm_run import checkout_null_tokenizer_eod

            start = time.monotonic()
            tree = self.trees.tree(tag)
            eod = checkout_null_tokenizer_eod(tree)
            rollouts = rollout_sets(eod)["steps"]
            initial = self.root / f"{tag}-initial"
            vocab = ["--make-vocab-size-divisible-by", str(-(-(eod + 1) // 2))]
            load = ["--load", str(initial), "--finetune", "--no-load-optim", "--no-load-rng"]
            lr0, adam = _collection_plan(COLLECTIONS, rollouts), _collection_plan(ADAM, rollouts)
            save = ["--save", str(initial), "--save-interval", str(len(lr0))]
            waves = [{"1": RLRun(1, lr0, vocab + save, rollout_set="steps")},
                     {**{name: RLRun(STEP_LAYOUTS[name][0], lr0,
                                     vocab + STEP_LAYOUTS[name][1] + load, rollout_set="steps")
                         for name in STEP_RUN_LAYOUTS},
                      "Adam 1": RLRun(1, adam, vocab + load, rollout_set="steps", lr=ADAM_LR),
                      "Adam DP2": RLRun(2, adam, vocab + load, rollout_set="steps",
                                        lr=ADAM_LR)}]  # fmt: skip
            self.runs[tag] = run_waves(tree, self.root, tag, waves)
            self.seconds[tag] = time.monotonic() - start
        return self.runs[tag]


@pytest.fixture(scope="module")
def step_runs(tmp_path_factory: pytest.TempPathFactory, rl_runs: _RLRuns) -> _StepRuns:
    return _StepRuns(tmp_path_factory.mktemp("megatron-lm-rl-steps"), rl_runs)


def _labels(collections: tuple) -> list[tuple]:
    """(packing, mode, step of its collection) of each iteration."""
    return [(packing, mode, k) for packing, mode in collections for k in range(3)]


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", STEP_TAGS or ["none"])
def test_train_rl_every_step_of_a_collection_is_layout_invariant(
    step_runs: _StepRuns, tag: str, report_figure
) -> None:
    """A collection of 12 rollouts (4 groups of 3) trained in three optimizer steps of 4
    (``--global-batch-size 4``; groups split between steps), packing off and on: under
    ``token_mean`` and ``group_mean`` every step's weights of the real rows or bins, counts,
    loss, grad norm and full gradient on each layout agree with one rank's to 1e-6, at learning
    rate 0 and (1 rank against DP2) over an Adam trajectory of two collections to 1e-5. Stock
    Megatron-LM trains other rows in each step under DP (its steps differ by 1e-1): the same
    check fails there, and failed for the plugin before the patch laid the rows out."""
    if tag == "none":
        pytest.skip("no Megatron-LM release that lays out a collection's rows")
    records = step_runs.get(tag)
    one = records["1"]
    head = (f"Megatron-LM RL {tag}, steps of a collection, per-token, grad norm against 1 rank "
            "(step 1, 2, 3): | layout | packing | stock | token_mean | group_mean |")  # fmt: skip
    report_figure(head)
    for layout in STEP_RUN_LAYOUTS:
        cells: dict[tuple, list[str]] = {}
        stock_worst = 0.0
        for i, (packing, mode, k) in enumerate(_labels(COLLECTIONS)):
            a, b = one[i], records[layout][i]
            assert torch.equal(b["param"], a["param"]), (layout, i)  # the same model
            cells.setdefault((packing, mode), []).append(f"{_norm_diff(a, b):.1e}")
            if mode is None:
                stock_worst = max(stock_worst, _rel(a["grad"], b["grad"]))
                continue
            where = (layout, packing, mode, k)
            assert _real_rows(b["weights"]) == _real_rows(a["weights"]), where
            for count in ("lossfix_num_tokens", "lossfix_num_sequences"):
                assert b[count] == a[count], (*where, count)
            assert _loss_diff(a["lossfix_loss"], b["lossfix_loss"]) <= REL, where
            assert _norm_diff(a, b) <= REL and _rel(a["grad"], b["grad"]) <= REL, where
        if layout == "DP2":
            assert stock_worst > 1e-2, stock_worst  # stock's steps are other rows under DP
        for packing in (False, True):
            row = " | ".join(" ".join(cells[(packing, m)]) for m in (None, "token_mean",
                                                                     "group_mean"))  # fmt: skip
            report_figure(f"{head.split(':')[0]}: | {layout} | {'on' if packing else 'off'} | "
                          f"{row} |")  # fmt: skip
    worst = 0.0
    for i, (packing, mode, k) in enumerate(_labels(ADAM)):
        a, b = records["Adam 1"][i], records["Adam DP2"][i]
        if i == 0:  # from the same initial weights: the first step's gradient is lr 0's
            assert _rel(one[3]["grad"], a["grad"]) <= REL and _rel(one[3]["grad"], b["grad"]) <= REL
        worst = max(worst, _norm_diff(a, b), _rel(a["param"], b["param"]))
        assert _norm_diff(a, b) <= ADAM_REL, (packing, mode, k, _norm_diff(a, b))
        assert _rel(a["param"], b["param"]) <= ADAM_REL, (packing, mode, k)
    assert not torch.equal(records["Adam 1"][-1]["param"], one[0]["param"])  # it trained
    report_figure(f"Megatron-LM RL {tag}, Adam (lr {ADAM_LR}), 1 rank against DP2, six steps: "
                  f"largest relative difference of grad norm and parameters {worst:.1e}; "
                  f"{step_runs.seconds[tag]:.0f} s for the launches")  # fmt: skip


@dataclasses.dataclass
class _Info:
    """The fields of Megatron-LM's ``PackingInfo``."""

    bin_seq_indices: list
    seq_starts: dict
    seq_lengths: list
    seq_to_bin_idx: list
    packing_algo: str = "fifo"


def _pack_pairs(trajs: torch.Tensor, masks: object) -> tuple:
    """A packer: two sequences a bin, longest first (the rows' first token is their length)."""
    lengths = [int(t[0]) for t in trajs]
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    bins = [order[k : k + 2] for k in range(0, len(order), 2)]
    packed = torch.stack([trajs[b[0]] for b in bins])
    starts = {k: [0, lengths[b[0]]][: len(b)] + [sum(lengths[j] for j in b)]
              for k, b in enumerate(bins)}  # fmt: skip
    info = _Info(bins, starts, lengths, [None] * len(lengths))
    return packed, packed.clone(), packed.float(), info


def _empty_bins(n: int, size: int, trajs, positions, mask, tokenizer) -> tuple:
    empty = torch.full((n, size), tokenizer.pad)
    entries = [{"bin_seq_indices": [], "seq_starts": []} for _ in range(n)]
    return empty, empty.clone(), empty.float(), entries


@pytest.mark.unit
@pytest.mark.parametrize("algo", ["fifo", "round-robin"])
def test_packed_bins_hold_each_steps_rows_under_every_layout(algo: str) -> None:
    """With sequence packing each step's rows are packed alone and padded with empty bins;
    Megatron-LM's bin split (``fifo`` or ``round-robin``) then gives every rank, in each step,
    bins of that step's rows only, and all of them over the ranks."""
    turns = [1, 2, 1, 1, 3, 1, 1, 1, 2, 1, 1, 1]
    row_rollouts = [k for k, n in enumerate(turns) for _ in range(n)]
    for size in (1, 2, 4):
        plan = megatron_lm_rl_steps.plan_rows(row_rollouts, 12, steps=3, data_parallel_size=size,
                                              micro_batch_size=1)  # fmt: skip
        plan.packing_algo = algo
        trajs = torch.tensor([[3 + (o % 5) if o >= 0 else 0, 1, 1, 1] for o in plan.order])
        packed, _, _, info = megatron_lm_rl_steps.pack_steps(-1, _pack_pairs, _empty_bins, trajs,
                                                             None, plan)  # fmt: skip
        total = packed.shape[0]
        assert total == 3 * plan.bins_per_step and plan.bins_per_step % size == 0
        for i in range(3):
            read = []
            for r in range(size):
                mine = (list(range(r, total, size)) if algo == "round-robin"
                        else list(range(r * total // size, (r + 1) * total // size)))  # fmt: skip
                share = plan.bins_per_step // size
                for b in mine[i * share : (i + 1) * share]:
                    read += [plan.order[p] for p in info.bin_seq_indices[b]]
            want = [row for row, k in enumerate(row_rollouts) if k * 3 // 12 == i]
            assert sorted(o for o in read if o >= 0) == want, (size, i)
            assert all(info.seq_to_bin_idx[p] is not None for p in range(len(plan.order)))


#: The tags before core_v0.19.0 whose several-steps refusal the Python 3.12 world checks besides
#: its release's (a launch runs the tree's own ``megatron`` package, first on its path): CI's
#: 3.12 suite runs it there at every landing. MEGATRON_LM_TAGS, when set, decides alone.
REFUSAL_TAGS = ("core_v0.17.1", "core_v0.18.2")
STEPS_REFUSAL_TAGS = TAGS + [
    t for t in REFUSAL_TAGS
    if TAGS and sys.version_info >= (3, 12) and t not in TAGS
    and not __import__("os").environ.get("MEGATRON_LM_TAGS")
]  # fmt: skip


@pytest.mark.e2e
@needs_megatron_lm
@pytest.mark.parametrize("tag", STEPS_REFUSAL_TAGS or ["none"])
def test_train_rl_refuses_several_steps_per_collection_before_core_v0_19(
    rl_runs: _RLRuns, tag: str, tmp_path: Path
) -> None:
    """Before core_v0.19.0 (where the patch does not lay out the rows) ``compare`` on the
    ``steps`` set (three steps per collection): one rank trains every step (nothing to mix),
    DP2 refuses the collection under the plugin, on both ranks, in one line naming
    core_v0.19.0; stock runs on both."""
    from helpers.megatron_lm_rl import compare

    if not (ARCHIVES / f"{tag}.tar.gz").is_file():
        skip_missing(f"{tag}.tar.gz in {ARCHIVES} (MEGATRON_LM_ARCHIVES)")
    tree = rl_runs.tree(tag)
    if _pads_rows(tree):
        pytest.skip(f"{tag} lays out a collection's rows: the collection test checks it there")
    printed: list[str] = []
    with slots(2):
        code = compare(tree, rollout_set="steps", loss_reduction="group_mean", out=tmp_path,
                       echo=printed.append)  # fmt: skip
    text = "\n".join(printed)
    assert code == 2, text
    one = [json.loads(line) for line in (tmp_path / "ranks1.jsonl").open()]
    two = [json.loads(line) for line in (tmp_path / "ranks2.jsonl").open()]
    assert [r["loss_reduction"] for r in one] == [None] * 3 + ["group_mean"] * 3, text
    assert [r["loss_reduction"] for r in two] == [None] * 3, text
    for rank in range(2):
        output = (tmp_path / f"ranks2.rank{rank}.log").read_text()
        lines = re.findall(r"ValueError: (megatron_lossfix: .*)", output)
        assert len(lines) == 1 and "core_v0.19.0" in lines[0], (rank, output[-3000:])
        assert "3 optimizer steps" in lines[0], lines[0]


@pytest.mark.unit
def test_order_rows_lays_out_rows_and_advantages_under_a_mode_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``order_rows`` (what the patched ``prepare_data_for_update`` calls) returns the rows and
    advantages unchanged without ``--loss-reduction`` and with ``off``; under a mode, laid out
    (padding rows ``pad`` with advantage 0), and the micro-batch calculator gets ``R``."""
    import types

    from megatron.core import mpu

    args = argparse.Namespace(loss_reduction=None, micro_batch_size=1, grpo_prompts_per_step=2,
                              grpo_group_size=2, global_batch_size=2)  # fmt: skip
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setattr(mpu, "get_data_parallel_world_size", lambda: 2)
    rollouts = [_Rollout(n) for n in (1, 2, 1, 1)]  # 5 rows; steps: rollouts 0-1, then 2-3
    rows = [(r, t) for r in rollouts for t in range(len(r.trajectory))]
    advantages = torch.arange(1.0, 6.0)
    for mode in (None, "off"):
        args.loss_reduction = mode
        assert megatron_lm_rl_steps.order_rows(rollouts, rows, advantages, "PAD") == (
            rows, advantages)  # fmt: skip
        assert megatron_lm_rl_steps.current() is None and megatron_lm_rl_steps.step_rows(7) == 7
    args.loss_reduction = "token_mean"
    laid, adv = megatron_lm_rl_steps.order_rows(rollouts, rows, advantages, "PAD")
    # Steps of 3 and 2 rows, padded to R = 4: rank 0 holds both steps' first halves.
    assert laid == [rows[0], rows[1], rows[3], rows[4], rows[2], "PAD", "PAD", "PAD"]
    assert adv.tolist() == [1.0, 2.0, 4.0, 5.0, 3.0, 0.0, 0.0, 0.0]
    assert megatron_lm_rl_steps.step_rows(7) == 4
