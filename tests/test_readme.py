"""The README's commands stay true: CI runs exactly the README's test command, and the
example commands use flags the scripts accept."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT.joinpath("README.md").read_text()


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    test_cmd = next(c for c in _commands() if "nox" in c)
    ci_lines = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert test_cmd in ci_lines, f"README test command not run verbatim by .ci/run: {test_cmd}"


def test_readme_example_commands_parse():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "examples/pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = [c for c in _commands() if "examples/pretrain_gpt.py" in c]
    assert len(runs) >= 3
    for cmd in runs:
        tail = cmd.split("examples/pretrain_gpt.py", 1)[1]
        module.parse_args(shlex.split(tail))  # exits (SystemExit) on an unknown flag
