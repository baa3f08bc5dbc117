"""A framework's own tests, run unchanged with our adapter switched on: the one way the stacks'
tests do it (``tests/test_slime_stack.py``, ``tests/test_areal_stack.py``; the next stack too).

The test side: :func:`source_tree` finds the framework's source (a clone or its ``git
archive``, named by an environment variable; a missing input, ``helpers.inputs``), and
:func:`run_own_tests` runs pytest there on the framework's test files with two plugins, this
module (``-p helpers.own_tests``) and the stack's own (``-p helpers.<stack>_stack``: it switches
the adapter on in ``pytest_configure``). It returns what this module, as the plugin, wrote at the
session's end: the outcomes counted one by one (a failed setup or teardown counts as a failure,
a collection error as an error) and whatever the stack's plugin handed :func:`report_at_end`
(that the adapter is on, how often its hooks ran). :meth:`OwnTests.check` then asks for no
failure and at least ``N`` passed: a count read from a run would break on an added test and
say nothing of a lost one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from helpers.inputs import skip_missing

ROOT = Path(__file__).resolve().parents[2]
#: Where the plugin writes its report (a JSON object), set by :func:`run_own_tests`.
REPORT_ENV = "LOSSFIX_OWN_TESTS_REPORT"


def source_tree(variable: str, what: str, tmp_path: Path) -> Path:
    """The framework's source tree that ``variable`` names: a folder as it is, or a ``.tar.gz``
    unpacked under ``tmp_path`` (its one top folder). Unset: a missing input (``what``)."""
    source = os.environ.get(variable)
    if not source:
        skip_missing(f"{variable} is not set ({what})")
    path = Path(source)
    if path.is_dir():
        return path
    with tarfile.open(path) as archive:
        archive.extractall(tmp_path, filter="data")
    (top,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return top


@dataclasses.dataclass
class OwnTests:
    """What :func:`run_own_tests` saw: the plugin's report, pytest's exit status and output."""

    report: dict[str, Any]
    returncode: int
    output: str

    @property
    def counts(self) -> dict[str, int]:
        """``passed``, ``failed``, ``errors`` (collection) and ``skipped``."""
        return {k: self.report.get("counts", {}).get(k, 0)
                for k in ("passed", "failed", "errors", "skipped")}  # fmt: skip

    def check(self, at_least: int) -> None:
        """No failure, no error, and at least ``at_least`` tests passed."""
        counts, tail = self.counts, self.output[-4000:]
        assert counts["failed"] == 0 and counts["errors"] == 0, (counts, tail)
        assert counts["passed"] >= at_least, (counts, f"want at least {at_least} passed", tail)
        assert self.returncode == 0, (self.returncode, tail)


def run_own_tests(
    tests: Path,
    files: Iterable[str],
    plugin: str,
    *,
    options: Iterable[str] = (),
    timeout: float = 900,
) -> OwnTests:
    """pytest on ``files`` of the framework's test folder ``tests``, from the folder above it
    (the framework's root), with this module and the stack's ``plugin`` loaded (``tests/`` and
    the repository on ``PYTHONPATH``), ``options`` after them."""
    with tempfile.TemporaryDirectory() as folder:
        return _run(tests, files, plugin, options, timeout, Path(folder) / "report.json")


def _run(tests: Path, files: Iterable[str], plugin: str, options: Iterable[str], timeout: float,
         report: Path) -> OwnTests:  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           REPORT_ENV: str(report)}  # fmt: skip
    plugins = ["-p", __name__, "-p", plugin, "-p", "no:randomly", "-p", "no:cacheprovider"]
    argv = [sys.executable, "-m", "pytest", *plugins, *options, "-q",
            *(str(tests / name) for name in files)]  # fmt: skip
    proc = subprocess.run(argv, cwd=tests.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert report.is_file(), f"the run wrote no report (did {__name__} load?):\n{output[-4000:]}"
    return OwnTests(json.loads(report.read_text()), proc.returncode, output)


# ---------------------------------------------------------------------- the plugin side
_COUNTS: collections.Counter = collections.Counter()
_AT_END: list[Callable[[], dict[str, Any]]] = []


def report_at_end(fields: Callable[[], dict[str, Any]]) -> None:
    """A stack's plugin: ``fields()``, called when the session ends, goes into the report."""
    _AT_END.append(fields)


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _COUNTS["errors"] += 1


def pytest_runtest_logreport(report: Any) -> None:
    if report.failed:
        _COUNTS["failed"] += 1
    elif report.skipped:
        _COUNTS["skipped"] += 1
    elif report.when == "call":
        _COUNTS["passed"] += 1


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    report: dict[str, Any] = {"counts": dict(_COUNTS), "exitstatus": int(exitstatus)}
    for fields in _AT_END:
        report.update(fields())
    Path(path).write_text(json.dumps(report, default=str))
