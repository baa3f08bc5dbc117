"""The tests' launches (``helpers.launch``) end what their ranks started: a rank forked from a
zygote leads its own process group, which the zygote kills when the rank ends. Megatron-LM's RL
loop (core_v0.19.0) spawns an inference coordinator that outlived its rank, asleep, for the
rest of the machine's life."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers.launch import launch

pytestmark = pytest.mark.unit

#: A rank that starts a child which would sleep for ten minutes, says its pid, and ends.
_SCRIPT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and waiting for its parent to reap it, does not)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_forked_rank_leaves_nothing_running(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_SCRIPT)
    pids = [tmp_path / f"child-{i}" for i in range(2)]
    for out in pids:  # twice: the zygote that ended the first rank's group serves the second
        result = launch(script, 1, [str(out)], preload=["subprocess"])
        assert result.returncode == 0, result.output
    children = [int(out.read_text()) for out in pids]
    deadline = time.time() + 10
    while any(map(_running, children)) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _running(pid)], "a rank's child outlived it"
