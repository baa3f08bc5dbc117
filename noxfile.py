"""The test environments: every supported Python x megatron-core world, built from scratch.

    python3 -m venv .ci-venv && .ci-venv/bin/pip install -q nox && .ci-venv/bin/nox

runs them all (that is the README's test command and what CI runs); ``nox -s tests-3.11`` runs
one, and arguments after ``--`` replace pytest's default ``tests`` (``-- tests/test_args.py``).
Each session makes its own virtualenv under ``.nox/``, installs torch 2.13.0, the pinned
megatron-core and this project with its test extras, and runs the suite on CPU/gloo:

* ``tests-3.11``: Python 3.11, torch's CPU wheel, megatron-core 0.16.1 (the last release that
  supports Python 3.11): the whole suite.
* ``tests-3.12``: Python 3.12, megatron-core 0.19.2: the whole suite; then, in the same
  virtualenv (torch is the expensive part), megatron-core 0.17.1 and 0.18.2 for the release
  checks and the invariance matrix, context parallelism included; last, megatron-core 0.19.2
  again with Megatron Bridge 0.6.2 (``.ci/install_bridge.sh``) for the Bridge tests.

Where a git mirror of NVIDIA/Megatron-LM is at hand (``MEGATRON_LM_GIT``, by default the one the
``fetch`` tool keeps), each session also runs Megatron-Core's own pipeline-schedule tests with the
plugin swapped in (``tests/test_upstream_schedules.py``): core_v0.16.1 in 3.11, core_v0.19.0 in
3.12, each tag's tree exported with ``git archive`` into ``.nox/megatron-lm/``. Without a mirror
the session says so and goes on.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
LATEST = {"3.11": "0.16.1", "3.12": "0.19.2"}
#: Older releases of the 3.12 line, checked in the 3.12 virtualenv after the full suite.
OLDER_312 = ("0.17.1", "0.18.2")
#: What pins Megatron's averaging and the layout matrix (the release-sensitive part).
MATRIX_TESTS = (
    "tests/test_megatron_averaging.py",
    "tests/test_invariance.py",
    "tests/test_hard_layouts.py",
    "tests/test_mtp.py",
)

#: Megatron-LM tag whose own schedule tests run in each world (the oldest and newest supported).
UPSTREAM_TAG = {"3.11": "core_v0.16.1", "3.12": "core_v0.19.0"}
#: What those tests import beyond megatron-core: pytest-mock everywhere, and from 0.19 on
#: Megatron-LM's ``megatron.training`` (through ``tests/unit_tests/test_utilities.py``).
UPSTREAM_DEPS = {
    "3.11": ("pytest-mock",),
    "3.12": ("pytest-mock", "pyyaml", "einops", "six", "regex", "pydantic", "pybind11"),
}
MEGATRON_LM_GIT = os.environ.get("MEGATRON_LM_GIT", "/work/.mirror/NVIDIA+Megatron-LM/repo")


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


def _install(session: nox.Session, megatron_core: str) -> None:
    session.install(TORCH, f"megatron-core=={megatron_core}", "-e", ".[test]")


def _upstream_schedule_tests(session: nox.Session, python: str) -> None:
    """Megatron-Core's own schedule tests, stock and swapped, from the tag's exported tree."""
    tag = UPSTREAM_TAG[python]
    if session.posargs:
        return
    if not os.path.isdir(MEGATRON_LM_GIT):
        session.warn(f"no Megatron-LM mirror at {MEGATRON_LM_GIT}: upstream schedule tests skipped")
        return
    tree = os.path.join(".nox", "megatron-lm", tag)
    if not os.path.isdir(os.path.join(tree, "tests")):
        os.makedirs(tree, exist_ok=True)
        archive = subprocess.run(
            ["git", f"--git-dir={MEGATRON_LM_GIT}", "archive", tag], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "x", "-C", tree], input=archive, check=True)
    session.install(*UPSTREAM_DEPS[python])
    session.run(
        "python", "-m", "pytest", "-q", "-rA", "tests/test_upstream_schedules.py",
        env={"MEGATRON_LM_PATH": os.path.abspath(tree)},
    )  # fmt: skip


@nox.session(name="tests-3.11", python="3.11", download_python="never")
def tests_311(session: nox.Session) -> None:
    """Whole suite on megatron-core 0.16.1."""
    _install(session, LATEST["3.11"])
    session.run("python", "-m", "pytest", "-q", *(session.posargs or ["tests"]))
    _upstream_schedule_tests(session, "3.11")


@nox.session(name="tests-3.12", python="3.12", download_python="never")
def tests_312(session: nox.Session) -> None:
    """Whole suite on megatron-core 0.19.2, then the release checks on 0.17.1 and 0.18.2."""
    _install(session, LATEST["3.12"])
    session.run("python", "-m", "pytest", "-q", *(session.posargs or ["tests"]))
    for release in OLDER_312:
        session.install(f"megatron-core=={release}")
        session.run("python", "-m", "pytest", "-q", *(session.posargs or MATRIX_TESTS))
    session.install(f"megatron-core=={LATEST['3.12']}")
    _upstream_schedule_tests(session, "3.12")
    # Megatron Bridge last: Bridge 0.6 pins the 0.19 line, and the nvidia-resiliency-ext it
    # brings breaks a plain `import megatron.core` (the plugin's Bridge CPU shims hide it), so
    # nothing else runs in this virtualenv after it.
    session.run("bash", ".ci/install_bridge.sh", os.path.join(session.bin, "python"), external=True)
    session.run("python", "-m", "pytest", "-q", "tests/test_bridge.py")
