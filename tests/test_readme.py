"""The commands of the README and of the documentation pages stay true: checked, briefly run,
and their claims read from data.

The pages are the README and ``docs/*.md``; which of their blocks claim to run is
:mod:`helpers.doc_pages`'s rule (``text`` blocks are templates, held to having a placeholder).

* CI runs exactly the README's test command.
* Every shell command in the pages' fenced blocks is parsed (unit): each example script and
  the audit take its flags as written; every ``python`` block compiles.
* Every other command runs, briefly, on a fresh copy of the repository (e2e): training commands
  for ``BRIEF_ITERS`` iterations (``--train-iters`` replaced or added), the audit on
  ``BRIEF_LAYOUTS`` of its layouts. Each exits 0 without a Python traceback, and what they write
  lands in git-ignored folders: the copy's ``git status`` stays clean. Exceptions are listed in
  ``SKIPPED`` with their reason (they need Megatron-LM sources or Megatron Bridge, which other
  tests run; a template; the test command itself) and show up as skipped tests.
* The pages' claims are asserted from what those runs write (metrics JSON, ``audit.json``),
  not from their prose: the two layouts' metrics agree, each audit table's figures are what
  the audit measures on the layouts run, the main job's and the GRPO example's first iteration
  is what the pages state.

Two substitutions more make "as written" affordable. The installing half of a command
(``python3 -m venv .venv``, ``.venv/bin/pip install ...``) is not run: the suite already runs
in the environment that install makes (nox installs torch 2.13.0, megatron-core and this project
with its test extras; the quick start's ``-e .`` is the same minus the test tools), and a second
torch install would cost minutes and gigabytes. And ``.venv/bin/torchrun`` / ``.venv/bin/python``
/ ``python`` become this interpreter (``python -m torch.distributed.run`` is torchrun), with the
fresh copy first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
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
from helpers import doc_pages
from helpers.launch import slots

ROOT = Path(__file__).resolve().parents[1]
#: Every page, one after the other: where the stated figures are looked up.
PAGES = doc_pages.text()
#: Iterations of every training command the pages give (they state their own, up to 150).
BRIEF_ITERS = 3
#: The audit's layouts run here (the pages' command runs them all; tests/test_invariance.py and
#: tests/test_hard_layouts.py cover every one of them).
BRIEF_LAYOUTS = ("dp2-m3", "pp2-m4")

#: Commands of the pages that are not run here: (part of the command, why).
SKIPPED: tuple[tuple[str, str], ...] = (
    (
        "examples/benchmark.py",
        "a benchmark: minutes of timing rounds whose figures depend on the machine; it takes "
        "no --train-iters to run briefly",
    ),
    (
        "examples/step_cost.py",
        "a benchmark: where a step's time goes, by phase, over timing rounds whose figures depend "
        "on the machine; it takes no --train-iters to run briefly",
    ),
    (
        ".ci-venv/bin/nox",
        "the test command itself: CI runs it verbatim (test_ci_runs_the_readme_test_command)",
    ),
    (
        ".venv/bin/python -m pytest -m unit",
        "the unit tier: CI runs getting started's line as printed in the quick start's fresh "
        "clone, where it must pass (noxfile.py, quick_start_step), and the suite runs every "
        "unit test besides",
    ),
    (
        "/path/to/Megatron-LM",
        "needs Megatron-LM sources: tests/test_patches.py runs these patch commands on each "
        "tag's tree where MEGATRON_LM_ARCHIVES is set",
    ),
    (
        "-m megatron_lossfix rl-replay",
        "needs Megatron-LM sources: tests/test_megatron_lm_rl.py runs train_rl.py through this "
        "replay and its plans where MEGATRON_LM_ARCHIVES is set",
    ),
    (
        "-p helpers.upstream_schedules",
        "runs Megatron-Core's own schedule tests from Megatron-LM sources: "
        "tests/test_upstream_schedules.py does where MEGATRON_LM_ARCHIVES is set",
    ),
    (
        "install-bridge",
        "makes a Python 3.12 environment and installs Megatron Bridge into it; CI does it in "
        "its 3.12 world (tests/test_install_bridge.py checks its refusals, tests/test_bridge.py "
        "that the plugin's examples and audit still run in it)",
    ),
    (
        "python3.12 -m venv .venv-",
        "a page's install line (Python 3.12, torch's CUDA build, the stack or Megatron-LM's "
        "training dependencies): CI runs it as printed, in a fresh virtualenv of its own, and "
        "the page's tests there (noxfile.py, STACK_PAGES and PAGE_TESTS; "
        "tests/test_readme_stacks.py checks that every such page is listed)",
    ),
    (
        "source .venv-",
        "activates the environment a page's install line makes (above): CI runs the page's "
        "commands in it (noxfile.py, PAGE_TESTS: tests/test_megatron_lm_rl.py runs the "
        "Megatron-LM RL page's block after its install line)",
    ),
    (
        "megatron_lossfix audit --stack",
        "a stack audit needs its stack: tests/test_readme_stacks.py runs these commands in each "
        "stack's virtualenv (CI: the one its page's install line makes)",
    ),
    (
        "examples/bridge_pretrain.py",
        "needs Megatron Bridge: tests/test_bridge.py runs these layouts where it is installed",
    ),
    (
        "../Megatron-LM",
        "needs Megatron-LM's sources: tests/test_readme_megatron_lm.py runs these commands as "
        "printed with the sources from MEGATRON_LM_ARCHIVES",
    ),
)


def _skip_reason(command: str) -> str | None:
    return next((why for part, why in SKIPPED if part in command), None)


def _brief(step: str) -> str:
    """A training command for ``BRIEF_ITERS`` iterations; the audit on ``BRIEF_LAYOUTS``."""
    if re.search(r"examples/\w+\.py", step):
        if "--train-iters" in step:
            return re.sub(r"--train-iters\s+\d+", f"--train-iters {BRIEF_ITERS}", step)
        return f"{step} --train-iters {BRIEF_ITERS}"
    if "megatron_lossfix audit" in step and "--layouts" not in step:
        return f"{step} --layouts {','.join(BRIEF_LAYOUTS)}"
    return step


def _runnable(command: str) -> str:
    """The command as this suite runs it: install steps dropped, interpreters substituted,
    briefly (:func:`_brief`)."""
    steps = [s.strip() for s in command.split(" && ")]
    steps = [s for s in steps if not doc_pages.INSTALL_STEP.match(s)]  # not run (docstring)
    python = shlex.quote(sys.executable)
    out = []
    for step in steps:
        step = re.sub(r"\s+#.*$", "", step)  # a trailing comment
        step = re.sub(r"^\S*/bin/torchrun\b", f"{python} -m torch.distributed.run", step)
        step = re.sub(r"^(\S*/bin/python|python3?)\b", python, step)
        out.append(_brief(step))
    return " && ".join(out)


def _id(command: str) -> str:
    words = [w for w in command.split() if not w.startswith("-")]
    return " ".join(words[-3:])[:60]


COMMANDS = doc_pages.commands()


@pytest.mark.unit
def test_ci_runs_the_readme_test_command():
    """The README's test command, and every page's that repeats it, is what ``.ci/run`` runs."""
    readme = [
        c
        for page, lang, body in doc_pages.blocks("", "bash", "sh", "console")
        if page.name == "README.md"
        for c in doc_pages.block_commands(lang, body)
    ]
    test_cmd = next(c for c in readme if "nox" in c)
    ci_lines = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert test_cmd in ci_lines, f"README test command not run verbatim by .ci/run: {test_cmd}"
    for cmd in COMMANDS:
        if cmd.endswith("/bin/nox"):
            assert cmd == test_cmd, f"a page prints another test command: {cmd}"


#: NeMo-RL's page's inputs, and the archives in ../shared/nemo-rl that .ci/run names for them.
NEMO_RL = ("NEMO_RL_SOURCE", "MEGATRON_BRIDGE_SOURCE", "MEGATRON_LM_SOURCE")
NEMO_RL_ARCHIVES = ("NeMo-RL-7ea279a", "Megatron-Bridge-8c46dc4", "Megatron-LM-14346b6")


def _ci_run(tmp_path: Path, ci: str, inputs: bool) -> subprocess.CompletedProcess:
    """``.ci/run`` in a clone at ``tmp_path/clone`` with the Megatron-LM archives beside it (and
    slime's and AReaL's inputs with ``inputs``), stopped where it would install nox: a
    ``python3`` that prints the inputs it was given and fails."""
    clone, shared = tmp_path / "clone", tmp_path / "shared"
    (clone / ".ci").mkdir(parents=True)
    shutil.copy2(ROOT / ".ci" / "run", clone / ".ci" / "run")
    tags = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "main")
    names = [f"megatron-lm/{tag}.tar.gz" for tag in tags]
    if inputs:
        names += [
            "slime/slime-624b824.tar.gz",
            "areal/areal-tests-4aef98d.tar.gz",
            "roll/ROLL-8eb27cc.tar.gz",
            *(f"nemo-rl/{name}.tar.gz" for name in NEMO_RL_ARCHIVES),
        ]
    for name in names:
        (shared / name).parent.mkdir(parents=True, exist_ok=True)
        (shared / name).write_bytes(b"")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        '#!/bin/sh\necho "python3 $* SLIME_SOURCE=${SLIME_SOURCE:-} AREAL_TESTS=${AREAL_TESTS:-}'
        ' ROLL_SOURCE=${ROLL_SOURCE:-}"\nexit 3\n'
    )
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "CI": ci, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    gone = ("SLIME_SOURCE", "AREAL_TESTS", "ROLL_SOURCE", *NEMO_RL)
    env = {k: v for k, v in env.items() if k not in gone}
    return subprocess.run(["bash", str(clone / ".ci" / "run")], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_fails_in_one_line_without_slimes_or_areals_input(tmp_path, ci):
    """Under CI a missing input of the stacks' tests fails the run before anything installs,
    naming what is missing; elsewhere the run goes on, saying which tests are left out; with
    the inputs there, it exports them for the tests."""
    missing = " ".join(
        ["SLIME_SOURCE (../shared/slime/slime-624b824.tar.gz)",
         "AREAL_TESTS (../shared/areal/areal-tests-4aef98d.tar.gz)",
         "ROLL_SOURCE (../shared/roll/ROLL-8eb27cc.tar.gz)",
         *(f"{v} (../shared/nemo-rl/{a}.tar.gz)"
           for v, a in zip(NEMO_RL, NEMO_RL_ARCHIVES, strict=True))]
    )  # fmt: skip
    run = _ci_run(tmp_path, ci, inputs=False)
    if ci:
        assert run.returncode == 1 and "python3 -m venv" not in run.stdout, run
        want = f"CI needs its inputs beside the clone; missing: {missing}"
        assert run.stderr.strip() == want, run.stderr
    else:
        assert f"CI inputs missing, their tests are left out: {missing}" in run.stderr, run
        assert run.returncode == 3 and "python3 -m venv .ci-venv" in run.stdout, run
    run = _ci_run(tmp_path / "with", ci, inputs=True)
    assert run.returncode == 3 and "missing" not in run.stderr, run
    assert "SLIME_SOURCE=/" in run.stdout and "slime-624b824.tar.gz AREAL_TESTS=/" in run.stdout
    assert "areal-tests-4aef98d.tar.gz ROLL_SOURCE=/" in run.stdout and "ROLL-8eb27cc" in run.stdout


@pytest.mark.unit
def test_ci_makes_the_quick_start_environment_as_printed(monkeypatch):
    """CI's 3.11 world is the quick start's environment, made as a reader makes it: in a fresh
    clone, the README's install line, then getting started's unit-tier line (the unit tier runs
    there), each run as printed, read from its page (``doc_pages``) and retyped nowhere, with
    Python 3.11 as the lines' ``python3``. The default run starts that step ahead (``lint``),
    ``tests-3.11`` makes it when alone, and its tests run in that environment."""
    install, unit = doc_pages.quick_start_install(), doc_pages.unit_tier_line()
    assert install.startswith("python3 -m venv .venv && .venv/bin/pip install "), install
    assert unit.endswith(" && .venv/bin/python -m pytest -m unit"), unit
    monkeypatch.syspath_prepend(str(ROOT / ".ci"))
    nox_pages = importlib.import_module("nox_pages")
    monkeypatch.setattr(nox_pages, "fresh_clone", lambda dest: None)
    name, commands = nox_pages.quick_start_step("3.11", ("a-requirement",))
    lines = [i for i, command in enumerate(commands) if command[:2] == ("bash", "-c")]
    assert [commands[i][2] for i in lines] == [install, unit], commands
    # Before the lines: python3.11 makes a virtualenv whose python3 goes first on PATH, and the
    # lines run in the fresh clone (where .venv is made).
    assert commands[0][:3] == ("python3.11", "-m", "venv"), commands[0]
    python3 = os.path.join(commands[0][-1], "bin")
    before = commands[: lines[0]]
    assert ("cd", nox_pages.quick_start_tree("3.11")) in before, before
    assert any(
        c[0] == "export" and any(a.startswith(f"PATH={python3}{os.pathsep}") for a in c)
        for c in before
    ), before
    assert commands[-1][-1] == "a-requirement", commands[-1]  # the release's needs, after
    nox_files = [ROOT / "noxfile.py", *sorted(ROOT.joinpath(".ci").glob("nox_*.py"))]
    nox = "\n".join(path.read_text() for path in nox_files)
    for line in (install, unit):
        assert line not in nox, f"CI's nox files retype a page's line: {line}"
    sessions = {
        node.name: {call.func.id: call for call in ast.walk(node) if isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)}
        for node in ast.parse(nox_files[0].read_text()).body if isinstance(node, ast.FunctionDef)
    }  # fmt: skip
    for session in ("lint", "tests_311"):
        step = sessions[session].get("quick_start_step")
        assert step and ast.literal_eval(step.args[0]) == "3.11", f"{session} skips the step"
    runs = sessions["tests_311"].get("run_quick_start_tests")
    assert runs and ast.literal_eval(runs.args[1]) == "3.11", "tests-3.11 runs elsewhere"


@pytest.mark.unit
def test_text_blocks_are_templates():
    """A ``text`` block is not run, so each of its lines must hold a placeholder
    (``<your flags>``, ``...``, ``/path/to/``): a command that runs goes into a ``bash`` block."""
    blocks = doc_pages.blocks("text")
    assert blocks, "no text block: the rule checks nothing"
    for page, lang, body in blocks:
        for line in doc_pages.block_commands(lang, body):
            assert doc_pages.PLACEHOLDER.search(line), (
                f"{page.name}: runnable in a text block: {line}"
            )


@pytest.mark.unit
def test_python_blocks_compile():
    """Every ``python`` block of the pages is valid Python (the own-loop recipe also runs:
    tests/test_readme_recipe.py)."""
    blocks = doc_pages.blocks("python")
    assert len(blocks) >= 4, len(blocks)
    for page, _, body in blocks:
        compile(body, str(page.name), "exec")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
@pytest.mark.parametrize("script", ["pretrain_gpt", "grpo_gpt", "bridge_pretrain"])
def test_readme_example_commands_parse(script):
    """Each command of an example script on the pages, flags as written (the script's own parser
    exits with SystemExit on an unknown or malformed flag)."""
    module = _example(script)
    runs = [c for c in COMMANDS if f"examples/{script}.py" in c]
    assert runs, f"no page runs examples/{script}.py"
    for cmd in runs:
        tail = cmd.split(f"examples/{script}.py", 1)[1]
        args = module.parse_args(shlex.split(tail))
        assert args.train_iters > 0


@pytest.mark.unit
def test_readme_audit_commands_parse():
    from megatron_lossfix.audit.options import add_audit_args

    runs = [c for c in COMMANDS if "megatron_lossfix audit" in c]
    assert runs
    for cmd in runs:
        tail = cmd.split("megatron_lossfix audit", 1)[1].split("#", 1)[0]
        add_audit_args(argparse.ArgumentParser(exit_on_error=False)).parse_args(shlex.split(tail))


@pytest.mark.unit
def test_brief_runs_change_only_the_length():
    quick = next(c for c in COMMANDS if "--train-iters 100" in c)
    assert f"--train-iters {BRIEF_ITERS} " in _runnable(quick)
    grpo = next(c for c in COMMANDS if "examples/grpo_gpt.py" in c)
    assert _runnable(grpo).endswith(f"--train-iters {BRIEF_ITERS}")
    audit_cmd = next(c for c in COMMANDS if "megatron_lossfix audit" in c)
    assert _runnable(audit_cmd).endswith(f"--layouts {','.join(BRIEF_LAYOUTS)}")


@pytest.mark.unit
def test_every_skip_names_a_readme_command():
    """A stale entry in SKIPPED would hide nothing but confuse; each must still match."""
    for part, _ in SKIPPED:
        assert any(part in c for c in COMMANDS), (
            f"SKIPPED entry matches no command of the pages: {part}"
        )


def _created_by_the_pages() -> dict[str, str]:
    """A path inside each thing a command of the pages creates in the clone -> the command:
    its virtualenvs (``-m venv DIR``), the outputs it names (``--out``, ``--metrics-out``,
    ``--save``) and, for an audit without ``--out``, the audit's own folder."""
    from megatron_lossfix.audit.options import add_audit_args, default_out, options_from_args

    created = {}
    for cmd in COMMANDS:
        for venv in re.findall(r"-m venv (\S+)", cmd):
            created[f"{venv}/bin/python"] = cmd
        for flag, path in re.findall(r"--(metrics-out|out|save)\s+(\S+)", cmd):
            created[f"{path}/audit.json" if flag == "out" else path] = cmd
        if "megatron_lossfix audit" in cmd and "--out" not in cmd:
            tail = shlex.split(cmd.split("megatron_lossfix audit", 1)[1].split("#", 1)[0])
            opts = options_from_args(add_audit_args(argparse.ArgumentParser()).parse_args(tail))
            created[f"{default_out(opts)}/audit.json"] = cmd
    return {path: cmd for path, cmd in created.items() if not path.startswith(("..", "/"))}


@pytest.mark.unit
def test_what_the_pages_create_is_ignored():
    """Outputs named on a command line of the pages go under out/, and git ignores every
    virtualenv, output and audit folder the pages' commands create (a clone stays clean)."""
    for cmd in COMMANDS:
        written = re.findall(r"--(?:[\w-]+-)?out\s+(\S+)", cmd)  # --out, --lossfix-metrics-out, ...
        written += re.findall(r"write-plan\s+(\S+)|LOSSFIX_RL_PLAN=(\S+)", cmd)
        for path in filter(None, (w if isinstance(w, str) else "".join(w) for w in written)):
            assert path.startswith("out/"), f"{cmd}: writes {path} outside out/"
    created = _created_by_the_pages()
    assert {".venv/bin/python", ".venv312/bin/python", "audit-out/audit.json"} <= set(created)
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, text=True,
                          input="\n".join(created), capture_output=True)  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr  # 1: none ignored
    missed = {path: created[path] for path in set(created) - set(proc.stdout.splitlines())}
    assert not missed, f"not in .gitignore (path: the command that creates it): {missed}"


@pytest.mark.unit
def test_pages_that_need_python_312_say_how_to_find_it():
    """``python3.12`` depends on how Python was installed (a pyenv shim answers only for an
    active version): every page that starts it links to getting started's note on it."""
    guide = ROOT / "docs" / "getting_started.md"
    note = guide.read_text().split("\n## Python 3.12\n", 1)
    assert len(note) == 2, "docs/getting_started.md has no section 'Python 3.12'"
    assert "PYENV_VERSION=" in note[1].split("\n## ", 1)[0] and "pyenv prefix" in note[1]
    for page in doc_pages.pages():
        if page != guide and re.search(r"python3\.1[12]\b", page.read_text()):
            assert "getting_started.md#python-312" in page.read_text(), page.name


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
    """Run every runnable command of the pages once, in page order, in one fresh copy (as a
    reader would); return ``{"copy": path, "runs": {command: CompletedProcess}}``."""
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
        with slots(2):  # a page's command runs up to 2 ranks at a time
            proc = subprocess.run(["bash", "-c", script], cwd=copy, env=env, capture_output=True,
                                  text=True, timeout=1200)  # fmt: skip
        runs[command] = runs[script] = proc
    return {"copy": copy, "runs": runs}


@pytest.mark.e2e
@pytest.mark.parametrize("command", COMMANDS, ids=[_id(c) for c in COMMANDS])
def test_readme_command_runs_briefly(readme_runs, command):
    reason = _skip_reason(command)
    if reason is not None:
        pytest.skip(reason)
    proc = readme_runs["runs"][command]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, f"{command} printed a traceback:\n{output[-4000:]}"


@pytest.mark.e2e
def test_readme_commands_leave_the_tree_clean(readme_runs):
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=readme_runs["copy"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert status == "", f"the pages' commands left files git does not ignore:\n{status}"


def _run_of(readme_runs, needle: str) -> str:
    command = next(c for c in COMMANDS if needle in c)
    proc = readme_runs["runs"][command]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _metrics(readme_runs, name: str) -> list[dict]:
    path = readme_runs["copy"] / "out" / name
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
def test_quick_start_first_iteration_is_as_stated(readme_runs):
    """The quick start's first logged iteration: the loss and what the data lost, as stated."""
    stated = re.findall(r"loss falls from\s+about\s+([\d.]+)", PAGES)
    assert stated, "no page states the main job's first loss"
    truncated = re.findall(r"`(truncated: \d+ \(\d+ loss tokens cut\))`\s+at the first", PAGES)
    assert truncated, "no page states what the main job's first iteration truncates"
    output = _run_of(readme_runs, "--train-iters 100 --log-interval 10")
    first = re.search(r"iteration\s+1/\s*\d+ \|(.*)", output)
    assert first, output[-3000:]
    loss = float(re.search(r"lm loss: ([\d.E+-]+)", first[1])[1])
    for figure in stated:
        assert abs(loss - float(figure)) <= 0.05, f"a page says about {figure}; measured {loss}"
    for words in truncated:
        assert words in first[1], f"a page says {words!r}; logged {first[1]!r}"
    # Megatron's Transformer Engine/Apex fallback warning: once per run, not per module and rank.
    assert output.count("are not installed") <= 1, output[:4000]
    assert re.search(r"data: \d+ samples over \d+ iterations", output), output[-2000:]


@pytest.mark.e2e
def test_two_layouts_agree_as_stated(readme_runs):
    a, b = _metrics(readme_runs, "a.jsonl"), _metrics(readme_runs, "b.jsonl")
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        diff = max(abs(x[key] - y[key]) / abs(x[key]) for x, y in zip(a, b, strict=True))
        assert diff <= 1e-6, (key, diff)  # "agree to about 1e-7"


@pytest.mark.e2e
def test_grpo_first_reward_is_as_stated(readme_runs):
    stated = re.search(r"rises\s+from\s+([\d.]+)\s+at\s+the\s+first\s+iteration", PAGES)
    assert stated, "no page states the GRPO example's first reward"
    records = _metrics(readme_runs, "grpo.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, BRIEF_ITERS + 1))
    first = records[0]["reward_mean"]
    assert abs(first - float(stated[1])) <= 0.02, f"the page says {stated[1]}; measured {first:.3f}"


_FIGURE = re.compile(r"\d\.\de[+-]\d+\*?")


def _audit_tables() -> list[dict[str, dict[str, str]]]:
    """Every audit table the pages print: ``{mode: {layout: figure as printed}}`` each."""
    tables = []
    for _, _, body in doc_pages.blocks():
        lines = [line for line in body.splitlines() if line.strip()]
        header = next((i for i, line in enumerate(lines) if line.startswith("mode ")), None)
        if "megatron_lossfix audit" not in body or header is None:
            continue
        layouts = [word for word in lines[header].split()[1:] if word != "verdict"]
        table = {}
        for line in lines[header + 1 :]:
            figures = _FIGURE.findall(line)
            if len(figures) >= len(layouts):
                table[line.split()[0]] = dict(zip(layouts, figures[: len(layouts)], strict=True))
        tables.append(table)
    return tables


@pytest.mark.unit
def test_the_pages_print_one_audit_table():
    """The README and the home page print the same table (one measurement, shown twice)."""
    tables = _audit_tables()
    assert len(tables) >= 2 and all(t == tables[0] for t in tables), tables


@pytest.mark.unit
def test_the_audits_sample_takes_the_time_the_pages_state():
    """The pages say the audit takes about half a minute on an idle 2-core machine; the sample
    they print (one measurement, its closing line's seconds) says the same."""
    audit_section = (ROOT / "docs" / "getting_started.md").read_text().split("## The audit")[1]
    assert "about half a minute" in " ".join(audit_section.split("\n## ")[0].split())
    seconds = [int(n) for _, _, body in doc_pages.blocks() if "megatron_lossfix audit" in body
               for n in re.findall(r"results missing \((\d+) s\)", body)]  # fmt: skip
    assert len(seconds) >= 2 and all(15 <= n <= 45 for n in seconds), seconds


@pytest.mark.e2e
def test_audit_table_is_what_the_audit_measures(readme_runs):
    """The pages' audit table against the ``audit.json`` of their command, on the layouts run:
    every plugin mode within the 1e-5 tolerance in both, stock Megatron (``off``) marked as a
    miss and measured within a factor 1.5 of the figure printed."""
    output = _run_of(readme_runs, "-m megatron_lossfix audit")
    assert "PASS: 0 plugin results above tolerance" in output, output[-3000:]
    report = json.loads((readme_runs["copy"] / "audit-out" / "audit.json").read_text())
    for table in _audit_tables():
        assert set(table) == set(report["errors"]), (set(table), set(report["errors"]))
        for mode, row in report["errors"].items():
            for layout in BRIEF_LAYOUTS:
                printed, measured = table[mode][layout], row[layout]
                if mode == "off":
                    assert printed.endswith("*"), (mode, layout, printed)
                    stated = float(printed.rstrip("*"))
                    assert stated / 1.5 <= measured <= stated * 1.5, (layout, stated, measured)
                else:
                    assert float(printed) <= 1e-5 and measured <= 1e-5, (mode, layout, measured)


@pytest.mark.e2e
def test_audit_entry_point_writes_what_the_readme_says(readme_runs):
    """``python -m megatron_lossfix audit`` end to end, as the pages run it: in its own rank
    pool, progress lines on stderr (not a terminal here), and what the pages say it writes,
    ``audit-out/audit.json`` and, with matplotlib (a test extra), ``audit-out/audit.png``."""
    command = next(c for c in COMMANDS if "-m megatron_lossfix audit" in c)
    proc = readme_runs["runs"][command]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "audit [" in proc.stderr, proc.stderr[-3000:]
    out = readme_runs["copy"] / "audit-out"
    report = json.loads((out / "audit.json").read_text())
    assert report["passed"] is True
    assert [layout["name"] for layout in report["layouts"]] == list(BRIEF_LAYOUTS)
    assert all(report["errors"]["off"][layout] > 1e-3 for layout in BRIEF_LAYOUTS)
    assert (out / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
