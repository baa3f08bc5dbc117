"""The pages whose commands the tests run: the README, then the documentation site's pages
(``docs/``, in the order of ``mkdocs.yml``'s navigation, then any page it leaves out).

Which fenced blocks claim to run:

* ``bash``/``sh`` blocks: every line is a command (a line ending in ``\\`` goes on in the next);
* ``console`` and unlabeled blocks: the ``$ `` lines when there are any (the rest is output),
  else every line;
* ``python`` blocks: the code, as printed;
* ``text`` blocks are templates for the reader's own setup, never run: each of their commands
  holds a placeholder (``<your flags>``, ``torchrun ...``, ``/path/to/...``);
  :data:`PLACEHOLDER` is what counts as one, and a test holds every ``text`` block to it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
#: What marks a line of a ``text`` block as a template rather than a command.
PLACEHOLDER = re.compile(r"<[^>]+>|\.\.\.|/path/to/")


def pages() -> list[Path]:
    """README.md, then the site's pages in navigation order, then the pages not in it."""
    docs = ROOT / "docs"
    nav = re.findall(r"^\s*-\s+[^:\n]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    listed = [docs / name for name in nav if (docs / name).is_file()]
    rest = sorted(p for p in docs.glob("*.md") if p not in listed)
    return [ROOT / "README.md", *listed, *rest]


def text() -> str:
    """Every page, one after the other (for the figures the pages state)."""
    return "\n".join(page.read_text() for page in pages())


def blocks(*langs: str) -> list[tuple[Path, str, str]]:
    """``(page, language, body)`` of every fenced block, in page order; only ``langs`` if given."""
    out = []
    for page in pages():
        for lang, body in _FENCE.findall(page.read_text()):
            if not langs or lang in langs:
                out.append((page, lang, body))
    return out


def _lines(body: str) -> list[str]:
    """The block's lines, stripped, with ``\\`` continuations joined into one."""
    out: list[str] = []
    carry = ""
    for raw in body.splitlines():
        line = raw.strip()
        if not line and not carry:
            continue
        if line.endswith("\\"):
            carry += line[:-1].rstrip() + " "
            continue
        out.append(carry + line)
        carry = ""
    if carry:
        out.append(carry.rstrip())
    return out


def block_commands(lang: str, body: str) -> list[str]:
    """The commands of one shell block (see the module docstring)."""
    lines = _lines(body)
    if lang in ("bash", "sh"):
        return lines
    prompts = [line[2:] for line in lines if line.startswith("$ ")]
    return prompts or lines


def commands() -> list[str]:
    """Every command of the pages that claims to run, in page order, each once."""
    out: list[str] = []
    for _, lang, body in blocks("", "bash", "sh", "console"):
        out += [c for c in block_commands(lang, body) if c not in out]
    return out


def bash_lines() -> list[str]:
    """The commands of the ``bash`` blocks alone, each once."""
    out: list[str] = []
    for _, lang, body in blocks("bash"):
        out += [c for c in block_commands(lang, body) if c not in out]
    return out


#: The first command of a stack page: it makes the stack's own virtualenv, ``.venv-<stack>``,
#: and installs into it what the page's commands need.
INSTALL_LINE = re.compile(r"^python3\.12 -m venv \.venv-([\w-]+) && ")
#: A step of a ``&&`` chain that installs: it makes a virtualenv or runs pip.
INSTALL_STEP = re.compile(r"^(python3? -m venv \S+|\S*/bin/pip install .*)$")
#: The quick start's line (the README's, repeated by getting started): it makes ``.venv`` with
#: the reader's ``python3``, installs torch and this package into it, then trains.
QUICK_START = re.compile(r"^python3 -m venv \.venv && ")
#: Getting started's line that adds the test tools to ``.venv`` and runs the unit tier.
UNIT_TIER = re.compile(r"^\.venv/bin/pip install .* && \.venv/bin/python -m pytest -m unit$")


def _bash_lines(page: str | Path, pattern: re.Pattern[str]) -> set[str]:
    """The distinct commands of ``page``'s ``bash`` blocks that ``pattern`` matches."""
    return {
        line
        for lang, body in _FENCE.findall((ROOT / page).read_text())
        if lang == "bash"
        for line in block_commands(lang, body)
        if pattern.match(line)
    }


def install_line(page: str | Path) -> tuple[str, str]:
    """``(stack, line)``: the one ``bash`` line of ``page`` (relative to the repository) that
    makes a ``.venv-<stack>`` virtualenv, as printed. CI runs it so (``noxfile.py``)."""
    found = _bash_lines(page, INSTALL_LINE)
    if len(found) != 1:
        raise ValueError(f"{page}: {len(found)} install lines (python3.12 -m venv .venv-<stack>)")
    line = found.pop()
    return INSTALL_LINE.match(line)[1], line


def quick_start_install() -> str:
    """The README's install line: the installing steps of its quick start's line
    (``python3 -m venv .venv && .venv/bin/pip install ...``), as printed; the rest of the line
    trains. CI runs it so, then ``unit_tier_line`` (``noxfile.py``, ``tests-3.11``)."""
    found = _bash_lines("README.md", QUICK_START)
    if len(found) != 1:
        raise ValueError(f"README.md: {len(found)} quick start lines (python3 -m venv .venv)")
    steps = found.pop().split(" && ")
    installs = next(i for i, step in enumerate(steps) if not INSTALL_STEP.match(step))
    return " && ".join(steps[:installs])


def unit_tier_line() -> str:
    """Getting started's line that runs the unit tier in the quick start's ``.venv``, as
    printed."""
    found = _bash_lines("docs/getting_started.md", UNIT_TIER)
    if len(found) != 1:
        raise ValueError(f"docs/getting_started.md: {len(found)} unit-tier lines")
    return found.pop()
