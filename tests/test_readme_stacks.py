"""The RL stacks' commands of the README and of the docs pages: each stack page's install line is
what CI runs, and the stack audits run as printed where the stack is installed.

* unit: each stack's install line makes its own Python 3.12 virtualenv, ``.venv-<stack>``, from
  the ``[<stack>]`` extra of ``setup.py`` (no versions of its own: verl 0.9.1 and SkyRL 0.4.0 do
  not resolve together), every stack command runs in its stack's virtualenv, and CI runs every
  such page's line as printed (``noxfile.py``'s ``STACK_PAGES``, and ``PAGE_TESTS`` for pages
  besides the stacks' with an environment of their own, read from the page through
  ``helpers.doc_pages.install_line``, never retyped), in a fresh virtualenv of its own, where
  this file and ``tests/test_<stack>_stack.py`` then run. The lists of stacks in the README and
  the docs' index name every one.
* e2e: each ``--stack`` command, with this interpreter for ``.venv-<stack>/bin/python`` and on one
  layout (``BRIEF_LAYOUT`` in place of ``--layouts``, as ``tests/test_readme.py`` runs the
  audit), exits 0 and writes its ``audit.json`` with the adapted row passing. Skipped where the
  stack is not installed (CI runs this file in each stack's virtualenv: the others skip there).
"""

from __future__ import annotations

import ast
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

ROOT = Path(__file__).resolve().parents[1]
#: CI's nox run: the table of sessions, and the machinery beside it.
NOX_FILES = (ROOT / "noxfile.py", *sorted(ROOT.joinpath(".ci").glob("nox_*.py")))


def _nox_value(name: str) -> object:
    """The value ``noxfile.py`` or its machinery (``.ci/nox_*.py``) gives ``name``, read
    without importing nox."""
    return next(
        ast.literal_eval(node.value) for path in NOX_FILES
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name
    )  # fmt: skip


def _nox_stack_pages() -> tuple[str, ...]:
    """``noxfile.py``'s ``STACK_PAGES``."""
    return _nox_value("STACK_PAGES")


#: The stacks, as CI knows them: one page each.
STACKS = tuple(doc_pages.install_line(page)[0] for page in _nox_stack_pages())
#: Stacks on the package index, pinned by their extra (slime installs from its source).
PINNED = ("verl", "skyrl", "ms-swift")
#: The module a stack installs, where it is not the stack's name.
MODULES = {"ms-swift": "swift", "nemo-rl": "nemo_rl"}
BRIEF_LAYOUT = "dp2-m3"


def _stack_commands() -> list[str]:
    return [line for line in doc_pages.bash_lines() if "megatron_lossfix audit --stack" in line]


def _venv(stack: str) -> str:
    return f".venv-{stack}"


def _install_lines(stack: str) -> list[str]:
    return [line for line in doc_pages.bash_lines() if f"{_venv(stack)}/bin/pip install" in line]


def _extras() -> dict[str, list[str]]:
    """``setup.py``'s ``extras_require``, read without running it."""
    text = ROOT.joinpath("setup.py").read_text()
    extras = {}
    for name in STACKS:
        body = re.search(rf'"{name}": \[(.*?)\]', text, flags=re.S)[1]
        extras[name] = re.findall(r'"([^"]+)"', body)
    return extras


@pytest.mark.unit
@pytest.mark.parametrize("stack", STACKS)
def test_install_line_makes_its_own_312_env_from_the_extra(stack):
    lines = set(_install_lines(stack))
    assert len(lines) == 1, f"one install line for {stack}, got {lines}"
    (line,) = lines
    assert line.startswith(f"python3.12 -m venv {_venv(stack)} && "), line
    assert f'-e ".[{stack}]"' in line, line
    # Versions come from the extras only: the line pins nothing of the stack's own, but for a
    # stack installed without its dependencies beside the extra (AReaL: its own requirements
    # hold GPU-only packages), whose release is pinned there.
    if f"--no-deps {stack}==" not in line:
        assert not re.search(rf"\b{stack}[\w-]*==", line), line
    for cmd in _stack_commands():
        if f"--stack {stack}" in cmd:
            assert cmd.startswith(f"{_venv(stack)}/bin/python -m megatron_lossfix audit"), cmd


@pytest.mark.unit
def test_ci_runs_every_stack_pages_install_line_as_printed():
    """Every docs page with an install line is in ``STACK_PAGES`` or ``PAGE_TESTS`` (pages
    besides the stacks' whose commands need an environment of their own); CI's nox reads each
    line from its page (``doc_pages.install_line``) and retypes none; a pinned stack's extra pins
    its release."""
    docs = sorted(
        f"docs/{page.name}" for page in ROOT.joinpath("docs").glob("*.md")
        if any(doc_pages.INSTALL_LINE.match(line) for line in page.read_text().splitlines())
    )  # fmt: skip
    pages = (*_nox_stack_pages(), *_nox_value("PAGE_TESTS"))
    assert sorted(pages) == docs
    nox = "\n".join(path.read_text() for path in NOX_FILES)
    assert "doc_pages.install_line(page)" in nox
    for page in pages:
        stack, line = doc_pages.install_line(page)
        assert line not in nox and f".[{stack}]" not in nox, f"CI's nox files retype {page}'s line"
    for name, requirements in _extras().items():
        if name in PINNED:
            assert any(r.startswith(f"{name}==") for r in requirements), (name, requirements)


@pytest.mark.unit
@pytest.mark.skipif(not shutil.which("hardlink"), reason="util-linux's hardlink is not installed")
def test_ci_keeps_one_copy_of_what_the_pages_virtualenvs_share(tmp_path):
    """After each page's install line CI runs ``SHARE_FILES``: a file of the page's virtualenv
    that the 3.12 world or an earlier page's has with the same contents becomes a hard link to
    it (torch's CUDA build, 5 GB, would otherwise sit on the disk six times: the landing of
    9749f3d ran out of it), the oldest copy staying. pip installs each copy at its own time; a
    file that differs stays."""
    shared, own = os.urandom(1 << 16), os.urandom(1 << 16)
    venvs = [
        tmp_path / "world-3.12",
        tmp_path / "page-a" / ".venv-a",
        tmp_path / "page-b" / ".venv-b",
    ]
    for age, venv in enumerate(venvs):
        (venv / "torch").mkdir(parents=True)
        (venv / "torch" / "lib.so").write_bytes(shared)
        (venv / "torch" / "version.py").write_bytes(own if venv.name == ".venv-b" else shared[:99])
        os.utime(venv / "torch" / "lib.so", (1e9 + age, 1e9 + age))
    env = {**os.environ, "NOX_DIR": str(tmp_path)}
    world = (venvs[0] / "torch" / "lib.so").stat().st_ino
    share = ["bash", "-c", _nox_value("SHARE_FILES")]
    subprocess.run(share, env=env, check=True, capture_output=True)
    inodes = {
        venv.relative_to(tmp_path): (venv / "torch" / "lib.so").stat().st_ino for venv in venvs
    }
    # The world's own copy stays: the running suite has it mapped.
    assert set(inodes.values()) == {world}, inodes
    assert (venvs[2] / "torch" / "version.py").read_bytes() == own
    assert (venvs[2] / "torch" / "version.py").stat().st_nlink == 1


@pytest.mark.unit
def test_the_lists_of_stacks_name_every_stack():
    """The README's sentence on what nox runs and the docs' index name every stack CI tests."""
    readme = " ".join(ROOT.joinpath("README.md").read_text().split())
    nox_sentence = re.search(r"Run the tests: nox runs (.*?)\. It needs", readme)[1]
    index = " ".join(ROOT.joinpath("docs", "index.md").read_text().split())
    integrations = re.search(r"\* Integrations: (.*?)\n?\* ", index + "* ")[1]
    for page in _nox_stack_pages():
        name = Path(page).name
        assert f"]({name})" in integrations, (name, integrations)
        title = re.match(r"# (\S+)", ROOT.joinpath(page).read_text())[1].rstrip(":")
        assert title in nox_sentence, (title, nox_sentence)


def _brief(cmd: str) -> list[str]:
    """The command's argv with this interpreter and one layout."""
    argv = shlex.split(cmd.split("#", 1)[0])
    assert argv[0] in {f"{_venv(stack)}/bin/python" for stack in STACKS}, cmd
    argv[0] = sys.executable
    if "--layouts" in argv:
        argv[argv.index("--layouts") + 1] = BRIEF_LAYOUT
    else:
        argv += ["--layouts", BRIEF_LAYOUT]
    return [*argv, "--no-plot"]


@pytest.mark.e2e
@pytest.mark.parametrize("cmd", _stack_commands(), ids=lambda c: " ".join(c.split()[4:8]))
def test_stack_audit_runs_as_printed(cmd, tmp_path):
    stack = re.search(r"--stack ([\w-]+)", cmd)[1]
    if importlib.util.find_spec(MODULES.get(stack, stack)) is None:
        pytest.skip(f"{stack} is not installed (the pages' {_venv(stack)} has it)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        _brief(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, f"{cmd}\nexit {proc.returncode}:\n{proc.stderr[-4000:]}"
    # It writes where its last line says (a folder of its own: no stack audit overwrites another
    # kind's audit.json), and prints each row once.
    wrote = re.fullmatch(r"wrote (\S+/audit\.json)", proc.stdout.splitlines()[-1])
    assert wrote, proc.stdout
    if "--out" not in cmd:
        assert wrote[1].startswith(f"audit-out/{stack}"), proc.stdout
    report = json.loads((tmp_path / wrote[1]).read_text())
    modes, rows = report["options"]["modes"], report["modes"]
    if len(modes) == 1:  # the worst-mode rows are the mode's: not printed again as row:mode
        assert not {f"{stack}:{modes[0]}", f"{stack}+lossfix:{modes[0]}"} & set(rows), rows
    assert report["passed"] is True and not report["did_not_run"], report["failures"]
    adapted = report["errors"][f"{stack}+lossfix"][BRIEF_LAYOUT]
    assert adapted <= report["tolerance"], adapted
