"""Steps that run beside a nox session (``noxfile.py``): ``ahead`` starts them, one after
another, in a process of their own while the session goes on; ``collect`` waits for one and
shows its log. CI starts the test worlds' installs so: pip waits mostly on the network and the
disk, and the sessions before need the CPU.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nox only for the types: the tests import this module without it
    import nox


#: A step: its name, and its commands (each an argv), run one after another.
Step = tuple[str, list[tuple[str, ...]]]

#: Steps started by ``ahead`` and not yet collected: name -> (process, log, status file).
_AHEAD: dict[str, tuple[subprocess.Popen, str, str]] = {}


def ahead(session: nox.Session, *steps: Step) -> None:
    """Run ``steps`` (``(name, commands)``) one after another in a process of their own (with
    the session's environment) while the session goes on; ``collect(session, name)`` waits for
    the step ``name``. A step's commands run one after another, in a subshell (a ``cd`` stays
    in it), into the log ``.nox/<name>.log``; a step that fails leaves the next to run."""
    # nox marks a variable to unset with None (PYTHONHOME, ...).
    env = {k: v for k, v in {**os.environ, **session.env}.items() if v is not None}
    files = {name: step_files(name) for name, _ in steps}
    script = []
    for name, commands in steps:
        for old in files[name]:
            if os.path.exists(old):
                os.remove(old)
        run = " && ".join(shlex.join(command) for command in commands)
        log, status = map(shlex.quote, files[name])
        # The status file appears whole (a rename) once the step is over.
        script.append(f"(set -x; {run}) > {log} 2>&1; echo $? > {status}.part; "
                      f"mv {status}.part {status}")  # fmt: skip
    process = subprocess.Popen(["bash", "-c", "\n".join(script)], env=env)
    for name, (log, status) in files.items():
        _AHEAD[name] = (process, log, status)
        session.log(f"{name}: running beside the session (log: {log})")


def step_files(name: str) -> tuple[str, str]:
    """The log of ``ahead``'s step ``name`` and the file its exit status goes to."""
    return tuple(os.path.abspath(os.path.join(".nox", name + ext)) for ext in (".log", ".status"))


def collect(session: nox.Session, name: str) -> bool:
    """Wait for ``ahead``'s step ``name`` and show its log; False when it was not started."""
    if name not in _AHEAD:
        return False
    process, log, status = _AHEAD.pop(name)
    session.log(f"{name}: waiting for it")
    while not os.path.exists(status) and process.poll() is None:
        time.sleep(1)
    if os.path.exists(log):
        with open(log) as f:
            session.log(f.read())
    if not os.path.exists(status):
        session.error(f"{name}: its process ended (exit {process.returncode}) before it ran")
    with open(status) as f:
        code = int(f.read())
    if code:
        session.error(f"{name}: failed (exit {code}); its log is above")
    return True


def started(prefix: str) -> bool:
    """Whether a step whose name starts with ``prefix`` runs and is not collected yet."""
    return any(name.startswith(prefix) for name in _AHEAD)
