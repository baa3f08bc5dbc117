"""The README's verl and SkyRL commands: the install line installs what CI tests, and the stack
audits run as printed where the stack is installed.

* unit: the install line makes its own Python 3.12 virtualenv from the ``[verl]`` and
  ``[skyrl]`` extras of ``setup.py`` (no versions of its own), every stack command runs in that
  virtualenv, and the extras pin what CI installs for the stack tests
  (``.ci/rl-requirements.txt``, ``noxfile.py``).
* e2e: each ``--stack`` command, with this interpreter for ``.venv-rl/bin/python`` and on one
  layout (``BRIEF_LAYOUT`` in place of ``--layouts``, as ``tests/test_readme.py`` runs the
  audit), exits 0 and writes its ``audit.json`` with the adapted row passing. Skipped where the
  stack is not installed (CI's stack layer has both).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT.joinpath("README.md").read_text()
VENV = ".venv-rl"
BRIEF_LAYOUT = "dp2-m3"


def _bash_lines() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README, flags=re.S | re.M)
    return [line.strip() for body in blocks for line in body.splitlines() if line.strip()]


def _stack_commands() -> list[str]:
    return [line for line in _bash_lines() if "megatron_lossfix audit --stack" in line]


def _install_lines() -> list[str]:
    return [line for line in _bash_lines() if f"{VENV}/bin/pip install" in line]


def _extras() -> dict[str, list[str]]:
    """``setup.py``'s ``extras_require``, read without running it."""
    text = ROOT.joinpath("setup.py").read_text()
    extras = {}
    for name in ("verl", "skyrl"):
        body = re.search(rf'"{name}": \[(.*?)\]', text, flags=re.S)[1]
        extras[name] = re.findall(r'"([^"]+)"', body)
    return extras


@pytest.mark.unit
def test_install_line_makes_its_own_312_env_from_the_extras():
    lines = set(_install_lines())
    assert len(lines) == 1, f"one install line for verl and SkyRL, got {lines}"
    (line,) = lines
    assert line.startswith(f"python3.12 -m venv {VENV} && "), line
    assert '-e ".[verl,skyrl]"' in line, line
    # Versions come from the extras only: the line pins nothing of verl's or SkyRL's own.
    assert not re.search(r"\b(verl|skyrl)[\w-]*==", line), line
    for cmd in _stack_commands():
        assert cmd.startswith(f"{VENV}/bin/python -m megatron_lossfix audit --stack"), cmd


@pytest.mark.unit
def test_the_extras_pin_what_ci_installs():
    ci = ROOT.joinpath(".ci", "rl-requirements.txt").read_text().split()
    nox = ROOT.joinpath("noxfile.py").read_text()
    for name, requirements in _extras().items():
        pins = [r for r in requirements if "==" in r]
        assert any(r.startswith(f"{name}==") for r in pins), (name, requirements)
        for pin in pins:
            assert pin in ci or f'"{pin}"' in nox, f"CI does not install {pin} ([{name}] does)"


def _brief(cmd: str) -> tuple[list[str], str]:
    """The command's argv with this interpreter and one layout, and the folder it writes."""
    argv = shlex.split(cmd.split("#", 1)[0])
    assert argv[0] == f"{VENV}/bin/python", cmd
    argv[0] = sys.executable
    if "--layouts" in argv:
        argv[argv.index("--layouts") + 1] = BRIEF_LAYOUT
    else:
        argv += ["--layouts", BRIEF_LAYOUT]
    out = argv[argv.index("--out") + 1] if "--out" in argv else "audit-out"
    return [*argv, "--no-plot"], out


@pytest.mark.e2e
@pytest.mark.parametrize("cmd", _stack_commands(), ids=lambda c: " ".join(c.split()[4:8]))
def test_stack_audit_runs_as_printed(cmd, tmp_path):
    stack = re.search(r"--stack (\w+)", cmd)[1]
    if importlib.util.find_spec(stack) is None:
        pytest.skip(f"{stack} is not installed (the README's {VENV} has it)")
    argv, out = _brief(cmd)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{cmd}\nexit {proc.returncode}:\n{proc.stderr[-4000:]}"
    report = json.loads((tmp_path / out / "audit.json").read_text())
    assert report["passed"] is True and not report["did_not_run"], report["failures"]
    adapted = report["errors"][f"{stack}+lossfix"][BRIEF_LAYOUT]
    assert adapted <= report["tolerance"], adapted
