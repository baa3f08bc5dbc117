"""docs/flags.md against the code: its table of the plugin's flags is the parser's
(``add_lossfix_args``: every flag once, in ``--help``'s order, with its default), and its table of
commands is the command line's (``python -m megatron_lossfix``: every command in ``--help``'s
order, the subcommands and stacks each takes). A flag, command or default that changes without
the page fails here."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lossfix.__main__ import COMMANDS
from megatron_lossfix.args import add_lossfix_args, from_args
from megatron_lossfix.audit.stacks import STACKS
from megatron_lossfix.integrations.megatron_lm.patches import command_parser
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.modes import MODES, mode_of
from megatron_lossfix.step.selfcheck import first_step_check

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def _rows(header: str) -> list[list[str]]:
    """The cells of the rows of the table whose header line starts with ``header``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
    return rows


def _actions() -> list[argparse.Action]:
    parser = add_lossfix_args(argparse.ArgumentParser(), megatron_lm=True)
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _default(action: argparse.Action) -> str:
    """What the page's default column says of ``action``, from what the code does."""
    if action.dest == "loss_reduction":
        assert from_args(add_lossfix_args(argparse.ArgumentParser()).parse_args([])) is None
        return "not given: plugin off"
    if action.dest == "lossfix_self_check":
        constant = {m: 1.0 if mode_of(m).uses_constant else None for m in MODES}
        configs = [LossFixConfig(reduction=m, norm_constant=constant[m]) for m in MODES]
        unchecked = [c.reduction for c in configs if first_step_check(c) is None]
        return "on with `--loss-reduction` (not in " + ", ".join(f"`{m}`" for m in unchecked) + ")"
    if action.default is False:
        return "off"
    if action.default is None:
        return "none"
    return f"{action.default:g}"


def test_flag_table_is_the_parser():
    rows = _rows("| flag | default | meaning |")
    flags = [re.match(r"`(--[\w-]+)", row[0])[1] for row in rows]
    assert flags == [a.option_strings[0] for a in _actions()]
    for row, action in zip(rows, _actions(), strict=True):
        assert row[1] == _default(action), (row[0], row[1], _default(action))
        if action.metavar:  # a flag that takes a value shows its metavar
            assert row[0] == f"`{action.option_strings[0]} {action.metavar}`", row[0]


def test_commands_table_is_the_command_line():
    rows = _rows("| command | what it does | page |")
    assert [row[0].strip("`").split()[0] for row in rows] == list(COMMANDS)
    cells = {row[0].strip("`").split()[0]: " ".join(row[:2]).replace("\\|", "|") for row in rows}
    assert set(re.search(r"--stack ([\w|-]+)", cells["audit"])[1].split("|")) == set(STACKS)
    subcommands = command_parser()._subparsers._group_actions[0].choices
    for sub in subcommands:
        assert re.search(rf"patches [\w|]*\b{sub}\b", cells["patches"]), (sub, cells["patches"])
    for sub in ("write-plan", "compare"):
        assert sub in cells["rl-replay"], sub


def test_help_lists_the_commands_in_the_order_of_the_choices():
    """``python -m megatron_lossfix --help``: the one-line helps in the order of the choices;
    the patches line names both scripts it patches and ``list``."""
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lossfix", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    text = " ".join(out.split())
    assert "{" + ",".join(COMMANDS) + "}" in text
    where = [text.index(f"{name}: ") for name in COMMANDS]
    assert where == sorted(where), text
    assert all(
        word in COMMANDS["patches"][0] for word in ("pretrain_gpt.py", "train_rl.py", "list")
    )


@pytest.mark.parametrize("command", ["rl-replay", "patches", "audit"])
def test_every_command_has_help(command):
    done = subprocess.run(
        [sys.executable, "-m", "megatron_lossfix", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
