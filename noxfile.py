"""The test environments: every supported Python x megatron-core world, built from scratch.

    python3 -m venv .ci-venv && .ci-venv/bin/pip install -q nox && .ci-venv/bin/nox

runs every session below (that is the README's test command and what CI runs); ``nox -s
tests-3.11`` runs one, and arguments after ``--`` replace pytest's default selection
(``-- tests/test_args.py``, ``-- -m unit``). Each tests session makes its own virtualenv under
``.nox/``, installs ``torch==2.13.0`` as a plain requirement (no index or build is named: pip
takes what its own configuration offers for that Python, which from PyPI alone is the CUDA build
of about 1.35 GB, and from a wheel folder or index the machine configures may be a ``+cpu``
wheel; the tests run on CPU with either), the pinned megatron-core, this project with its test
extras and what Megatron-LM's training scripts import, and runs pytest on CPU/gloo:

* ``lint``: ``ruff check`` and ``ruff format --check`` (ruff pinned as in the test extras).
* ``tests-3.11``: Python 3.11, megatron-core 0.16.1 (the last release that supports Python
  3.11): what depends on the release (``RELEASE_TESTS``): Megatron's averaging pinned, the
  gradient oracle over the layout matrix, MTP, Megatron-LM's patched ``pretrain_gpt.py`` at
  ``core_v0.16.1`` and Megatron-Core's own schedule tests of that tag.
* ``tests-3.12``: Python 3.12, megatron-core 0.19.2: the whole suite (Megatron-LM at
  ``core_v0.19.0``); then, in the same virtualenv, Megatron Bridge 0.6.2
  (``.ci/install_bridge.sh``) for the Bridge tests.
* ``older-3.12`` (not run by default, it does not fit CI's time; ``nox -s older-3.12``):
  Python 3.12 with megatron-core 0.17.1, then 0.18.2 in the same virtualenv, ``RELEASE_TESTS``
  each (Megatron-LM at ``core_v0.17.1`` and ``core_v0.18.2``).

In each tests session the files that launch the most processes (``SIDE_BY_SIDE``: Megatron-LM,
Megatron-Core's schedule tests, the examples) run in a second pytest beside the rest; its output
follows the first's.

The Megatron-LM tests read their source trees from the folder of archives that
``MEGATRON_LM_ARCHIVES`` names (``<tag>.tar.gz``; ``.ci/run`` sets it) and skip, saying so in one
line, without it. While ``tests-3.11`` runs its tests, the wheels ``tests-3.12`` installs, then
those of Megatron Bridge (``.ci/bridge-requirements.txt``), are downloaded in the background into
``.nox/wheels-3.12`` (their download is most of that session's set-up); both installs then read
that folder (Bridge's alone, without an index, when its download worked).
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import subprocess
import sys
import threading
from xml.etree import ElementTree

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests-3.11", "tests-3.12"]

TORCH = "torch==2.13.0"
RUFF = "ruff==0.17.6"
LATEST = {"3.11": "0.16.1", "3.12": "0.19.2"}
#: Older releases of the 3.12 line (session older-3.12).
OLDER_312 = ("0.17.1", "0.18.2")
#: What depends on the megatron-core release: Megatron's averaging pinned, the oracle over the
#: layout matrix, MTP, and Megatron-LM's own code at the release's tag (its patched
#: ``pretrain_gpt.py`` and its pipeline-schedule tests).
RELEASE_TESTS = (
    "tests/test_megatron_averaging.py",
    "tests/test_invariance.py",
    "tests/test_hard_layouts.py",
    "tests/test_mtp.py",
    "tests/test_megatron_lm.py::test_patched_pretrain_gpt_is_layout_invariant",
    "tests/test_upstream_schedules.py",
)
#: The test files that launch the most processes (Megatron-LM's ``pretrain_gpt.py``, Megatron-Core's
#: schedule tests on 8 ranks, the example scripts): ``_pytest`` runs them in a second pytest
#: beside the rest.
SIDE_BY_SIDE = (
    "tests/test_megatron_lm.py",
    "tests/test_upstream_schedules.py",
    "tests/test_examples.py",
)
#: What Megatron-LM's ``pretrain_gpt.py`` (``megatron/training``) and its schedule tests import
#: beyond megatron-core; triton comes with torch's CUDA build but not with the CPU wheel.
MEGATRON_LM_DEPS = {
    "3.11": ("six", "regex", "pyyaml", "pydantic", "pybind11", "psutil", "einops", "triton",
             "pytest-mock"),
    "3.12": ("six", "regex", "pyyaml", "pydantic", "pybind11", "psutil", "einops", "pytest-mock"),
}  # fmt: skip
WHEELS_312 = os.path.join(".nox", "wheels-3.12")
BRIDGE = "megatron-bridge==0.6.2"  # as .ci/install_bridge.sh installs it
#: What ``.ci/install_bridge.sh`` installs beside Megatron Bridge.
BRIDGE_REQUIREMENTS = os.path.join(".ci", "bridge-requirements.txt")
#: The background downloads, in order: name -> (done, exit status).
_prefetch: dict[str, tuple[threading.Event, list[int]]] = {}
_prefetch_proc: list[subprocess.Popen] = []


def _expose_pyenv_versions() -> None:
    """With pyenv, ``python3.12`` is a shim that answers only for the active versions; activate
    every installed 3.11/3.12 so that nox finds both interpreters."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    if "PYENV_VERSION" in os.environ or not shutil.which("pyenv"):
        return
    versions = [
        os.path.basename(path)
        for minor in LATEST
        for path in sorted(glob.glob(os.path.join(root, "versions", f"{minor}.*")))[-1:]
    ]
    if versions:
        os.environ["PYENV_VERSION"] = ":".join(versions)


_expose_pyenv_versions()


def _start_prefetch_312(session: nox.Session) -> None:
    """Download into ``WHEELS_312``, in the background while this session runs its tests, first
    the 3.12 world's torch and megatron-core (with their dependencies), which ``tests-3.12``
    installs from, then Megatron Bridge and what ``.ci/install_bridge.sh`` installs beside it
    (one folder: what both need, torch first of all, is downloaded once)."""
    python = shutil.which("python3.12")
    if _prefetch or python is None or "tests-3.12" not in _selected():
        return
    os.makedirs(WHEELS_312, exist_ok=True)
    pins = (TORCH, f"megatron-core=={LATEST['3.12']}")
    constraints = os.path.join(WHEELS_312, "constraints.txt")
    with open(constraints, "w") as f:
        f.write("\n".join(pins) + "\n")
    pip = [python, "-m", "pip", "download", "-q", "-d", WHEELS_312, "--find-links", WHEELS_312]
    steps = {
        "3.12": [[*pip, *pins]],
        "bridge": [
            [*pip, "--no-deps", BRIDGE],
            [*pip, "-c", constraints, "-r", BRIDGE_REQUIREMENTS],
        ],
    }
    for name in steps:
        _prefetch[name] = (threading.Event(), [])

    def download() -> None:
        with open(os.path.join(WHEELS_312, "download.log"), "w") as log:
            for name, commands in steps.items():
                done, status = _prefetch[name]
                for cmd in commands:
                    _prefetch_proc[:] = [subprocess.Popen(cmd, stdout=log, stderr=log)]
                    status.append(_prefetch_proc[0].wait())
                    if status[-1] != 0:
                        break
                done.set()

    threading.Thread(target=download, daemon=True).start()
    atexit.register(lambda: [p.terminate() for p in _prefetch_proc if p.poll() is None])
    session.log(f"downloading the 3.12 and Bridge wheels in the background into {WHEELS_312}")


def _prefetched(session: nox.Session, name: str) -> bool:
    """Wait for the background download ``name`` (``3.12``, ``bridge``); whether it worked."""
    if name not in _prefetch:
        return False
    done, status = _prefetch[name]
    session.log(f"waiting for the background download of the {name} wheels")
    done.wait()
    if not status or status[-1] != 0:
        session.warn(f"background download failed (see {WHEELS_312}/download.log)")
        return False
    return True


def _selected() -> list[str]:
    """The sessions this nox run was asked for (``-s``), or the default ones."""
    argv = sys.argv[1:]
    names = []
    for flag in ("-s", "--session", "--sessions", "-e"):
        while flag in argv:
            i = argv.index(flag)
            j = i + 1
            while j < len(argv) and not argv[j].startswith("-"):
                names.append(argv[j])
                j += 1
            argv = argv[:i] + argv[j:]
    return names or list(nox.options.sessions)


def _install(session: nox.Session, python: str, release: str | None = None) -> None:
    megatron_core = f"megatron-core=={release or LATEST[python]}"
    downloaded = python == "3.12" and bool(glob.glob(os.path.join(WHEELS_312, "torch-*.whl")))
    if python == "3.12" and "3.12" in _prefetch:
        downloaded = _prefetched(session, "3.12")
    if downloaded:
        session.install("--no-index", "--find-links", WHEELS_312, TORCH)
    session.install(TORCH, megatron_core, "-e", ".[test]", *MEGATRON_LM_DEPS[python])


def _pytest(session: nox.Session, *default: str) -> None:
    """pytest, whose own summary line closes the output; fails when no test ran (pytest alone
    exits 0 when every selected test skipped).

    Without arguments after ``--``, the files in ``SIDE_BY_SIDE`` run in a second pytest beside
    the rest (its output follows the first's): most of their time is processes starting up, one
    importing core each, and a single stream of tests leaves about a third of two cores idle."""
    tmp = session.create_tmp()
    selection = list(session.posargs or default)
    groups = [selection]
    if not session.posargs:
        beside = [t for t in selection if t.split("::")[0] in SIDE_BY_SIDE]
        if selection == ["tests"]:
            beside = list(SIDE_BY_SIDE)
            selection = ["tests", *(f"--ignore={path}" for path in SIDE_BY_SIDE)]
        else:
            selection = [t for t in selection if t not in beside]
        groups = [g for g in (selection, beside) if g]
    commands = [
        [
            os.path.join(session.bin, "python"), "-m", "pytest", "-q", "-rs", "--durations=15",
            f"--junitxml={os.path.join(tmp, f'junit-{i}.xml')}",
            f"--basetemp={os.path.join(tmp, f'pytest-{i}')}", *group,
        ]
        for i, group in enumerate(groups)
    ]  # fmt: skip
    # The second group writes to a file while the first streams; both run to the end.
    logs = [os.path.join(tmp, f"pytest-{i}.log") for i in range(len(commands))]
    env = {**os.environ, **session.env, "VIRTUAL_ENV": session.virtualenv.location}
    env = {k: v for k, v in env.items() if v is not None}  # nox's None: unset
    env["PATH"] = session.bin + os.pathsep + os.environ["PATH"]
    background = []
    for cmd, log in zip(commands[1:], logs[1:], strict=True):
        session.log(f"beside it: {' '.join(cmd[1:])} (output: {log})")
        with open(log, "w") as out:
            background.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
    session.log(" ".join(commands[0][1:]))
    try:
        status = [subprocess.call(commands[0], env=env)]
    finally:  # interrupted: take the second pytest down with the first
        atexit.register(lambda: [p.kill() for p in background if p.poll() is None])
    for proc, log in zip(background, logs[1:], strict=True):
        status.append(proc.wait())
        with open(log) as out:
            print(out.read(), flush=True)
    ran = 0
    for i in range(len(commands)):
        report = os.path.join(tmp, f"junit-{i}.xml")
        if os.path.exists(report):
            for suite in ElementTree.parse(report).getroot().iter("testsuite"):
                ran += int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    if any(status):
        session.error(f"pytest failed (exit status {', '.join(map(str, status))})")
    if ran == 0:
        session.error("no test ran")


@nox.session(python="3.12", download_python="never")
def lint(session: nox.Session) -> None:
    """ruff, as ruff.toml says."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(name="tests-3.11", python="3.11", download_python="never")
def tests_311(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.16.1 (Megatron-LM core_v0.16.1)."""
    _install(session, "3.11")
    _start_prefetch_312(session)  # after this install, not beside it: both fetch and unpack
    _pytest(session, *RELEASE_TESTS)


@nox.session(name="tests-3.12", python="3.12", download_python="never")
def tests_312(session: nox.Session) -> None:
    """Whole suite on megatron-core 0.19.2, then Megatron Bridge."""
    _install(session, "3.12")
    _pytest(session, "tests")
    if session.posargs:
        return
    # Megatron Bridge last: Bridge 0.6 pins the 0.19 line, and the nvidia-resiliency-ext it
    # brings breaks a plain `import megatron.core` (the plugin's Bridge CPU shims hide it), so
    # nothing else runs in this virtualenv after it.
    # From the wheels downloaded while tests-3.11 ran, where that worked (pip reads these).
    local = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": os.path.abspath(WHEELS_312)}
    env = local if _prefetched(session, "bridge") else {}
    python = os.path.join(session.bin, "python")
    session.run("bash", ".ci/install_bridge.sh", python, env=env, external=True)
    _pytest(session, "-m", "e2e", "tests/test_bridge.py")


@nox.session(name="older-3.12", python="3.12", download_python="never", default=False)
def older_312(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.17.1 and 0.18.2 (their Megatron-LM tags)."""
    _install(session, "3.12", OLDER_312[0])
    for release in OLDER_312:
        session.install(f"megatron-core=={release}")
        _pytest(session, *RELEASE_TESTS)
