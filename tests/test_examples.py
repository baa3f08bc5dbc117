"""End-to-end: the example scripts under torchrun, two layouts of the same training run.

Runs that differ only in layout must write ``--metrics-out`` files whose loss and grad_norm
agree to 1e-5 relative for 3 iterations; with ``--loss-reduction off`` they must not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers.launch import Launch, launch, launch_side_by_side, slots

from megatron_lossfix.audit import pool

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


#: What the example scripts import, imported once for all their launches (helpers.launch).
PRELOAD = (*pool.PRELOAD, "train_loop")


def example_env() -> dict[str, str]:
    """The example launches' environment (one per test session: one zygote serves them all)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_example(script: str, nproc: int, out: Path, *args: str) -> list[dict]:
    """Launch ``examples/<script>`` as torchrun does and return its metrics records."""
    return run_examples((script, nproc, out, args))[0]


def run_examples(*runs: tuple[str, int, Path, Sequence[str]]) -> list[list[dict]]:
    """Launch each ``(script, nproc, out, args)`` as :func:`run_example` does, side by side
    where the cores allow, and return their records in order. The ranks fork from a process
    that imported :data:`PRELOAD` once (:mod:`helpers.launch`); the pages' commands and
    ``test_torchrun_mistake_prints_one_line_for_all_ranks`` launch with torchrun itself."""
    launches = [
        Launch(script=ROOT / "examples" / script, args=["--metrics-out", str(out), *args],
               nproc=nproc, cwd=ROOT, env=example_env(), preload=PRELOAD)
        for script, nproc, out, args in runs
    ]  # fmt: skip
    for job, result in zip(launches, launch_side_by_side(launches, timeout=600), strict=True):
        assert result.returncode == 0, f"{job.script} {job.args} failed:\n{result.output[-6000:]}"
    return [[json.loads(line) for line in out.read_text().splitlines()] for _, _, out, _ in runs]


def max_rel_diff(a: list[dict], b: list[dict], key: str) -> float:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    return max(abs(x[key] - y[key]) / abs(x[key]) for x, y in zip(a, b, strict=True))


COMMON = ["--train-iters", "3", "--global-batch-size", "12", "--seq-length", "64",
          "--hidden-size", "32", "--num-layers", "2"]  # fmt: skip


class ExampleRuns:
    """Each distinct launch of one example script once per test module (here the one-rank runs
    of test_pretrain_gpt_layouts_agree also serve test_off_reports_stocks_own_loss); the
    launches a test needs that have not run yet start side by side."""

    def __init__(self, root: Path, script: str) -> None:
        self.root, self.script = root, script
        self.done: dict[tuple[int, tuple[str, ...]], list[dict]] = {}

    def get(self, *runs: tuple[int, Sequence[str]]) -> list[list[dict]]:
        """The records of each ``(nproc, args)`` run of ``examples/<script>``."""
        keys = [(nproc, tuple(args)) for nproc, args in runs]
        missing = [key for key in dict.fromkeys(keys) if key not in self.done]
        launches = [(self.script, nproc, self.root / f"run-{len(self.done) + i}.jsonl", args)
                    for i, (nproc, args) in enumerate(missing)]  # fmt: skip
        self.done.update(zip(missing, run_examples(*launches), strict=True))
        return [self.done[key] for key in keys]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> ExampleRuns:
    return ExampleRuns(tmp_path_factory.mktemp("example-runs"), "pretrain_gpt.py")


def _one_rank(reduction: str) -> tuple[int, list[str]]:
    """One rank, one micro-batch of the whole step: the reference layout."""
    return 1, [*COMMON, "--micro-batch-size", "12", "--loss-reduction", reduction]


# sequence_mean through the example: test_pretrain_gpt_mtp_moe_layouts_agree (PP2, EP2, MTP).
@pytest.mark.e2e
@pytest.mark.parametrize("reduction", ["token_mean", "off"])
def test_pretrain_gpt_layouts_agree(runs, reduction):
    one, two = runs.get(
        _one_rank(reduction),
        (2, [*COMMON, "--micro-batch-size", "2", "--loss-reduction", reduction]),
    )
    assert len(one) == len(two) == 3
    for rec in one:
        assert {"iteration", "loss", "grad_norm", "num_tokens", "step_time_s"} <= set(rec)
    assert [r["num_tokens"] for r in one] == [r["num_tokens"] for r in two]
    loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
    if reduction == "off":
        assert max(loss_diff, norm_diff) > 1e-3, f"stock Megatron agreed: {loss_diff}, {norm_diff}"
    else:
        assert loss_diff <= TOL and norm_diff <= TOL, (reduction, loss_diff, norm_diff, one, two)


@pytest.mark.e2e
def test_off_reports_stocks_own_loss(runs):
    """One rank, one micro-batch: stock Megatron's loss is the token mean, so ``off``'s logged
    loss must equal ``token_mean``'s before the first update, at the first iteration
    (Megatron scales the loss tensor in place after the loss function returns; the metric must
    not see that). The one-rank runs of test_pretrain_gpt_layouts_agree."""
    off, exact = runs.get(_one_rank("off"), _one_rank("token_mean"))
    assert off[0]["iteration"] == exact[0]["iteration"] == 1
    assert abs(off[0]["loss"] - exact[0]["loss"]) <= TOL * exact[0]["loss"], (off, exact)


@pytest.mark.e2e
def test_pretrain_gpt_cp_layout_agrees(runs):
    """Context parallelism (attention-free layers on CPU) against one rank with one
    micro-batch. Expert parallelism: test_pretrain_gpt_mtp_moe_layouts_agree."""
    one, two = runs.get(
        (1, [*COMMON, "--micro-batch-size", "12", "--no-attention"]),
        (2, [*COMMON, "--micro-batch-size", "2", "--context-parallel-size", "2", "--no-attention"]),
    )
    loss_diff, norm_diff = max_rel_diff(one, two, "loss"), max_rel_diff(one, two, "grad_norm")
    assert loss_diff <= TOL and norm_diff <= TOL, (loss_diff, norm_diff)


# --- mistakes end as one line, before distributed start-up --------------------------------


def _script(name: str):
    """An example script as a module (its checks run in this process: no torch.distributed)."""
    spec = importlib.util.spec_from_file_location(name[:-3], ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scripts() -> dict:
    return {
        name: _script(name) for name in ("pretrain_gpt.py", "grpo_gpt.py", "bridge_pretrain.py")
    }


def _one_line_error(scripts, capsys, monkeypatch, name: str, args: list[str], **env: str) -> str:
    """Run ``main(args)`` as rank ``env["RANK"]`` of ``env["WORLD_SIZE"]``; it must exit 2 with
    at most one line, ``<script>: error: ...``, and no traceback. Returns that line."""
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        scripts[name].main(args)
    out = capsys.readouterr()
    assert exc.value.code == 2, out
    assert out.out == "" and "Traceback" not in out.err, out
    lines = out.err.strip().splitlines()
    assert len(lines) <= 1 and all(line.startswith(f"{name}: error: ") for line in lines), out
    return lines[0] if lines else ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro-batch-size", "0"], "argument --micro-batch-size: must be a positive integer"),
        (["--data-path", "no/such.jsonl"], "--data-path no/such.jsonl: No such file or directory"),
        (["--loss-norm-constant", "0"], "applies only to reduction seq_mean_token_sum_norm"),
        (["--loss-reduction", "seq_mean_token_sum_norm", "--loss-norm-constant", "inf"],
         "(--loss-norm-constant) must be > 0 and finite, got inf"),
        (["--lr", "-0.01"], "argument --lr: must be >= 0, got -0.01"),
        (["--clip-grad", "inf"], "argument --clip-grad: must be a finite number, got inf"),
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--lossfix-self-check-tolerance", "-1"],
         "argument --lossfix-self-check-tolerance: must be a finite number > 0, got -1"),
        (["--data-path", "{latin1}"], "latin1.jsonl, line 1: not UTF-8 (byte 0xff at column 11)"),
        (["--loss-reduction", "seq_mean_token_sum_norm", "--loss-norm-constant", "0"], "> 0"),
        (["--data-path", "{bad}"], "line 2: malformed JSON"),
        (["--global-batch-size", "10"], "--global-batch-size 10 is not divisible by"),
        (["--loss-reduction", "mean"], "invalid choice: 'mean'"),
    ],
    ids=["mbs0", "missing-data", "norm-constant", "norm-constant-inf", "lr", "clip", "seed",
         "self-check-tolerance", "not-utf8", "norm-constant-0", "bad-jsonl", "gbs", "mode"],
)  # fmt: skip
@pytest.mark.unit
def test_pretrain_mistakes_end_in_one_line(scripts, capsys, monkeypatch, tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": oops}\n')
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "\xff"}\n')
    args = [a.replace("{bad}", str(bad)).replace("{latin1}", str(latin1)) for a in args]
    line = _one_line_error(scripts, capsys, monkeypatch, "pretrain_gpt.py", args)
    assert message in line, (message, line)


@pytest.mark.unit
def test_layout_checks_use_torchruns_world_size(scripts, capsys, monkeypatch):
    """Every rank checks with torchrun's WORLD_SIZE; only global rank 0 prints, all exit 2."""
    args = ["--global-batch-size", "12", "--micro-batch-size", "4"]  # 12 % (2 x 4) != 0
    line = _one_line_error(
        scripts, capsys, monkeypatch, "pretrain_gpt.py", args, WORLD_SIZE="2", RANK="0"
    )
    assert "data-parallel size 2 x --micro-batch-size 4" in line
    assert "" == _one_line_error(
        scripts, capsys, monkeypatch, "pretrain_gpt.py", args, WORLD_SIZE="2", RANK="1"
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rollouts", "no/such.jsonl"], "--rollouts no/such.jsonl: No such file or directory"),
        (["--rollouts", "{bad}"], "line 1: 'response_ids' must be a list of token ids"),
        (["--pipeline-model-parallel-size", "2", "--num-layers", "2"], "sampling needs"),
        (["--seq-length", "10"], "--seq-length 10 is too short"),
        (["--num-generations", "0"], "argument --num-generations: must be a positive integer"),
        (["--temperature", "0"], "argument --temperature: must be a finite number > 0, got 0"),
        (["--clip-eps-low", "1.5"], "--clip-eps-low must be < 1"),
        (["--kl-coef", "nan"], "argument --kl-coef: must be a finite number, got nan"),
        (["--mtp-num-layers", "1"], "--mtp-num-layers is for pretrain_gpt.py"),
    ],
    ids=[
        "missing-rollouts",
        "bad-rollout",
        "sampling-pp",
        "seq-length",
        "generations",
        "temperature",
        "clip-eps-low",
        "kl-coef",
        "mtp",
    ],
)
def test_grpo_mistakes_end_in_one_line(scripts, capsys, monkeypatch, tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1], "response_ids": "x", "advantage": 1.0}) + "\n")
    args = [a.replace("{bad}", str(bad)) for a in args]
    line = _one_line_error(scripts, capsys, monkeypatch, "grpo_gpt.py", args)
    assert message in line, (message, line)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "-1"], "argument --lr: must be >= 0, got -1"),
        (["--micro-batch-size", "0"], "argument --micro-batch-size: must be a positive integer"),
        (["--loss-norm-constant", "5"], "applies only to reduction seq_mean_token_sum_norm"),
        (["--lora-alpha", "8"], "--lora-alpha and --pretrained-checkpoint need --lora-rank"),
        (["--lora-rank", "0"], "argument --lora-rank: must be a positive integer"),
        (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size needs --num-experts"),
        (["--num-experts", "3", "--expert-model-parallel-size", "2"], "must be a multiple of"),
        (["--moe-aux-loss-coeff", "-1"], "argument --moe-aux-loss-coeff: must be"),
    ],
    ids=[
        "lr",
        "mbs0",
        "norm-constant",
        "lora-alpha",
        "lora-rank0",
        "ep",
        "experts",
        "aux",
    ],
)
def test_bridge_mistakes_end_in_one_line(scripts, capsys, monkeypatch, args, message):
    """Checked before Bridge or Megatron is imported (Bridge need not be installed)."""
    line = _one_line_error(scripts, capsys, monkeypatch, "bridge_pretrain.py", args)
    assert message in line, (message, line)


@pytest.mark.unit
def test_bridge_mistake_is_printed_by_rank_0_only(scripts, capsys, monkeypatch):
    args = ["--lr", "-1"]  # every rank exits 2; only global rank 0 prints
    assert "" == _one_line_error(
        scripts, capsys, monkeypatch, "bridge_pretrain.py", args, WORLD_SIZE="2", RANK="1"
    )


def _help_of_loss_reduction(text: str) -> str:
    """``--loss-reduction``'s help in ``--help``'s output, on one line."""
    lines = text.split("\n  --loss-reduction ", 1)[1].split("\n  --", 1)[0]
    return " ".join(lines.split())


def _says_its_default(help_text: str, default: str | None) -> None:
    if default is None:
        assert "Not given: the plugin stays out" in help_text, help_text
    else:
        assert f"Not given: {default} " in help_text and "stays out" not in help_text, help_text


@pytest.mark.unit
@pytest.mark.parametrize("name", ["pretrain_gpt.py", "grpo_gpt.py", "bridge_pretrain.py"])
def test_loss_reductions_help_says_what_a_run_without_it_does(scripts, capsys, name):
    """The examples run token_mean without the flag (their banner says reduction=token_mean);
    the patched Megatron-LM keeps the plugin out. Each entry point's --help says its own."""
    with pytest.raises(SystemExit):
        scripts[name].parse_args(["--help"])
    _says_its_default(_help_of_loss_reduction(capsys.readouterr().out), "token_mean")
    assert scripts[name].parse_args([]).loss_reduction == "token_mean"
    from megatron_lossfix.args import add_lossfix_args

    megatron_lm = add_lossfix_args(argparse.ArgumentParser(prog="x"), megatron_lm=True)
    _says_its_default(_help_of_loss_reduction(megatron_lm.format_help()), None)
    assert megatron_lm.parse_args([]).loss_reduction is None


@pytest.mark.e2e
def test_own_loops_help_says_what_a_run_without_it_does():
    """own_loop.py parses at import (a script, not a module): its --help, as a user runs it."""
    cmd = [sys.executable, str(ROOT / "examples" / "own_loop.py"), "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _says_its_default(_help_of_loss_reduction(proc.stdout), "token_mean")


@pytest.mark.e2e
def test_torchrun_mistake_prints_one_line_for_all_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "pretrain_gpt.py"), "--micro-batch-size", "0"]  # fmt: skip
    with slots(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("pretrain_gpt.py: error:") == 1, output
    # torchrun reports the failed ranks in its own block; no frame of ours is in it.
    assert 'examples/pretrain_gpt.py", line' not in output
    assert "megatron_lossfix/" not in output.replace(str(ROOT), ""), output


# --- what the data loses is counted and logged ----------------------------------------------


def _expected_losses(records: list[dict], seq_length: int) -> dict:
    """Plain-Python reference of the per-step counts for a step that holds every record once:
    label positions are prompt bytes (no loss), then response bytes and the eos (loss)."""
    out = {"truncated_samples": 0, "cut_loss_tokens": 0, "no_loss_token_samples": 0,
           "eos_only_samples": 0, "empty_text_samples": 0}  # fmt: skip
    for rec in records:
        prompt = len(rec.get("prompt", "").encode())
        target = len((rec.get("response") if "prompt" in rec else rec["text"]).encode())
        positions = prompt + target + 1
        kept = max(0, min(seq_length, positions) - prompt)
        out["truncated_samples"] += positions > seq_length
        out["cut_loss_tokens"] += target + 1 - kept
        out["no_loss_token_samples"] += kept == 0
        out["eos_only_samples"] += target == 0 and kept > 0 and "prompt" in rec
        out["empty_text_samples"] += target == 0 and kept > 0 and "prompt" not in rec
    return out


@pytest.mark.e2e
def test_pretrain_logs_what_the_data_loses(tmp_path):
    records = [
        {"prompt": "P" * 200, "response": "never seen"},  # the prompt fills the window
        {"prompt": "Q", "response": "R" * 300},  # the response is cut
        {"prompt": "Say nothing.", "response": ""},  # trains on the eos alone
        {"text": "A short text."},  # fits
        {"text": ""},  # an empty text: the eos alone, counted apart from empty responses
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    # One step holds every record once (global batch = number of records).
    args = ["--data-path", str(data), "--seq-length", "64", "--global-batch-size", "5",
            "--micro-batch-size", "5", "--train-iters", "2", "--hidden-size", "32",
            "--num-layers", "2"]  # fmt: skip
    args += ["--metrics-out", str(tmp_path / "out" / "m.jsonl")]
    script = ROOT / "examples" / "pretrain_gpt.py"
    run = launch(script, 1, args, cwd=ROOT, env=example_env(), preload=PRELOAD)
    assert run.returncode == 0, run.output[-6000:]
    want = _expected_losses(records, 64)
    assert want["truncated_samples"] == 2 and want["no_loss_token_samples"] == 1  # the data
    metrics = [json.loads(line) for line in (tmp_path / "out" / "m.jsonl").read_text().splitlines()]
    for rec in metrics:
        assert {k: rec[k] for k in want} == want
    lines = [line for line in run.output.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 2
    for line in lines:
        assert f"truncated: 2 ({want['cut_loss_tokens']} loss tokens cut)" in line
        assert "no loss tokens: 1" in line and "eos only: 1" in line and "empty text: 1" in line
    assert "data: 10 samples over 2 iterations at --seq-length 64: 4 truncated" in run.output


#: MTP and MoE in one model: MTP layers that Megatron places on the last pipeline stage (where
#: it ties a copy of the embedding), and experts split over the ranks. Aux losses stay off: by
#: design they keep stock semantics.
MTP_MOE = [*COMMON, "--mtp-num-layers", "2", "--position-embedding-type", "rope",
           "--num-experts", "4"]  # fmt: skip


# In noxfile.RELEASE_TESTS (the exact case): every megatron-core release builds and trains these.
@pytest.mark.e2e
@pytest.mark.parametrize("reduction", ["sequence_mean", "off"])
def test_pretrain_gpt_mtp_moe_layouts_agree(runs, reduction):
    """Two MTP layers and 4 experts: one rank with one micro-batch against PP2 and against
    DP2 with the experts split over both ranks (EP2), 2-sequence micro-batches. The grad norm
    covers the MTP gradient, which the plugin normalizes like the main loss; stock Megatron's
    per-micro-batch MTP means differ."""
    args = [*MTP_MOE, "--loss-reduction", reduction]
    one, pp2, ep2 = runs.get(
        (1, [*args, "--micro-batch-size", "12"]),
        (2, [*args, "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"]),
        (2, [*args, "--micro-batch-size", "2", "--expert-model-parallel-size", "2"]),
    )
    for name, two in (("pp2", pp2), ("dp2-ep2", ep2)):
        norm_diff = max_rel_diff(one, two, "grad_norm")
        if reduction == "off":
            assert norm_diff > 1e-3, f"{name}: stock Megatron's MTP agreed: {norm_diff}"
            continue
        assert norm_diff <= TOL and max_rel_diff(one, two, "loss") <= TOL, (name, one, two)
        for key in ("mtp_loss_1", "mtp_loss_2"):
            assert max_rel_diff(one, two, key) <= TOL, (name, key)


@pytest.mark.unit
def test_the_examples_model_config_warns_nothing():
    """The examples' ``TransformerConfig`` (the quick start's model) sets no deprecated option:
    the CUDA-graph option's default, ``"full"`` (``cuda_graph_scope`` up to megatron-core 0.17,
    ``cuda_graph_modules`` from 0.18), warned "full scope is deprecated" in every run, and the
    examples now pass the empty list, which means the same."""
    import warnings

    import megatron.core.transformer  # noqa: F401 (its import-time warnings are not the config's)
    from gpt_model import _config, add_model_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config(parser.parse_args([]), per_token_loss=False, bf16=False)
    said = [str(w.message) for w in caught if w.filename.endswith("transformer_config.py")]
    assert not [m for m in said if "deprecated" in m], said


#: The longest an example may be: each is read whole, as a recipe (the project's rule).
EXAMPLE_LINES = 250


@pytest.mark.unit
def test_every_example_is_short_enough_to_read_whole():
    """Every ``examples/*.py`` has at most ``EXAMPLE_LINES`` lines; a longer one is split along
    a concept (as ``benchmark.py``'s tables went to ``benchmark_report.py``)."""
    lengths = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "examples").glob("*.py")}
    assert lengths, "no examples found"
    longer = {name: n for name, n in lengths.items() if n > EXAMPLE_LINES}
    assert not longer, f"examples over {EXAMPLE_LINES} lines: {longer}"
