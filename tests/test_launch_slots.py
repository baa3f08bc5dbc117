"""The cores' slots that the tests' launches share across pytest-xdist's workers
(``helpers.launch.slots``): a block that needs them all waits for the others to free theirs,
and while it waits no other process takes any (a stream of short runs cannot starve it).

Each party is a fresh interpreter (as each xdist worker is) of one test run: the same
``PYTEST_XDIST_TESTRUNUID``; its lines go to a shared log with the time they were written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
SLOTS = 2 * (os.cpu_count() or 1)

_PARTY = """
import sys, time
sys.path.insert(0, {tests!r})
from helpers.launch import slots
log = open({log!r}, "a", buffering=1)
time.sleep({start})
log.write(f"{{time.time()}} {name} asks\\n")
with slots({nproc}):
    log.write(f"{{time.time()}} {name} holds\\n")
    time.sleep({hold})
log.write(f"{{time.time()}} {name} frees\\n")
"""


def _party(log: Path, run: str, name: str, nproc: int, start: float, hold: float):
    code = _PARTY.format(tests=str(TESTS), log=str(log), name=name, nproc=nproc, start=start,
                         hold=hold)  # fmt: skip
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run}
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def _events(log: Path) -> dict[tuple[str, str], float]:
    events = {}
    for line in log.read_text().splitlines():
        stamp, name, what = line.split()
        events[name, what] = float(stamp)
    return events


def test_a_block_of_every_slot_runs_alone_and_is_not_starved(tmp_path: Path) -> None:
    log, run = tmp_path / "log", f"test-{uuid.uuid4().hex}"
    # "small" holds one slot from the start; "all" asks for every slot at 0.5 s; "late" asks
    # for one at 1.0 s, when slots are free but "all" is waiting: it must wait behind "all".
    parties = [
        _party(log, run, "small", 1, start=0.0, hold=2.0),
        _party(log, run, "all", SLOTS + 3, start=0.5, hold=1.0),
        _party(log, run, "late", 1, start=1.0, hold=0.2),
    ]
    deadline = time.time() + 120
    for party in parties:
        assert party.wait(timeout=max(1, deadline - time.time())) == 0
    at = _events(log)
    assert at["small", "holds"] < at["all", "asks"] < at["late", "asks"]
    # "all" starts only once "small" freed its slot, and runs alone.
    assert at["all", "holds"] >= at["small", "frees"]
    assert at["late", "holds"] >= at["all", "frees"]


def test_a_block_nested_in_another_takes_what_remains(tmp_path: Path) -> None:
    code = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers.launch import slots, _SLOTS
with slots(2):
    with slots({SLOTS + 3}):
        print(sorted(len(taken) for taken in _SLOTS.held.values()))
print(_SLOTS.held)
"""
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": f"test-{uuid.uuid4().hex}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")  # fmt: skip
    assert out[0] == str(sorted([2, SLOTS - 2])) and out[1] == "{}"
