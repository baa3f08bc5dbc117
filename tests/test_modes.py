"""The table of modes (``megatron_lossfix.runtime.modes``, its records checked by
``mode_record.check_table``): complete, the only place that names a mode, and what
docs/modes.md, the flags and the audit list."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from megatron_lossfix.runtime import modes
from megatron_lossfix.runtime.mode_record import Alias, Count, Ids, Mode, check_table
from megatron_lossfix.runtime.modes import (
    ALIAS_RECORDS,
    ALIASES,
    DEFAULT_MODE,
    MODE_RECORDS,
    MODES,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_lossfix"
#: The subpackages outside the runtime, which may name modes (frameworks' own conventions).
NOT_RUNTIME = ("audit", "integrations", "rl")


def _record(name: str) -> Mode:
    return next(m for m in MODE_RECORDS if m.name == name)


def _replaced(name: str, **changes: object) -> tuple[Mode, ...]:
    return tuple(dataclasses.replace(m, **changes) if m.name == name else m for m in MODE_RECORDS)


def test_the_table_passes_its_check():
    check_table(MODE_RECORDS, ALIAS_RECORDS, DEFAULT_MODE)
    assert MODES[-1] == modes.STOCK and len(set(MODES)) == len(MODES)


BROKEN = {
    "weights of a mode that needs its ids": _replaced("group_mean", weights=lambda *a: []),
    "no weights without needed ids": _replaced("token_mean", weights=None),
    "group weights without ids": _replaced("sum", group_weights=lambda *a: []),
    "ids without group weights": _replaced("sequence_mean", group_weights=None),
    "no kept factors": _replaced("token_mean", kept=None),
    "a deferred count it does not read": _replaced(
        "token_mean", kept=dataclasses.replace(_record("token_mean").kept, divides_by=Count.S)
    ),
    "per-token path of a mode that divides by S": _replaced(
        "sequence_mean", megatron_per_token=True
    ),
    "needed ids without group counts": _replaced("group_mean", global_counts=frozenset()),
    "a stock mode that weighs": _replaced("off", weights=lambda *a: []),
    "a stock mode with ids": _replaced("off", ids=Ids.TRAJECTORIES),
    "an empty formula": _replaced("sum", formula=""),
    "an empty constant": _replaced("seq_mean_token_sum_norm", constant=""),
    "a name twice": (*MODE_RECORDS[:-1], MODE_RECORDS[0], MODE_RECORDS[-1]),
    "no stock mode last": (*MODE_RECORDS[-1:], *MODE_RECORDS[:-1]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_an_incomplete_record_fails_the_check(case):
    with pytest.raises(ValueError, match="mode table"):
        check_table(BROKEN[case], ALIAS_RECORDS, DEFAULT_MODE)


def test_aliases_and_default_must_name_plugin_modes():
    stray = Alias(name="x_mean", mode="off", origin="nowhere")
    with pytest.raises(ValueError, match="alias 'x_mean'"):
        check_table(MODE_RECORDS, (*ALIAS_RECORDS, stray), DEFAULT_MODE)
    with pytest.raises(ValueError, match="default 'off'"):
        check_table(MODE_RECORDS, ALIAS_RECORDS, "off")


def test_mode_of_names_and_refuses():
    assert modes.mode_of("prompt_mean") is modes.mode_of("group_mean")
    with pytest.raises(ValueError, match="unknown loss reduction 'mean'"):
        modes.mode_of("mean")


def _docs_rows() -> list[tuple[str, tuple[str, ...], str]]:
    """docs/modes.md's table: (mode, aliases, per-token weight) per row."""
    text = (REPO / "docs" / "modes.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`") or cells[0] == "`--loss-reduction`":
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        rows.append((names[0], tuple(names[1:]), cells[1]))
    return rows


def test_docs_table_is_the_records():
    """docs/modes.md lists every mode once, in the table's order, with its aliases and weight."""
    want = [
        (m.name, tuple(a.name for a in ALIAS_RECORDS if a.mode == m.name), m.formula)
        for m in MODE_RECORDS
    ]
    assert _docs_rows() == want


def _named_modes(node: ast.AST) -> list[str]:
    """Mode names in the string constants under ``node``: whole words, but ``sum`` and ``off``
    (English words too) only as the whole string."""
    found = []
    long_names = [n for n in (*MODES, *ALIASES) if "_" in n]
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            if sub.value in MODES or sub.value in ALIASES:
                found.append(sub.value)
            else:
                found += [n for n in long_names if re.search(rf"(?<!\w){n}(?!\w)", sub.value)]
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                ids.add(id(body[0].value))
    return ids


def _runtime_strings_naming_modes() -> dict[str, list[str]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] in NOT_RUNTIME or path.name == "modes.py":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        # Attribute docstrings (a string statement after a field) are documentation too.
        for node in ast.walk(tree):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                docs.add(id(node.value))
        names = [
            name
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and id(node) not in docs
            for name in _named_modes(node)
        ]
        if names:
            out[str(path.relative_to(REPO))] = names
    return out


def test_no_runtime_module_names_a_mode():
    """Outside modes.py, the runtime asks the records: no string of its code names a mode."""
    assert _runtime_strings_naming_modes() == {}


def test_the_scan_finds_a_named_mode(tmp_path):
    """The scan above can fail: a string naming a mode is found, a docstring is not."""
    tree = ast.parse('"""token_mean in a docstring."""\nx = "reduction \'group_mean\' needs ids"')
    docs = _docstrings(tree)
    strings = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs]
    assert [name for n in strings for name in _named_modes(n)] == ["group_mean"]


def test_flag_help_and_audit_defaults_come_from_the_table():
    from megatron_lossfix.args import add_lossfix_args
    from megatron_lossfix.audit.options import add_audit_args, options_from_args

    parser = add_lossfix_args(argparse.ArgumentParser())
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    said = actions["--loss-reduction"].help
    for mode in MODE_RECORDS:
        assert mode.name in said and (mode.help in said)
    assert set(actions["--loss-reduction"].choices) == {*MODES, *ALIASES}
    constant = actions["--loss-norm-constant"].help
    assert all((f"C of {m.name}:" in constant) == m.uses_constant for m in MODE_RECORDS)
    audit = add_audit_args(argparse.ArgumentParser())
    assert tuple(options_from_args(audit.parse_args([])).modes) == MODES


@pytest.mark.parametrize("mode", [m.name for m in MODE_RECORDS if not m.stock and not m.ids.needed])
def test_global_counts_say_when_rank_local_counts_differ(mode):
    """A mode's ``global_counts`` is empty exactly when each DP rank's own counts give the
    step's weights (what ``loss_weights`` relies on to skip the all-reduce): two ranks' halves
    with different token and sequence counts, weighed with their own counts and with the
    step's, against the whole batch weighed on one rank."""
    from megatron_lossfix.runtime.weights import count_tokens, weights_from_counts

    gen = torch.Generator().manual_seed(7)
    masks = [(torch.rand(3, 8, generator=gen) < p).float() for p in (0.9, 0.8, 0.3, 0.2)]
    masks[3][0] = 0  # an empty sequence on the second rank only
    c = 4.0 if modes.mode_of(mode).uses_constant else None
    whole = torch.cat(weights_from_counts(masks, count_tokens(masks), mode, norm_constant=c))
    every = count_tokens(masks)
    local, step = [], []
    for half in (masks[:2], masks[2:]):
        own = dataclasses.replace(count_tokens(half), dp_size=2)
        local += weights_from_counts(half, own, mode, norm_constant=c)
        agreed = dataclasses.replace(
            own, num_tokens=every.num_tokens, num_sequences=every.num_sequences
        )
        step += weights_from_counts(half, agreed, mode, norm_constant=c)
    assert torch.equal(torch.cat(step), whole)
    declared = bool(modes.mode_of(mode).global_counts)
    assert torch.equal(torch.cat(local), whole) is not declared
