"""Megatron-LM's own RL loop (``train_rl.py``) through the plugin: exact under every layout.

Unit tests (no Megatron-LM): the refusals, the RL micro-batches the plugin reads, and the loss
callable the patched ``loss_func`` calls (its values, its reports, no host sync).

End to end, with ``MEGATRON_LM_ARCHIVES``: the real, patched ``train_rl.py`` of the installed
release's tag (and of ``main`` on Python >= 3.12) trains on CPU with fixed rollouts (the
package's replay, ``integrations.megatron_lm_rl_replay``): its real ``train() ->
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
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launch import slots
from helpers.megatron_lm_run import archive_tags, archives_folder, skip_reason, tags_to_test
from torch.overrides import TorchFunctionMode

from megatron_lossfix.integrations.megatron_lm import rl as megatron_lm_rl
from megatron_lossfix.integrations.megatron_lm import rl_groups as megatron_lm_rl_groups
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
def test_check_args_refuses_with_one_line_naming_the_flag() -> None:
    assert megatron_lm_rl.check_args(_args()) is None  # no flag: stock train_rl.py
    config = megatron_lm_rl.check_args(_args("--loss-reduction", "sequence_mean"))
    assert config.reduction == "sequence_mean"
    assert config.self_check is False  # the default first-step check: skipped here, silently
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


class _HostSyncs(TorchFunctionMode):
    """Records the tensor calls that copy a value to the host (a device sync on a GPU)."""

    SYNCS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.SYNCS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


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
    with _HostSyncs() as syncs:
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
            from helpers.megatron_lm_rl import (
                read_records,
                rl_args,
                rl_launch,
                rollout_sets,
                write_plan,
            )
            from helpers.megatron_lm_run import checkout_null_tokenizer_eod, run_pretrain_gpts

            tree = self.tree(tag)
            steps = _steps(tree)
            plan = _plan(steps, rollout_sets(checkout_null_tokenizer_eod(tree)))
            launches, outs = [], []
            for nproc, per_token in LAUNCHES:
                out = self.root / f"{tag}-n{nproc}-pt{int(per_token)}.jsonl"
                path = write_plan(out.with_suffix(".plan.json"), tree, plan, out=out)
                args = rl_args(train_iters=len(steps), per_token=per_token)
                launches.append(rl_launch(tree, path, args, nproc))
                outs.append(out)
            results = run_pretrain_gpts(launches, timeout=3000)
            records = {}
            for key, out, result in zip(LAUNCHES, outs, results, strict=True):
                assert result.returncode == 0, result.output[-6000:]
                records[key] = read_records(out)
                assert len(records[key]) == len(steps), result.output[-6000:]
            self.runs[tag] = (steps, records)
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


@pytest.mark.e2e
@needs_megatron_lm
def test_doc_cpu_command_runs_as_printed(tmp_path: Path) -> None:
    """``docs/megatron_lm_rl.md``'s CPU commands, as printed, on a fresh (unpatched) checkout
    of the suite's tag (core_v0.19.0 or main, which the page names): the patch applies,
    ``compare`` prints stock against the plugin, 1 rank against DP2, and finds the plugin
    exact, and ``train_rl.py --loss-reduction sequence_mean`` trains on 2 CPU ranks with the
    mode's metrics: 5 sequences (rows), 49 loss tokens, the logged loss L. Everything lands in
    ``out/``."""
    import os

    from helpers.megatron_lm_run import reuse_installed_helpers, unpack_tag

    tree = unpack_tag(ARCHIVES, TAGS[0], tmp_path / "checkout")
    if not _pads_rows(tree):
        pytest.skip(f"the page's CPU block is for core_v0.19.0 and main, not {TAGS[0]}")
    reuse_installed_helpers(tree)
    work = tmp_path / "work"  # the repository root as the reader has it; outputs land here
    work.mkdir()
    for name in ("megatron_lossfix", "patches"):
        (work / name).symlink_to(ROOT / name)
    script = _doc_cpu_command().replace("/path/to/Megatron-LM", str(tree))
    env = dict(os.environ)  # the reader's environment: this interpreter's bin first on PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")])
    with slots(2):
        proc = subprocess.run(["bash", "-c", f"set -e\n{script}"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=1800)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    assert sorted(p.name for p in work.iterdir()) == ["megatron_lossfix", "out", "patches"]
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
            from helpers.megatron_lm_rl import (
                read_records,
                rl_args,
                rl_launch,
                rollout_sets,
                write_plan,
            )
            from helpers.megatron_lm_run import checkout_null_tokenizer_eod, run_pretrain_gpts

            tree = self.trees.tree(tag)
            eod = checkout_null_tokenizer_eod(tree)
            steps = _mp_steps(tree)
            plan = _plan(steps, rollout_sets(eod))
            initial = self.root / f"{tag}-initial"
            # TP2 pads the vocabulary to a multiple of 2 x this: the same size as one rank's.
            vocab = ["--make-vocab-size-divisible-by", str(-(-(eod + 1) // 2))]
            load = ["--load", str(initial), "--finetune", "--no-load-optim", "--no-load-rng"]
            layouts = {"1": (1, ["--save", str(initial), "--save-interval", str(len(steps))]),
                       **{name: (n, flags + load) for name, (n, flags) in MP_LAYOUTS.items()},
                       PP2_SEEDED: (2, MP_LAYOUTS["PP2"][1])}  # fmt: skip
            records = {}
            # The one-rank run first: at learning rate 0 it saves its initial weights.
            for wave in (["1"], [name for name in layouts if name != "1"]):
                launches, outs = [], []
                for name in wave:
                    nproc, flags = layouts[name]
                    out = self.root / f"{tag}-{len(records) + len(outs)}.jsonl"
                    iterations = [plan[i] for i in _seeded(steps)] if name == PP2_SEEDED else plan
                    path = write_plan(out.with_suffix(".plan.json"), tree, iterations, out=out)
                    args = rl_args(train_iters=len(iterations), per_token=True) + vocab + flags
                    launches.append(rl_launch(tree, path, args, nproc))
                    outs.append(out)
                results = run_pretrain_gpts(launches, timeout=3000)
                for name, out, result in zip(wave, outs, results, strict=True):
                    assert result.returncode == 0, (name, result.output[-6000:])
                    records[name] = read_records(out)
                    want = len(_seeded(steps)) if name == PP2_SEEDED else len(steps)
                    assert len(records[name]) == want, (name, result.output[-6000:])
            self.runs[tag] = (steps, records)
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
