"""The test worlds, each built from scratch. The README's test command runs the default ones:

    python3 -m venv .ci-venv && .ci-venv/bin/pip install -q nox && .ci-venv/bin/nox

(that is what CI runs); ``nox -s tests-3.11`` runs one, and arguments after ``--`` replace
pytest's selection (``-- tests/test_args.py``, ``-- -m unit``).

* ``lint``: ``ruff check``, ``ruff format --check`` and the strict build of the documentation
  site (``mkdocs build --strict``: a broken link, anchor or public docstring fails it).
* ``tests-3.11``: Python 3.11 with megatron-core 0.16.1 (the last release for 3.11) runs what
  depends on the release (``RELEASE_TESTS``).
* ``tests-3.12``: Python 3.12 with megatron-core 0.19.2 runs the whole suite; then Megatron
  Bridge's tests (in a virtualenv layered over the suite's, ``_layer``) and each stack's (verl,
  SkyRL, slime, AReaL: ``STACK_PAGES``) and the commands of docs/megatron_lm_rl.md
  (``PAGE_TESTS``), each in the fresh virtualenv its page's install line makes, run as the
  page prints it (``_stack_ahead``; slime's from the source ``SLIME_SOURCE`` names,
  which ``.ci/run`` sets: slime is not on the package index, and without it its tests skip).

* ``older-3.12`` (not by default): megatron-core 0.17.1, then 0.18.2, ``RELEASE_TESTS``.

In the default run (``nox`` alone, as CI runs it) the installs happen beside other work
(``_ahead``): pip waits mostly on the network and the disk, so ``lint`` starts them before its
own checks (the 3.12 world's goes on during the 3.11 tests, the stack pages' during the suite),
and Bridge's layer installs during the suite. The 3.11 world installs on its own. The 3.12
world and the pages' lines each bring torch's CUDA build (5 to 8 GB installed): they install
one after another, each page's virtualenv sharing the files it has in common with those before
it (``SHARE_FILES``), so that the run needs about 25 GB of disk (docs/development.md).

Each world installs ``torch==2.13.0`` as a plain requirement (pip takes what its configuration
offers for that Python: from PyPI alone the CUDA build, which runs on CPU too), the pinned
megatron-core, this project with its test extras and what Megatron-LM's training scripts import.
pytest runs on CPU/gloo with one worker per core of CI's two (pytest-xdist); a test file stays
on one worker, so that its tests share their launches. The Megatron-LM tests read Megatron-LM's
sources from the archives that ``MEGATRON_LM_ARCHIVES`` names (``.ci/run`` sets it).
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import nox

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
from helpers import doc_pages  # noqa: E402 (the pages' commands, as the tests read them)

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
#: over the layout matrix, MTP, the examples under DP2, PP2, MTP and MoE (each builds its model
#: through the release's API), and Megatron-LM's own code at the release's tag (its patched
#: ``pretrain_gpt.py`` dense, MoE and resized, and its pipeline-schedule tests).
RELEASE_TESTS = (
    "tests/test_megatron_averaging.py",
    "tests/test_invariance.py",
    "tests/test_hard_layouts.py",
    "tests/test_mtp.py",
    "tests/test_examples.py::test_pretrain_gpt_layouts_agree[token_mean]",
    "tests/test_examples.py::test_pretrain_gpt_mtp_moe_layouts_agree[sequence_mean]",
    "tests/test_grpo_example.py::test_ppo_rollouts_pp2_and_moe_layouts_agree",
    "tests/test_own_loop.py::test_one_rank_and_dp2_agree",
    "tests/test_megatron_lm.py::test_patched_pretrain_gpt_is_layout_invariant",
    "tests/test_megatron_lm_moe.py",
    "tests/test_megatron_lm_resize.py",
    "tests/test_megatron_lm_rl.py::test_train_rl_plugin_is_layout_invariant",
    "tests/test_megatron_lm_rl.py::test_train_rl_stock_moves_with_the_padding",
    "tests/test_megatron_lm_rl.py::test_train_rl_modes_mean_what_they_say",
    "tests/test_megatron_lm_rl.py::test_train_rl_refuses_a_multi_turn_step_before_core_v0_19",
    "tests/test_upstream_schedules.py",
)
#: What Megatron-Core's own schedule tests import beyond pytest (tests/test_upstream_schedules.py);
#: what Megatron-LM's training scripts import is the ``[megatron-lm]`` extra of ``setup.py``.
#: triton comes with torch's CUDA build but not with the CPU wheel, and at core_v0.16.1
#: ``train_rl.py``'s chat templates import transformers (``_requirements`` adds both on 3.11).
UPSTREAM_TEST_DEPS = ("pytest-mock",)
#: pytest's options in every world: two workers, a file's tests on one, handed out in the
#: order tests/conftest.py gives (whole programs first), the slowest tests listed, and a run in
#: which every test skipped (a missing dependency) fails.
PYTEST = ("-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "-q", "-rs",
          "--durations=20", "--fail-if-none-ran")  # fmt: skip
#: pip compiles every module it installs to bytecode (12,000 files a world); the tests import a
#: fraction of them, which Python compiles on first import. The 3.11 world installed in 40 s
#: with this, 117 s without.
NO_COMPILE = ("--no-compile",)
#: Megatron Bridge cannot share the suite's virtualenv (it brings an nvidia-resiliency-ext that
#: breaks a plain ``import megatron.core``): it gets a virtualenv layered over the suite's.
BRIDGE_TESTS = ("-m", "e2e", "tests/test_bridge.py")
#: The RL stacks' pages. Each has one install line that makes the stack's own virtualenv
#: (``python3.12 -m venv .venv-<stack> && ...``, read from the page by ``doc_pages.install_line``
#: as the page tests read it); CI runs it as printed, in a fresh copy of this tree, and there
#: runs ``tests/test_<stack>_stack.py`` and the pages' stack commands with that virtualenv's
#: Python. A page whose line names a variable that is not set (slime's ``SLIME_SOURCE``) is
#: left out, saying so. A new stack is one more page here.
STACK_PAGES = ("docs/verl.md", "docs/skyrl.md", "docs/slime.md", "docs/areal.md")
#: Pages besides the stacks' whose commands need an environment of their own: each has one
#: install line (``python3.12 -m venv .venv-<name> && ...``) that CI runs as printed, as a stack
#: page's, and there runs these tests with that virtualenv's Python (the suite leaves them out).
PAGE_TESTS = {
    "docs/megatron_lm_rl.md": (
        "tests/test_megatron_lm_rl.py::test_doc_cpu_command_runs_as_printed",
    ),
}
#: The pages' stack commands, run in each stack's virtualenv (another stack's skip there).
STACK_COMMANDS_TESTS = ("tests/test_readme_stacks.py",)


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


#: Whether this is the default run (no session named), in which ``lint`` comes first and may
#: start the test worlds' installs ahead.
DEFAULT_RUN = not any(
    arg.startswith(("-s", "--session", "-e", "-k", "-t", "--tag")) for arg in sys.argv[1:]
)
#: Steps started by ``_ahead`` and not yet collected: name -> (process, log, status file).
_AHEAD: dict[str, tuple[subprocess.Popen, str, str]] = {}
_SITE = "import site; print(site.getsitepackages()[0])"


def _requirements(python: str, release: str | None = None) -> tuple[str, ...]:
    """What a world installs besides this project: what the project's ``[test]`` and
    ``[megatron-lm]`` installs would bring (read from ``setup.py``), pinned. The project
    itself is installed by each session, not ahead: two editable builds at once (both worlds'
    installs start together) would share its egg-info."""
    extra = ("triton", "transformers") if python == "3.11" else ()
    core = f"megatron-core=={release or LATEST[python]}"
    needs = (*_setup_kwarg("install_requires"), *_extra("test"))
    return TORCH, core, *needs, *_extra("megatron-lm"), *UPSTREAM_TEST_DEPS, *extra


def _world(python: str) -> str:
    """The folder of the ``python`` world that an earlier session builds ahead."""
    return os.path.abspath(os.path.join(".nox", f"world-{python}"))


def _install(session: nox.Session, release: str | None = None) -> None:
    """This world's packages; when ``lint`` started them ahead (``.nox/world-<python>``), this
    session's virtualenv sees those (as a ``_layer`` does) and pip finds all but the project."""
    world = _world(session.python)
    if _collect(session, f"world-{session.python}"):
        _see(session, os.path.join(world, "bin", "python"), "python")
        # Its console scripts (torchrun, ...) too: nox puts this virtualenv's own before them.
        path = session.env.get("PATH", os.environ["PATH"])
        session.env["PATH"] = os.pathsep.join([os.path.join(world, "bin"), path])
    session.install(*NO_COMPILE, *_requirements(session.python, release), "-e", ".[test]")


def _pytest(session: nox.Session, *selection: str, python: str = "python") -> None:
    args = ("-m", "pytest", *PYTEST, *(session.posargs or selection))
    session.run(python, *args, external=python != "python")


def _layer(session: nox.Session, name: str) -> str:
    """A new virtualenv ``.nox/<name>`` that sees this session's packages after its own (a
    ``.pth`` file), so that torch and megatron-core are not installed again (about 80 s of CPU
    and 4.7 GB each); pip installs into it what it lacks. Returns its Python."""
    venv = os.path.abspath(os.path.join(".nox", name))
    session.run("python", "-m", "venv", "--clear", venv)
    python = os.path.join(venv, "bin", "python")
    _see(session, "python", python)
    return python


def _see(session: nox.Session, below: str, above: str) -> None:
    """Let the Python ``above`` import what the Python ``below`` has installed, after its own."""
    sites = [session.run(python, "-c", _SITE, silent=True, external=True).strip()
             for python in (below, above)]  # fmt: skip
    with open(os.path.join(sites[1], "_layer.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({sites[0]!r})\n")


def _ahead(session: nox.Session, *steps: tuple[str, list[tuple[str, ...]]]) -> None:
    """Run ``steps`` (``(name, commands)``) one after another in a process of their own (with
    the session's environment) while the session goes on; ``_collect(session, name)`` waits for
    the step ``name``. A step's commands run one after another, in a subshell (a ``cd`` stays
    in it), into the log ``.nox/<name>.log``; a step that fails leaves the next to run."""
    # nox marks a variable to unset with None (PYTHONHOME, ...).
    env = {k: v for k, v in {**os.environ, **session.env}.items() if v is not None}
    files = {name: _step_files(name) for name, _ in steps}
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


def _step_files(name: str) -> tuple[str, str]:
    """The log of ``_ahead``'s step ``name`` and the file its exit status goes to."""
    return tuple(os.path.abspath(os.path.join(".nox", name + ext)) for ext in (".log", ".status"))


def _collect(session: nox.Session, name: str) -> bool:
    """Wait for ``_ahead``'s step ``name`` and show its log; False when it was not started."""
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


def _setup_kwarg(name: str) -> object:
    """The value of ``setup.py``'s keyword argument ``name``, read without running it."""
    with open("setup.py", encoding="utf-8") as f:
        tree = ast.parse(f.read())
    value = next(
        kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
        for kw in node.keywords if kw.arg == name
    )  # fmt: skip
    return ast.literal_eval(value)


def _extra(name: str) -> list[str]:
    """The requirements of ``setup.py``'s extra ``name``, read without installing the project
    (the docs build reads the sources; it needs neither torch nor megatron-core)."""
    return _setup_kwarg("extras_require")[name]


def _world_step(python: str) -> tuple[str, list[tuple[str, ...]]]:
    """The ``_ahead`` step that installs the ``python`` world into ``.nox/world-<python>``
    (``_install`` uses it)."""
    world = _world(python)
    pip = (os.path.join(world, "bin", "python"), "-m", "pip", "install", "-q", *NO_COMPILE)
    return f"world-{python}", [(f"python{python}", "-m", "venv", "--clear", world),
                               (*pip, *_requirements(python))]  # fmt: skip


def _stack_pages() -> list[tuple[str, str, str]]:
    """``(page, stack, line)`` of each page of ``STACK_PAGES`` and ``PAGE_TESTS`` whose install
    line can run here: one that names an unset variable (``"$SLIME_SOURCE"``) is left out."""
    out = []
    for page in (*STACK_PAGES, *PAGE_TESTS):
        stack, line = doc_pages.install_line(page)
        unset = [name for name in re.findall(r"\$\{?(\w+)", line) if not os.environ.get(name)]
        if unset:
            print(f"nox > {page}: its install line needs {', '.join(unset)}; its stack's tests "
                  "are left out (they skip)")  # fmt: skip
            continue
        out.append((page, stack, line))
    return out


def _stack_tree(stack: str) -> str:
    """``.nox/page-<stack>``: where the stack's page line runs, a copy of this tree."""
    return os.path.abspath(os.path.join(".nox", f"page-{stack}"))


def _copy_tree(dest: str) -> None:
    """A fresh copy of this tree at ``dest``: the files a clone has (git's tracked and
    not-ignored ones), without what earlier runs built (``.nox``, virtualenvs, egg-info)."""
    shutil.rmtree(dest, ignore_errors=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        if os.path.isfile(name):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(name, os.path.join(dest, name))


#: Run after each page's install line: the files its virtualenv has in common with the 3.12
#: world's and the pages' before it (torch's CUDA build and its libraries: most of a page's 5
#: to 8 GB) become hard links to theirs, so that the disk holds them once, not six times.
#: util-linux's ``hardlink`` compares contents; ``-t``: whatever the times; ``-O``: the oldest
#: copy stays (by default the newest does, and the world's libraries that the running suite
#: has mapped would stay on the disk beside it until the suite ends: 6.8 GB more).
SHARE_FILES = r"""
venvs=()
for venv in "$NOX_DIR"/world-3.12 "$NOX_DIR"/page-*/.venv-*; do
    if [ -d "$venv" ]; then venvs+=("$venv"); fi
done
if command -v hardlink > /dev/null; then hardlink -t -O "${venvs[@]}"
else echo "hardlink (util-linux) not found: each page's virtualenv keeps its own files"; fi
"""


def _page_step(stack: str, line: str) -> tuple[str, list[tuple[str, ...]]]:
    """The ``_ahead`` step that runs the page's install line, as printed, in a fresh copy of
    the tree (it makes ``.venv-<stack>`` there), then installs the test tools into that
    virtualenv and shares its files with those before it (``SHARE_FILES``). pip compiles no
    bytecode (``PIP_NO_COMPILE``, as for the worlds): what is installed is the same."""
    tree = _stack_tree(stack)
    _copy_tree(tree)
    pip = (os.path.join(".venv-" + stack, "bin", "pip"), "install", "-q", "--no-compile")
    tools = [r for r in _extra("test") if r.startswith("pytest")]
    return f"page-{stack}", [
        ("cd", tree), ("export", "PIP_NO_COMPILE=1", f"NOX_DIR={os.path.dirname(tree)}"),
        ("bash", "-c", line), (*pip, *tools), ("bash", "-c", SHARE_FILES),
    ]  # fmt: skip


def _page_steps() -> list[tuple[str, list[tuple[str, ...]]]]:
    """``_page_step`` of each page that ``_stack_pages`` gives."""
    return [_page_step(stack, line) for _, stack, line in _stack_pages()]


def _stack_tests(session: nox.Session, page: str, stack: str) -> None:
    """The stack's tests and the pages' stack commands (or the page's ``PAGE_TESTS``), with the
    Python of the virtualenv its page's line made, in that copy of the tree."""
    tree = _stack_tree(stack)
    python = os.path.join(tree, f".venv-{stack}", "bin", "python")
    tests = PAGE_TESTS.get(page) or [
        t for t in (f"tests/test_{stack}_stack.py", *STACK_COMMANDS_TESTS)
        if os.path.isfile(os.path.join(tree, t))
    ]  # fmt: skip
    with session.chdir(tree):
        session.run(python, "-m", "pytest", *PYTEST, *tests, external=True)


@nox.session(python="3.12", download_python="never")
def lint(session: nox.Session) -> None:
    """ruff, as pyproject.toml says; the documentation site's strict build (the [docs] extra).
    In the default run it comes first, and starts both test worlds' installs beside it."""
    if DEFAULT_RUN:
        _ahead(session, _world_step("3.11"))
        _ahead(session, _world_step("3.12"), *_page_steps())
    session.install(RUFF, *_extra("docs"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    site = os.path.join(session.create_tmp(), "site")
    session.run("mkdocs", "build", "--strict", "--quiet", "--site-dir", site,
                env={"NO_MKDOCS_2_WARNING": "1"})  # fmt: skip


@nox.session(name="tests-3.11", python="3.11", download_python="never")
def tests_311(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.16.1 (Megatron-LM core_v0.16.1)."""
    _install(session)
    _pytest(session, *RELEASE_TESTS)
    if DEFAULT_RUN:  # nothing later uses the world: its 2.3 GB go before the 3.12 suite runs
        shutil.rmtree(_world(session.python))


@nox.session(name="tests-3.12", python="3.12", download_python="never")
def tests_312(session: nox.Session) -> None:
    """The whole suite on megatron-core 0.19.2, then Bridge's tests and each stack's, in the
    virtualenv its page's install line makes."""
    _install(session)
    stacks = [] if session.posargs else _stack_pages()
    if not session.posargs:
        bridge = _layer(session, "bridge-3.12")
        _ahead(session, ("bridge-3.12", [(bridge, "-m", "megatron_lossfix", "install-bridge")]))
        if not any(name.startswith("page-") for name in _AHEAD):  # this session alone
            _ahead(session, *_page_steps())
    stack_tests = [f"tests/test_{stack}_stack.py" for stack in
                   (doc_pages.install_line(page)[0] for page in STACK_PAGES)]  # fmt: skip
    ignore = [t for t in (*stack_tests, *STACK_COMMANDS_TESTS) if os.path.isfile(t)]
    elsewhere = [t for page, _, _ in stacks for t in PAGE_TESTS.get(page, ())]
    _pytest(session, "tests", *(f"--ignore={test}" for test in ignore),
            *(f"--deselect={test}" for test in elsewhere))  # fmt: skip
    if session.posargs:
        return
    _collect(session, "bridge-3.12")
    # Side by side: Bridge's tests are one file (one worker); the stacks' keep the other busy.
    _ahead(session, ("bridge-tests", [(bridge, "-m", "pytest", *PYTEST, *BRIDGE_TESTS)]))
    try:
        for page, stack, _ in stacks:
            _collect(session, f"page-{stack}")
            _stack_tests(session, page, stack)
    finally:
        _collect(session, "bridge-tests")


@nox.session(python=False, default=False)
def stacks(session: nox.Session) -> None:
    """What ``tests-3.12`` does for the stacks after the suite, alone: each stack page's install
    line, as printed, in a fresh virtualenv of its own, then the stack's tests there."""
    pages = _stack_pages()
    _ahead(session, *_page_steps())
    for page, stack, _ in pages:
        _collect(session, f"page-{stack}")
        _stack_tests(session, page, stack)


@nox.session(name="older-3.12", python="3.12", download_python="never", default=False)
def older_312(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.17.1 and 0.18.2 (their Megatron-LM tags)."""
    for release in OLDER_312:
        _install(session, release)
        _pytest(session, *RELEASE_TESTS)
