"""``python -m megatron_lossfix install-bridge`` refuses a wrong environment in one line.

Bridge 0.6 needs Python >= 3.12 and megatron-core 0.19; the installer says what is wrong in one
line on stderr and exits non-zero before running pip (no traceback, nothing installed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_lossfix.__main__ import main as cli
from megatron_lossfix.integrations.bridge import install as install_bridge

pytestmark = pytest.mark.unit

GOOD = {"torch": "2.13.0", "megatron-core": "0.19.2"}


@pytest.mark.parametrize(
    "python, versions, names",
    [
        ((3, 11, 7), GOOD, ["Python >= 3.12", "3.11.7", "python3.12 -m venv"]),
        ((3, 12, 1), {**GOOD, "megatron-core": "0.16.1"}, ["megatron-core 0.16.1", "0.19.2"]),
        ((3, 12, 1), {**GOOD, "megatron-core": "0.190.0"}, ["megatron-core 0.190.0"]),
        ((3, 12, 1), {**GOOD, "megatron-core": None}, ["not installed"]),
        ((3, 12, 1), {**GOOD, "torch": None}, ["torch is not installed"]),
    ],
)
def test_environment_problem_names_what_to_change(python, versions, names):
    problem = install_bridge.environment_problem(python, versions)
    assert problem is not None and "\n" not in problem
    for name in names:
        assert name in problem, problem


def test_environment_problem_accepts_bridges_environment():
    assert install_bridge.environment_problem((3, 12, 1), GOOD) is None
    assert (
        install_bridge.environment_problem((3, 13, 0), {**GOOD, "megatron-core": "0.19.0"}) is None
    )


def _no_pip(*args, **kwargs):
    raise AssertionError(f"ran {args} although the environment was refused")


@pytest.mark.parametrize("wrong", ["python", "megatron-core"])
def test_install_bridge_refuses_in_one_line(wrong, monkeypatch, capsys):
    """Through the command line: exit status 2, one line on stderr, pip never runs."""
    if wrong == "python":
        monkeypatch.setattr(install_bridge, "PYTHON_MIN", (sys.version_info[0] + 1, 0))
    else:
        versions = {**GOOD, "megatron-core": "0.16.1"}
        monkeypatch.setattr(install_bridge, "_version", versions.get)
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert cli(["install-bridge"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("megatron_lossfix install-bridge: ") and "Traceback" not in err


def test_resiliency_pin_keeps_a_plain_megatron_core_import():
    """megatron-core 0.19 checks nvidia-resiliency-ext's ``__version__`` (>= 0.6) whenever its
    async checkpointing imports: 0.4.x has no ``__version__`` and 0.5.x is too old, so a plain
    ``import megatron.core`` fails with them. The requirement leaves out exactly those."""
    from packaging.requirements import Requirement

    lines = install_bridge.REQUIREMENTS.read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("nvidia-resiliency-ext")]
    spec = Requirement(line).specifier
    assert [v for v in ("0.3.0", "0.4.0", "0.4.1", "0.5.0", "0.6.0", "0.7.0") if v in spec] == [
        "0.3.0",
        "0.6.0",
        "0.7.0",
    ]


def test_install_runs_pip_without_its_conflict_report_and_says_what_it_left_out(
    monkeypatch, capsys
):
    """pip's resolver lists every package Bridge names but the install leaves out: the steps
    run with ``--no-warn-conflicts``, and the command says in one line what it left out."""
    ran = []

    def fake_run(cmd, **kwargs):
        ran.append(cmd)
        out = "megatron-bridge 0.6.2 imports\n" if "-c" in cmd else ""
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(install_bridge, "environment_problem", lambda: None)
    monkeypatch.setattr(install_bridge, "_version", {**GOOD, "flashinfer-python": None}.get)
    monkeypatch.setattr(
        install_bridge.importlib.metadata,
        "requires",
        lambda name: ["torch>=2.6", "flashinfer-python==0.6.8.post1", 'pytest; extra == "dev"'],
    )
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert cli(["install-bridge"]) == 0
    pips = [cmd for cmd in ran if "pip" in cmd]
    assert len(pips) == 2 and all("--no-warn-conflicts" in cmd for cmd in pips), pips
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("megatron_lossfix install-bridge: "), out
    assert "megatron-bridge 0.6.2 imports" in out[0] and out[0].endswith(": flashinfer-python")
