"""The test worlds, each built from scratch. The README's test command runs the default ones:

    python3 -m venv .ci-venv && .ci-venv/bin/pip install -q nox && .ci-venv/bin/nox

(that is what CI runs); ``nox -s tests-3.11`` runs one, and arguments after ``--`` replace
pytest's selection (``-- tests/test_args.py``, ``-- -m unit``).

* ``lint``: ``ruff check`` and ``ruff format --check``.
* ``tests-3.11``: Python 3.11 with megatron-core 0.16.1 (the last release for 3.11) runs what
  depends on the release (``RELEASE_TESTS``).
* ``tests-3.12``: Python 3.12 with megatron-core 0.19.2 runs the whole suite; then Megatron
  Bridge's tests and verl's and SkyRL's, each in a virtualenv of its own (``_layer``).
* ``older-3.12`` (not by default): megatron-core 0.17.1, then 0.18.2, ``RELEASE_TESTS``.

Each world installs ``torch==2.13.0`` as a plain requirement (pip takes what its configuration
offers for that Python: from PyPI alone the CUDA build, which runs on CPU too), the pinned
megatron-core, this project with its test extras and what Megatron-LM's training scripts import.
pytest runs on CPU/gloo with one worker per core of CI's two (pytest-xdist); a test file stays
on one worker, so that its tests share their launches. The Megatron-LM tests read Megatron-LM's
sources from the archives that ``MEGATRON_LM_ARCHIVES`` names (``.ci/run`` sets it).
"""

from __future__ import annotations

import glob
import os
import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests-3.11", "tests-3.12"]
#: Let Python cache the bytecode it compiles (the machine may say not to): the Megatron-LM trees
#: the tests unpack would otherwise be compiled again by every process that imports them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

TORCH = "torch==2.13.0"
RUFF = "ruff==0.17.6"
LATEST = {"3.11": "0.16.1", "3.12": "0.19.2"}
OLDER_312 = ("0.17.1", "0.18.2")
#: What depends on the megatron-core release: Megatron's averaging pinned, the gradient oracle
#: over the layout matrix, MTP, and Megatron-LM's own code at the release's tag (its patched
#: ``pretrain_gpt.py`` dense, MoE and resized, and its pipeline-schedule tests).
RELEASE_TESTS = (
    "tests/test_megatron_averaging.py",
    "tests/test_invariance.py",
    "tests/test_hard_layouts.py",
    "tests/test_mtp.py",
    "tests/test_megatron_lm.py::test_patched_pretrain_gpt_is_layout_invariant",
    "tests/test_megatron_lm_moe.py",
    "tests/test_megatron_lm_resize.py",
    "tests/test_megatron_lm_rl.py::test_train_rl_plugin_is_layout_invariant",
    "tests/test_megatron_lm_rl.py::test_train_rl_stock_moves_with_the_padding",
    "tests/test_megatron_lm_rl.py::test_train_rl_modes_mean_what_they_say",
    "tests/test_upstream_schedules.py",
)
#: What Megatron-LM's training scripts and its schedule tests import beyond megatron-core, with
#: what ``train_rl.py`` (``megatron/rl``, ``megatron/inference``) imports besides; triton comes
#: with torch's CUDA build but not with the CPU wheel, and at core_v0.16.1 ``train_rl.py``'s chat
#: templates import transformers (``_install`` adds both on 3.11).
MEGATRON_LM_DEPS = ("six", "regex", "pyyaml", "pydantic", "pybind11", "psutil", "einops",
                    "pytest-mock", "tensorboard", "wandb", "httpx", "fastapi", "uvicorn",
                    "openai", "tqdm")  # fmt: skip
#: pytest's options in every world: two workers, a file's tests on one, the slowest tests
#: listed, and a run in which every test skipped (a missing dependency) fails.
PYTEST = ("-n", "2", "--dist", "loadfile", "-q", "-rs", "--durations=20", "--fail-if-none-ran")
#: Megatron Bridge, verl and SkyRL cannot share the suite's virtualenv: Bridge brings an
#: nvidia-resiliency-ext that breaks a plain ``import megatron.core``, and verl and SkyRL pin a
#: transformers that Bridge refuses. Each gets a virtualenv layered over the suite's.
BRIDGE_TESTS = ("-m", "e2e", "tests/test_bridge.py")
RL_TESTS = ("tests/test_verl_stack.py", "tests/test_skyrl_stack.py", "tests/test_readme_stacks.py")
VERL = "verl==0.9.1"  # as setup.py's extra pins it; installed without its dependencies
RL_REQUIREMENTS = os.path.join(".ci", "rl-requirements.txt")


def _expose_pyenv_versions() -> None:
    """With pyenv, ``python3.12`` is a shim that answers only for the active versions; activate
    the newest installed 3.11 and 3.12 so that nox finds both interpreters."""
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


def _install(session: nox.Session, release: str) -> None:
    extra = ("triton", "transformers") if session.python == "3.11" else ()
    session.install(TORCH, f"megatron-core=={release}", "-e", ".[test]", *MEGATRON_LM_DEPS, *extra)


def _pytest(session: nox.Session, *selection: str, python: str = "python") -> None:
    args = ("-m", "pytest", *PYTEST, *(session.posargs or selection))
    session.run(python, *args, external=python != "python")


def _layer(session: nox.Session, name: str) -> str:
    """A new virtualenv ``.nox/<name>`` that sees this session's packages after its own (a
    ``.pth`` file), so that torch and megatron-core are not installed again (about 80 s of CPU
    and 4.7 GB each); pip installs into it what it lacks. Returns its Python."""
    venv = os.path.abspath(os.path.join(".nox", name))
    session.run("python", "-m", "venv", "--clear", venv)
    below = session.run("python", "-c", "import site; print(site.getsitepackages()[0])",
                        silent=True).strip()  # fmt: skip
    (site,) = glob.glob(os.path.join(venv, "lib", "python3.*", "site-packages"))
    with open(os.path.join(site, "_layer.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({below!r})\n")
    return os.path.join(venv, "bin", "python")


@nox.session(python="3.12", download_python="never")
def lint(session: nox.Session) -> None:
    """ruff, as pyproject.toml says."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(name="tests-3.11", python="3.11", download_python="never")
def tests_311(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.16.1 (Megatron-LM core_v0.16.1)."""
    _install(session, LATEST["3.11"])
    _pytest(session, *RELEASE_TESTS)


@nox.session(name="tests-3.12", python="3.12", download_python="never")
def tests_312(session: nox.Session) -> None:
    """The whole suite on megatron-core 0.19.2, then Bridge's and verl's and SkyRL's tests."""
    _install(session, LATEST["3.12"])
    _pytest(session, "tests", *(f"--ignore={test}" for test in RL_TESTS))
    if session.posargs:
        return
    bridge = _layer(session, "bridge-3.12")
    session.run(bridge, "-m", "megatron_lossfix", "install-bridge", external=True)
    _pytest(session, *BRIDGE_TESTS, python=bridge)
    rl = _layer(session, "rl-3.12")
    pins = os.path.join(session.create_tmp(), "pins.txt")
    with open(pins, "w") as f:
        f.write(f"{TORCH}\nmegatron-core=={LATEST['3.12']}\n")
    pip = (rl, "-m", "pip", "install", "-q")
    session.run(*pip, "--no-deps", VERL, external=True)
    session.run(*pip, "-c", pins, "-r", RL_REQUIREMENTS, external=True)
    _pytest(session, *RL_TESTS, python=rl)


@nox.session(name="older-3.12", python="3.12", download_python="never", default=False)
def older_312(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.17.1 and 0.18.2 (their Megatron-LM tags)."""
    for release in OLDER_312:
        _install(session, release)
        _pytest(session, *RELEASE_TESTS)
