"""What a test needs from outside this repository: a framework's source archive (slime's, AReaL's
tests), the framework installed in its stack's virtualenv (``needs_stack``), Megatron-LM's
source archives.

Without it a test skips on a developer's machine, saying in one line what it needs. Under CI
(the variable ``CI`` set to anything but ``""``, ``0``, ``false`` or ``no``, as CI services set
it) the same test fails instead, naming what is missing (``tests/conftest.py`` turns the skip
into a failure): a green CI means the test ran.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest

#: How a skip for a missing input starts its reason; ``fail_in_ci`` looks for it.
MISSING = "missing input: "


def in_ci() -> bool:
    """Whether this run is CI's (``CI`` set, not to ``""``, ``0``, ``false`` or ``no``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def needs_input(present: bool, what: str) -> pytest.MarkDecorator:
    """A mark: the test skips when ``present`` is false (fails under CI), ``what`` saying what
    it needs and where it comes from."""
    return pytest.mark.skipif(not present, reason=MISSING + what)


def needs_stack(present: bool, stack: str, what: str) -> pytest.MarkDecorator:
    """A mark for a test that needs the RL stack ``stack`` installed: in the virtualenv its
    page's install line makes (``.venv-<stack>``, where CI runs the stack's tests) a missing
    input; elsewhere (another world, where ``pytest -m unit`` also collects the stack's unit
    tests) a plain skip."""
    if Path(sys.prefix).name == f".venv-{stack}":
        return needs_input(present, what)
    return pytest.mark.skipif(not present, reason=what)


def skip_missing(what: str) -> NoReturn:
    """Skip the running test for the missing input ``what`` (under CI, it fails)."""
    pytest.skip(MISSING + what)


def fail_in_ci(report: Any) -> None:
    """Turn ``report``, a skip for a missing input, into a failure when this run is CI's."""
    if not (report.skipped and in_ci() and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2])
    if reason.startswith("Skipped: "):
        reason = reason[len("Skipped: ") :]
    if reason.startswith(MISSING):
        report.outcome = "failed"
        report.longrepr = f"CI lacks an input this test needs: {reason[len(MISSING) :]}"
