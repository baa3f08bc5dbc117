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
  ``core_v0.19.0``) and, beside it, Megatron Bridge 0.6.2's tests in a virtualenv layered over
  the suite's (``.ci/install_bridge.sh``: Bridge's dependencies must not land where the suite
  runs), then verl's and SkyRL's stack audits in a third layer (``RL_312``). Its three
  virtualenvs are this file's own (``WORLD_312``, ``BRIDGE_312``, ``RL_312``), not nox's.
* ``older-3.12`` (not run by default, it does not fit CI's time; ``nox -s older-3.12``):
  Python 3.12 with megatron-core 0.17.1, then 0.18.2 in the same virtualenv, ``RELEASE_TESTS``
  each (Megatron-LM at ``core_v0.17.1`` and ``core_v0.18.2``).

In each tests session a second pytest runs beside the first (``BESIDE_RELEASE``,
``BESIDE_SUITE``: Megatron-LM, Megatron-Core's schedule tests, the examples, then Bridge's); its
output follows the first's. The two cores are busy throughout a run: what shortens it is less
work and no core left idle, not more streams.

The Megatron-LM tests read their source trees from the folder of archives that
``MEGATRON_LM_ARCHIVES`` names (``<tag>.tar.gz``; ``.ci/run`` sets it) and skip, saying so in one
line, without it. While ``tests-3.11`` runs its tests, the 3.12 world is set up in the background
(``_start_312``): its wheels, then Megatron Bridge's (``BRIDGE_REQUIREMENTS``) and the stacks'
(``.ci/rl-requirements.txt``), are downloaded into ``.nox/wheels-3.12`` and the virtualenvs are
built from that folder (the layers without an index, when their downloads worked), so that
``tests-3.12`` starts its tests at once.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from xml.etree import ElementTree

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests-3.11", "tests-3.12"]
#: Let Python cache the bytecode it compiles where the environment says not to: what pip installs
#: is compiled at install either way, but the Megatron-LM trees the tests unpack (their
#: ``megatron`` package shadows the installed one in ``pretrain_gpt.py``) would otherwise be
#: compiled again by every rank of every launch (about 8% of a launch's CPU time).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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
#: The test files a second pytest runs beside the rest (``_pytest``): those that launch the most
#: processes (Megatron-LM's ``pretrain_gpt.py``, Megatron-Core's schedule tests on 8 ranks, the
#: example scripts), as many as make both end about together (a launch is mostly one process
#: importing: one stream of tests left about a third of two cores idle). Of the release tests,
#: the Megatron-LM layouts alone (the schedule tests would end that stream a minute after the
#: other); of the whole suite, these three, then Megatron Bridge's tests.
BESIDE_RELEASE = ("tests/test_megatron_lm.py",)
BESIDE_SUITE = (
    "tests/test_megatron_lm.py",
    "tests/test_upstream_schedules.py",
    "tests/test_examples.py",
)
#: e2e tests CI leaves out, for time: Megatron-LM's MoE and resize runs and Bridge's LoRA and
#: MoE runs, 45 torchrun launches (about 26 minutes on two cores) where CI has none to spare.
#: They run wherever Megatron-LM's archives and Bridge are installed (README, "Tests": their
#: command, figures and times), and in ``tests-3.12`` given as its arguments.
BY_HAND = (
    "tests/test_megatron_lm_moe.py",
    "tests/test_megatron_lm_resize.py",
    "tests/test_bridge.py::test_bridge_lora",
    "tests/test_bridge.py::test_bridge_moe",
)
#: What Megatron-LM's ``pretrain_gpt.py`` (``megatron/training``) and its schedule tests import
#: beyond megatron-core; triton comes with torch's CUDA build but not with the CPU wheel.
MEGATRON_LM_DEPS = {
    "3.11": ("six", "regex", "pyyaml", "pydantic", "pybind11", "psutil", "einops", "triton",
             "pytest-mock"),
    "3.12": ("six", "regex", "pyyaml", "pydantic", "pybind11", "psutil", "einops", "pytest-mock"),
}  # fmt: skip
WHEELS_312 = os.path.join(".nox", "wheels-3.12")
#: The 3.12 world's virtualenvs, made here rather than by nox so that they can be built while
#: ``tests-3.11`` runs: the whole suite's, and Megatron Bridge's, layered over it (a ``.pth``
#: adds the first's site-packages after its own): Bridge brings an nvidia-resiliency-ext that
#: breaks a plain ``import megatron.core``, so it must not land where the suite runs, and the
#: layer lets its tests run beside the suite's without a second torch install.
WORLD_312 = os.path.join(".nox", "world-3.12")
BRIDGE_312 = os.path.join(".nox", "bridge-3.12")
BUILD_LOG_312 = os.path.join(".nox", "build-3.12.log")
BRIDGE = "megatron-bridge==0.6.2"  # as `python -m megatron_lossfix install-bridge` installs it
#: What ``python -m megatron_lossfix install-bridge`` installs beside Megatron Bridge.
BRIDGE_REQUIREMENTS = os.path.join("megatron_lossfix", "integrations", "bridge-requirements.txt")
BRIDGE_TESTS = "tests/test_bridge.py"
#: The verl and SkyRL stack audits' virtualenv, layered over the world like Bridge's: their
#: transformers pin conflicts with Bridge's, and neither belongs where the suite runs. verl and
#: SkyRL are installed without their dependencies (verl's pull GPU tooling its Megatron loss path
#: never imports, and by their metadata the two releases do not resolve together); what both
#: import is in RL_REQUIREMENTS.
RL_312 = os.path.join(".nox", "rl-3.12")
VERL = "verl==0.9.1"  # as setup.py's extra pins it
SKYRL = "skyrl==0.4.0"  # likewise
RL_REQUIREMENTS = os.path.join(".ci", "rl-requirements.txt")
RL_TESTS = ("tests/test_verl_stack.py", "tests/test_skyrl_stack.py")
#: The background work for the 3.12 world: name -> (done, exit statuses of its commands).
_jobs: dict[str, tuple[threading.Event, list[int]]] = {}
_job_procs: list[subprocess.Popen] = []


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


def _python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _start_312(session: nox.Session, *, bridge: bool = True) -> None:
    """Start, once, the 3.12 world's set-up in the background: download its wheels into
    ``WHEELS_312`` (torch and megatron-core with their dependencies, then Megatron Bridge's and
    the stack audits'), and beside those downloads build ``WORLD_312`` from them, then
    ``BRIDGE_312`` and ``RL_312`` over it (without ``bridge``, only the world).

    ``tests-3.11`` starts it; ``tests-3.12`` waits for what it needs (``_built``). Not at a lower
    priority: the cores are busy with tests throughout, and the scheduler weighs a nice-10
    process at about a tenth of a test's, so a niced build would mostly run after ``tests-3.11``,
    with ``tests-3.12`` waiting for it; sharing the cores, it costs the 3.11 tests what it costs
    and is done when they are."""
    python = shutil.which("python3.12")
    if _jobs or python is None:
        return
    os.makedirs(WHEELS_312, exist_ok=True)
    for name in ("download-3.12", "download-bridge", "download-rl", "world-3.12", "bridge-3.12",
                 "rl-3.12"):  # fmt: skip
        _jobs[name] = (threading.Event(), [])
    pins = (TORCH, f"megatron-core=={LATEST['3.12']}")
    constraints = os.path.join(WHEELS_312, "constraints.txt")
    with open(constraints, "w") as f:
        f.write("\n".join(pins) + "\n")
    pip = [python, "-m", "pip", "download", "-q", "-d", WHEELS_312, "--find-links", WHEELS_312]
    local = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": os.path.abspath(WHEELS_312)}

    def run(name: str, log, cmd: list[str], env: dict[str, str] | None = None) -> bool:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=full_env)
        _job_procs.append(proc)
        _jobs[name][1].append(proc.wait())
        return _jobs[name][1][-1] == 0

    def downloads() -> None:
        steps = {"download-3.12": [[*pip, *pins]], "download-bridge": [], "download-rl": []}
        if bridge:
            steps["download-bridge"] = [
                [*pip, "--no-deps", BRIDGE],
                [*pip, "-c", constraints, "-r", BRIDGE_REQUIREMENTS],
            ]
            steps["download-rl"] = [
                # Two of what the stacks need come as sources only (antlr4-python3-runtime,
                # func_timeout): their build backend must be there too for an offline install.
                [*pip, "--no-deps", VERL, SKYRL, "setuptools", "wheel"],
                [*pip, "-c", constraints, "-r", RL_REQUIREMENTS],
            ]
        with open(os.path.join(WHEELS_312, "download.log"), "w") as log:
            for name, commands in steps.items():
                all(run(name, log, cmd) for cmd in commands)
                _jobs[name][0].set()

    def builds() -> None:
        with open(BUILD_LOG_312, "w") as log:
            downloaded = _done("download-3.12")
            ok = run("world-3.12", log, [python, "-m", "venv", "--clear", WORLD_312])
            if ok and downloaded:
                cmd = [_python(WORLD_312), "-m", "pip", "install", "-q", TORCH]
                ok = run("world-3.12", log, cmd, local)
            if ok:
                cmd = [_python(WORLD_312), "-m", "pip", "install", "-q", "--find-links",
                       WHEELS_312, *pins, "-e", ".[test]", *MEGATRON_LM_DEPS["3.12"]]  # fmt: skip
                ok = run("world-3.12", log, cmd)
            _jobs["world-3.12"][0].set()
            downloaded = _done("download-bridge")
            if ok and bridge:
                ok = run("bridge-3.12", log, [python, "-m", "venv", "--clear", BRIDGE_312])
            if ok and bridge:
                _layer(BRIDGE_312, WORLD_312)
                cmd = ["bash", os.path.join(".ci", "install_bridge.sh"), _python(BRIDGE_312)]
                ok = run("bridge-3.12", log, cmd, local if downloaded else None)
            if not (ok and bridge):
                _jobs["bridge-3.12"][1].append(1)
            _jobs["bridge-3.12"][0].set()
            world_ok = _done("world-3.12")
            downloaded = _done("download-rl")
            ok = (
                world_ok
                and bridge
                and run("rl-3.12", log, [python, "-m", "venv", "--clear", RL_312])
            )
            if ok:
                _layer(RL_312, WORLD_312)
                rl_pip = [_python(RL_312), "-m", "pip", "install", "-q", "--find-links", WHEELS_312]
                env = local if downloaded else None
                ok = run("rl-3.12", log, [*rl_pip, "--no-deps", VERL, SKYRL], env) and run(
                    "rl-3.12", log, [*rl_pip, "-c", constraints, "-r", RL_REQUIREMENTS], env
                )
            if not ok:
                _jobs["rl-3.12"][1].append(1)
            _jobs["rl-3.12"][0].set()

    for target in (downloads, builds):
        threading.Thread(target=target, daemon=True).start()
    atexit.register(lambda: [p.terminate() for p in _job_procs if p.poll() is None])
    then = (
        f", then Megatron Bridge over it in {BRIDGE_312} and verl and SkyRL in {RL_312}"
        if bridge
        else ""
    )
    session.log(
        f"building the 3.12 world in the background: {WORLD_312}{then}, from wheels downloaded "
        f"into {WHEELS_312} (log: {BUILD_LOG_312})"
    )


def _site_packages(venv: str) -> str:
    return os.path.abspath(glob.glob(os.path.join(venv, "lib", "python3.*", "site-packages"))[0])


def _layer(upper: str, lower: str) -> None:
    """Make virtualenv ``upper`` see ``lower``'s packages after its own (``site.addsitedir``
    also reads ``lower``'s ``.pth`` files, the editable install of this project's among them).
    pip in ``upper`` installs there only: it leaves what it finds outside alone."""
    line = f"import site; site.addsitedir({_site_packages(lower)!r})\n"
    with open(os.path.join(_site_packages(upper), "_layer_over_world.pth"), "w") as f:
        f.write(line)


def _done(name: str) -> bool:
    """Wait for the background job ``name``; whether every command of it exited 0."""
    done, status = _jobs[name]
    done.wait()
    return bool(status) and not any(status)


def _built(session: nox.Session, name: str, venv: str) -> str:
    """Wait for the background build ``name`` of ``venv``; its folder, or an error."""
    if not _jobs[name][0].is_set():
        session.log(f"waiting for the background build of {venv}")
    if not _done(name):
        with open(BUILD_LOG_312) as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"building {venv} failed (log: {BUILD_LOG_312}):\n{tail}")
    return venv


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
    if python == "3.12" and glob.glob(os.path.join(WHEELS_312, "torch-*.whl")):
        session.install("--no-index", "--find-links", WHEELS_312, TORCH)
    session.install(TORCH, megatron_core, "-e", ".[test]", *MEGATRON_LM_DEPS[python])


#: One pytest: the virtualenv it runs in (a callable: it may wait for a background build, and
#: raises when that failed) and its arguments.
Run = tuple[Callable[[], str], Sequence[str]]


def _streams(venv: Callable[[], str], selection: Sequence[str], beside: Sequence[str]) -> list:
    """``selection`` as two streams of one pytest each: what lies in the files ``beside``, and
    the rest (``tests``: the whole folder but those files)."""
    if list(selection) == ["tests"]:
        return [[(venv, ["tests", *(f"--ignore={p}" for p in beside)])], [(venv, list(beside))]]
    second = [t for t in selection if t.split("::")[0] in beside]
    first = [t for t in selection if t not in second]
    return [[(venv, group)] for group in (first, second) if group]


def _pytest(session: nox.Session, streams: list[list[Run]]) -> None:
    """Run the pytests of each stream one after the other, the streams side by side: the
    first's output streams, the others' follows it. Fails when any fails, and when no test ran
    (pytest alone exits 0 when every selected test skipped); logs each pytest's time."""
    tmp = session.create_tmp()
    base_env = {k: v for k, v in {**os.environ, **session.env}.items() if v is not None}
    runs = [run for stream in streams for run in stream]
    status: dict[int, int] = {}
    running: list[subprocess.Popen] = []

    def one(i: int, run: Run, out) -> None:
        try:
            venv = run[0]()
        except RuntimeError as err:
            print(err, file=out or sys.stdout, flush=True)
            status[i] = 1
            return
        cmd = [
            _python(venv), "-m", "pytest", "-q", "-rs", "--durations=15",
            f"--junitxml={os.path.join(tmp, f'junit-{i}.xml')}",
            f"--basetemp={os.path.join(tmp, f'pytest-{i}')}", *run[1],
        ]  # fmt: skip
        env = {**base_env, "VIRTUAL_ENV": os.path.abspath(venv)}
        env["PATH"] = os.path.join(os.path.abspath(venv), "bin") + os.pathsep + os.environ["PATH"]
        start = time.monotonic()
        session.log(" ".join(cmd[1:]) + (f" (output: {out.name})" if out else ""))
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        running.append(proc)
        status[i] = proc.wait()
        session.log(f"{' '.join(run[1])[:100]}: {time.monotonic() - start:.0f} s")

    def stream(first: int, runs: list[Run], log: str | None) -> None:
        with open(log, "w") if log else contextlib.nullcontext() as out:
            for k, run in enumerate(runs):
                one(first + k, run, out)

    threads, logs = [], []
    first = len(streams[0])
    for n, runs_n in enumerate(streams[1:], start=1):
        logs.append(os.path.join(tmp, f"stream-{n}.log"))
        thread = threading.Thread(target=stream, args=(first, runs_n, logs[-1]), daemon=True)
        thread.start()
        threads.append(thread)
        first += len(runs_n)
    try:
        stream(0, streams[0], None)
        for thread in threads:
            thread.join()
    finally:  # interrupted: take the other pytests down with the first
        atexit.register(lambda: [p.kill() for p in running if p.poll() is None])
    for log in logs:
        with open(log) as out:
            print(out.read(), flush=True)
    ran = 0
    for i in range(len(runs)):
        report = os.path.join(tmp, f"junit-{i}.xml")
        if os.path.exists(report):
            for suite in ElementTree.parse(report).getroot().iter("testsuite"):
                ran += int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    failed = [status.get(i, 1) for i in range(len(runs))]
    if any(failed):
        session.error(f"pytest failed (exit status {', '.join(map(str, failed))})")
    if ran == 0:
        session.error("no test ran")


@nox.session(python="3.12", download_python="never")
def lint(session: nox.Session) -> None:
    """ruff, as pyproject.toml says."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(name="tests-3.11", python="3.11", download_python="never")
def tests_311(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.16.1 (Megatron-LM core_v0.16.1)."""
    _install(session, "3.11")
    if "tests-3.12" in _selected():  # after this install, not beside it: both fetch and unpack
        _start_312(session)
    venv = session.virtualenv.location
    if session.posargs:
        _pytest(session, [[(lambda: venv, session.posargs)]])
    else:
        _pytest(session, _streams(lambda: venv, RELEASE_TESTS, BESIDE_RELEASE))


@nox.session(name="tests-3.12", python=False)
def tests_312(session: nox.Session) -> None:
    """Whole suite on megatron-core 0.19.2 but ``BY_HAND``, and Megatron Bridge's tests beside
    it.

    Its virtualenvs are ``WORLD_312`` and ``BRIDGE_312`` (built by ``_start_312``, in the
    background from ``tests-3.11`` when both run), not one of nox's."""
    if shutil.which("python3.12") is None:
        session.error("tests-3.12 needs python3.12 on PATH")
    _start_312(session, bridge=not session.posargs)
    try:
        world = _built(session, "world-3.12", WORLD_312)
    except RuntimeError as err:
        session.error(str(err))
    if session.posargs:
        _pytest(session, [[(lambda: world, session.posargs)]])
        return
    # Megatron Bridge in its own layer: Bridge 0.6 pins the 0.19 line, and the
    # nvidia-resiliency-ext it brings breaks a plain `import megatron.core` (the plugin's Bridge
    # CPU shims hide it). Its tests follow the files beside the suite: both streams end together.
    main, beside = _streams(lambda: world, ["tests"], BESIDE_SUITE)
    main[0][1].extend(f"--ignore={path}" for path in RL_TESTS)
    by_hand = [f"--deselect={test}" for test in BY_HAND]
    main[0][1].extend(by_hand)
    # verl's and SkyRL's stack audits, all tiers, where both are installed: after the suite, so
    # that their layer is built by then and both streams end about together.
    main.append((lambda: _built(session, "rl-3.12", RL_312), list(RL_TESTS)))
    bridge_tests = ["-m", "e2e", *by_hand, BRIDGE_TESTS]
    bridge = (lambda: _built(session, "bridge-3.12", BRIDGE_312), bridge_tests)
    _pytest(session, [main, [*beside, bridge]])


@nox.session(name="older-3.12", python="3.12", download_python="never", default=False)
def older_312(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.17.1 and 0.18.2 (their Megatron-LM tags)."""
    _install(session, "3.12", OLDER_312[0])
    venv = session.virtualenv.location
    for release in OLDER_312:
        session.install(f"megatron-core=={release}")
        if session.posargs:
            _pytest(session, [[(lambda: venv, session.posargs)]])
        else:
            _pytest(session, _streams(lambda: venv, RELEASE_TESTS, BESIDE_RELEASE))
