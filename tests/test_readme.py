"""The README's commands stay true.

* CI runs exactly the README's test command.
* Every other shell command in the README's fenced blocks runs, as written, on a fresh copy of
  the repository, and exits 0 without a Python traceback. Exceptions are listed in ``SKIPPED``
  with their reason (a Megatron-LM checkout, a template, the test command itself) and show up
  as skipped tests.
* What they write lands in git-ignored folders: the copy's ``git status`` stays clean.
* The figures the README states for them are the ones they print: the quick start's first and
  last loss, the agreement of the two layouts, the GRPO reward, the audit's verdict.

Two substitutions make "as written" affordable. The installing half of a command
(``python3 -m venv .venv``, ``.venv/bin/pip install ...``) is not run: the suite already runs
in the environment that install makes (nox installs torch 2.13.0, megatron-core and this project
with its test extras; the quick start's ``-e .`` is the same minus the test tools), and a second
torch install would cost minutes and gigabytes. And ``.venv/bin/torchrun`` / ``.venv/bin/python``
/ ``python`` become this interpreter (``python -m torch.distributed.run`` is torchrun), with the
fresh copy first on ``PYTHONPATH``. The commands themselves are the README's, flags included, so
the whole run takes about two minutes on an idle 2-core machine (longer under load).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT.joinpath("README.md").read_text()

#: README commands that are not run here: (part of the command, why).
SKIPPED: tuple[tuple[str, str], ...] = (
    (
        ".ci-venv/bin/nox",
        "the test command itself: CI runs it verbatim (test_ci_runs_the_readme_test_command)",
    ),
    (
        "/path/to/megatron_lossfix",
        "installs into the reader's own environment; this suite runs in the installed project",
    ),
    (
        "/path/to/Megatron-LM",
        "needs a Megatron-LM checkout: tests/test_megatron_lm.py runs the patch commands on one "
        "where MEGATRON_LM_PATH is set",
    ),
    (
        "-p megatron_lossfix.testing.upstream_schedules",
        "runs Megatron-Core's own schedule tests from a Megatron-LM checkout: "
        "tests/test_upstream_schedules.py does where MEGATRON_LM_PATH is set",
    ),
    (
        "install_bridge.sh",
        "installs Megatron Bridge into the reader's environment; CI does it in its 3.12 world",
    ),
    (
        "examples/bridge_pretrain.py",
        "needs Megatron Bridge: tests/test_bridge.py runs these layouts where it is installed",
    ),
    (
        "torchrun ... pretrain_gpt.py",
        "a template (`...`, `<your flags>`) for the patched Megatron-LM, not a command",
    ),
)

#: The installing steps of a ``&&`` chain, not run (see the module docstring).
_INSTALL_STEP = re.compile(r"^(python3? -m venv \S+|\S*/bin/pip install .*)$")

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return _FENCE.findall(README)


def _commands() -> list[str]:
    """The shell commands of the README, in order: every line of ``bash`` blocks; in unlabeled
    blocks, the ``$ `` lines when there are any (the rest is output), else every line."""
    out = []
    for lang, body in _blocks():
        if lang not in ("", "bash", "sh", "console"):
            continue
        lines = [line.rstrip() for line in body.splitlines() if line.strip()]
        prompts = [line[2:] for line in lines if line.startswith("$ ")]
        if lang in ("bash", "sh"):
            out += [line.strip() for line in lines]
        else:
            out += [line.strip() for line in (prompts or lines)]
    return out


def _skip_reason(command: str) -> str | None:
    return next((why for part, why in SKIPPED if part in command), None)


def _runnable(command: str) -> str:
    """The command as this suite runs it: install steps dropped, interpreters substituted."""
    steps = [s.strip() for s in command.split(" && ")]
    steps = [s for s in steps if not _INSTALL_STEP.match(s)]
    python = shlex.quote(sys.executable)
    out = []
    for step in steps:
        step = re.sub(r"^\S*/bin/torchrun\b", f"{python} -m torch.distributed.run", step)
        step = re.sub(r"^(\S*/bin/python|python3?)\b", python, step)
        out.append(step)
    return " && ".join(out)


def _id(command: str) -> str:
    words = [w for w in command.split() if not w.startswith("-")]
    return " ".join(words[-3:])[:60]


COMMANDS = _commands()


def test_ci_runs_the_readme_test_command():
    test_cmd = next(c for c in COMMANDS if "nox" in c)
    ci_lines = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert test_cmd in ci_lines, f"README test command not run verbatim by .ci/run: {test_cmd}"


def test_readme_example_commands_parse():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "examples/pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = [c for c in COMMANDS if "examples/pretrain_gpt.py" in c]
    assert len(runs) >= 3
    for cmd in runs:
        tail = cmd.split("examples/pretrain_gpt.py", 1)[1]
        module.parse_args(shlex.split(tail))  # exits (SystemExit) on an unknown flag


def test_every_skip_names_a_readme_command():
    """A stale entry in SKIPPED would hide nothing but confuse; each must still match."""
    for part, _ in SKIPPED:
        assert any(part in c for c in COMMANDS), f"SKIPPED entry matches no README command: {part}"


def test_readme_commands_write_only_to_ignored_folders():
    """Outputs named on a README command line go under a folder git ignores (out/)."""
    for cmd in COMMANDS:
        for path in re.findall(r"--(?:metrics-out|out)\s+(\S+)", cmd):
            assert path.startswith("out/"), f"{cmd}: writes {path} outside out/"
    assert "/out/" in ROOT.joinpath(".gitignore").read_text().splitlines()


# ------------------------------------------------------------------------------ running them


def _fresh_copy(dest: Path) -> Path:
    """The repository's tracked and unignored files, as a fresh clone has them, committed in a
    new git repository so that `git status` shows what the commands leave behind."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.name=readme", "-c", "user.email=readme@test"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fresh clone"]):
        subprocess.run([*git, *args], cwd=dest, check=True, capture_output=True)
    return dest


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory) -> dict:
    """Run every runnable README command once, in README order, in one fresh copy (as a reader
    would); return ``{"copy": path, "runs": {command: CompletedProcess}}``."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to make the fresh copy")
    copy = _fresh_copy(tmp_path_factory.mktemp("fresh-clone"))
    path = os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    runs: dict[str, subprocess.CompletedProcess] = {}
    for command in COMMANDS:
        if _skip_reason(command) is not None:
            continue
        script = _runnable(command)
        if script in runs:  # the same command twice (intro and quick start): run once
            runs[command] = runs[script]
            continue
        proc = subprocess.run(
            ["bash", "-c", script], cwd=copy, env=env, capture_output=True, text=True, timeout=1200
        )
        runs[command] = runs[script] = proc
    return {"copy": copy, "runs": runs}


@pytest.mark.parametrize("command", COMMANDS, ids=[_id(c) for c in COMMANDS])
def test_readme_command_runs_as_written(readme_runs, command):
    reason = _skip_reason(command)
    if reason is not None:
        pytest.skip(reason)
    proc = readme_runs["runs"][command]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, f"{command} printed a traceback:\n{output[-4000:]}"


def test_readme_commands_leave_the_tree_clean(readme_runs):
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=readme_runs["copy"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert status == "", f"README commands left files git does not ignore:\n{status}"


def _run_of(readme_runs, needle: str) -> str:
    command = next(c for c in COMMANDS if needle in c)
    proc = readme_runs["runs"][command]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_quick_start_loss_is_as_stated(readme_runs):
    stated = re.search(
        r"loss falls from\s+about\s+([\d.]+)\s+to\s+about\s+([\d.]+)\s+in\s+(\d+)\s+iter", README
    )
    assert stated, "the quick start no longer states its loss figures"
    first, last, iters = float(stated[1]), float(stated[2]), int(stated[3])
    output = _run_of(readme_runs, "--train-iters 100 --log-interval 10")
    losses = {
        int(it): float(loss)
        for it, loss in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([\d.E+-]+)", output)
    }
    assert 1 in losses and iters in losses, output[-3000:]
    assert abs(losses[1] - first) <= 0.05 and abs(losses[iters] - last) <= 0.05, (
        f"README says about {first} -> {last}; measured {losses[1]:.3f} -> {losses[iters]:.3f}"
    )
    # Megatron's Transformer Engine/Apex fallback warning: once per run, not per module and rank.
    assert output.count("are not installed") <= 1, output[:4000]
    assert re.search(r"data: \d+ samples over \d+ iterations", output), output[-2000:]


def test_two_layouts_agree_as_stated(readme_runs):
    out = readme_runs["copy"] / "out"
    a = [json.loads(line) for line in (out / "a.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (out / "b.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        diff = max(abs(x[key] - y[key]) / abs(x[key]) for x, y in zip(a, b, strict=True))
        assert diff <= 1e-6, (key, diff)  # "agree to about 1e-7"


def test_grpo_reward_is_as_stated(readme_runs):
    stated = re.search(
        r"rises\s+from\s+([\d.]+)\s+at\s+the\s+first\s+iteration\s+to\s+([\d.]+)\s+by\s+the\s+"
        r"(\d+)th",
        README,
    )
    assert stated, "the RL section no longer states its reward figures"
    records = [
        json.loads(line)
        for line in (readme_runs["copy"] / "out" / "grpo.jsonl").read_text().splitlines()
    ]
    assert len(records) == 150
    by = int(stated[3])
    first, best = records[0]["reward_mean"], max(r["reward_mean"] for r in records[:by])
    last = records[-1]["reward_mean"]
    target = float(stated[2]) - 0.05
    assert abs(first - float(stated[1])) <= 0.02 and best >= target and last >= target, (
        f"README says {stated[1]} -> {stated[2]} by iteration {by}; measured {first:.3f}, "
        f"best {best:.3f} by then, {last:.3f} at the end"
    )


def test_audit_passes_as_stated(readme_runs):
    output = _run_of(readme_runs, "-m megatron_lossfix audit")
    assert "PASS: 0 plugin results above tolerance" in output, output[-3000:]
    assert (readme_runs["copy"] / "audit-out" / "audit.json").is_file()
