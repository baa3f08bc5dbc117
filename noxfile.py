"""The test worlds, each built from scratch. The README's test command runs the default ones:

    python3 -m venv .ci-venv && .ci-venv/bin/pip install -q nox && .ci-venv/bin/nox

(that is what CI runs); ``nox -s tests-3.11`` runs one, and arguments after ``--`` replace
pytest's selection (``-- tests/test_args.py``, ``-- -m unit``; in ``tests-3.11``, the one
after the printed unit tier).

* ``lint``: ``ruff check``, ``ruff format --check`` and the strict build of the documentation
  site (``mkdocs build --strict``: a broken link, anchor or public docstring fails it).
* ``tests-3.11``: Python 3.11 with megatron-core 0.16.1 (the last release for 3.11), in the
  quick start's environment, made in a fresh clone as a reader makes it: the README's install
  line, then getting started's unit-tier line, both read from the pages and run as printed
  (the unit tier must pass there: ``quick_start_step``); then, with what Megatron-LM's code
  needs added, what depends on the release (``RELEASE_TESTS``).
* ``tests-3.12``: Python 3.12 with megatron-core 0.19.2 runs the whole suite; then Megatron
  Bridge's tests (in a virtualenv layered over the suite's, ``layer``) and each stack's (verl,
  SkyRL, slime, AReaL, ROLL, ms-swift, NeMo-RL: ``STACK_PAGES``) and the commands of
  docs/megatron_lm_rl.md (``PAGE_TESTS``), each in the fresh virtualenv its page's install line
  makes, run as the page prints it (``page_step``; slime's from the source ``SLIME_SOURCE`` names,
  ROLL's from ``ROLL_SOURCE``, NeMo-RL's from ``NEMO_RL_SOURCE``, ``MEGATRON_BRIDGE_SOURCE`` and
  ``MEGATRON_LM_SOURCE``, which ``.ci/run`` sets: none is on the package index; without them
  their tests skip, and under CI the run stops).

* ``stacks`` (not by default): the stack pages' part of ``tests-3.12``, alone.
* ``older-3.12`` (not by default): megatron-core 0.17.1, then 0.18.2, ``RELEASE_TESTS``.

In the default run (``nox`` alone, as CI runs it) the installs happen beside other work
(``ahead``): pip waits mostly on the network and the disk, so ``lint`` starts them before its
own checks (the 3.12 world's goes on during the 3.11 tests, the stack pages' during the suite),
and Bridge's layer installs during the suite. The 3.11 world installs, and runs the unit
tier, on its own. The 3.12 world and the pages' lines each bring torch's CUDA build (5 to 8 GB
installed): they install one after another. The pages' lines install through uv, which unpacks
a wheel once into its cache and links it into each virtualenv after (pip unpacked torch anew
for each, 2-3 minutes of CPU each beside the tests), and each page's virtualenv shares the
files it has in common with those before it (``SHARE_FILES``), so that the run needs about
25 GB of disk (docs/development.md).

Each world installs ``torch==2.13.0`` as a plain requirement (pip takes what its configuration
offers for that Python: from PyPI alone the CUDA build, which runs on CPU too), the pinned
megatron-core, this project with its test extras and what Megatron-LM's training scripts import
(the 3.11 world adds them to what the pages' lines installed). pytest runs on CPU/gloo with
one worker per core of CI's two (pytest-xdist); a test file stays on one worker, so that its
tests share their launches. The Megatron-LM tests read Megatron-LM's sources from the
archives that ``MEGATRON_LM_ARCHIVES`` names (``.ci/run`` sets it).

This file is the table of what runs where; how it runs is in ``.ci/``, beside it:
``nox_background.py`` (steps run beside a session: ``ahead``, ``collect``), ``nox_worlds.py``
(the worlds' virtualenvs: ``setup.py``'s requirements, a world installed ahead, ``layer``) and
``nox_pages.py`` (the pages' install lines in fresh copies of the tree, ``SHARE_FILES``).
"""

from __future__ import annotations

import os
import shutil
import sys

import nox

# The machinery beside this table (.ci/nox_*.py), and the pages' commands as the tests read them.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, ".ci"), os.path.join(_HERE, "tests")]
from helpers import doc_pages  # noqa: E402
from nox_background import Step, ahead, collect, started  # noqa: E402
from nox_pages import (  # noqa: E402
    page_lines,
    page_step,
    page_tree,
    quick_start_step,
    quick_start_tree,
    run_page_tests,
    run_quick_start_tests,
)
from nox_worlds import (  # noqa: E402
    expose_pyenv_versions,
    extra,
    install,
    layer,
    setup_kwarg,
    world_step,
)

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
#: Megatron Bridge cannot share the suite's virtualenv (it brings an nvidia-resiliency-ext that
#: breaks a plain ``import megatron.core``): it gets a virtualenv layered over the suite's.
BRIDGE_TESTS = ("-m", "e2e", "tests/test_bridge.py")
#: The RL stacks' pages. Each has one install line that makes the stack's own virtualenv
#: (``python3.12 -m venv .venv-<stack> && ...``, read from the page by ``doc_pages.install_line``
#: as the page tests read it); CI runs it as printed, in a fresh copy of this tree, and there
#: runs ``tests/test_<stack>_stack.py`` and the pages' stack commands with that virtualenv's
#: Python. A page whose line names a variable that is not set (slime's ``SLIME_SOURCE``) is
#: left out, saying so. A new stack is one more page here.
STACK_PAGES = (
    "docs/verl.md",
    "docs/skyrl.md",
    "docs/slime.md",
    "docs/areal.md",
    "docs/roll.md",
    "docs/ms_swift.md",
    "docs/nemo_rl.md",
)
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


expose_pyenv_versions(LATEST)

#: Whether this is the default run (no session named), in which ``lint`` comes first and may
#: start the test worlds' installs ahead.
DEFAULT_RUN = not any(
    arg.startswith(("-s", "--session", "-e", "-k", "-t", "--tag")) for arg in sys.argv[1:]
)


def _requirements(python: str, release: str | None = None) -> tuple[str, ...]:
    """What a world installs besides this project: what the project's ``[test]`` and
    ``[megatron-lm]`` installs would bring (read from ``setup.py``), pinned. The project
    itself is installed by the 3.12 sessions, not ahead: two editable builds of this tree at
    once would share its egg-info (the 3.11 world's lines install it in their own clone)."""
    extras = ("triton", "transformers") if python == "3.11" else ()
    core = f"megatron-core=={release or LATEST[python]}"
    needs = (*setup_kwarg("install_requires"), *extra("test"))
    return TORCH, core, *needs, *extra("megatron-lm"), *UPSTREAM_TEST_DEPS, *extras


def _install(session: nox.Session, release: str | None = None) -> None:
    """This world's packages and the project with its test extras (the world's, when ``lint``
    started them ahead)."""
    install(session, *_requirements(session.python, release), "-e", ".[test]")


def _pytest(session: nox.Session, *selection: str, python: str = "python") -> None:
    args = ("-m", "pytest", *PYTEST, *(session.posargs or selection))
    session.run(python, *args, external=python != "python")


def _stack_pages() -> list[tuple[str, str, str]]:
    """``(page, stack, line)`` of each page of ``STACK_PAGES`` and ``PAGE_TESTS`` whose install
    line can run here."""
    return page_lines((*STACK_PAGES, *PAGE_TESTS))


def _page_steps() -> list[Step]:
    """The ``ahead`` step of each page that ``_stack_pages`` gives."""
    return [page_step(stack, line) for _, stack, line in _stack_pages()]


def _stack_test_file(stack: str) -> str:
    """``tests/test_<stack>_stack.py``, a hyphen of the stack's name an underscore there
    (``ms-swift``: ``tests/test_ms_swift_stack.py``)."""
    return f"tests/test_{stack.replace('-', '_')}_stack.py"


def _stack_tests(session: nox.Session, page: str, stack: str) -> None:
    """The stack's tests and the pages' stack commands (or the page's ``PAGE_TESTS``), with the
    Python of the virtualenv its page's line made, in that copy of the tree."""
    tests = PAGE_TESTS.get(page) or [
        t for t in (_stack_test_file(stack), *STACK_COMMANDS_TESTS)
        if os.path.isfile(os.path.join(page_tree(stack), t))
    ]  # fmt: skip
    run_page_tests(session, stack, *PYTEST, *tests)


@nox.session(python="3.12", download_python="never")
def lint(session: nox.Session) -> None:
    """ruff, as pyproject.toml says; the documentation site's strict build (the [docs] extra).
    In the default run it comes first, and starts both test worlds' installs beside it."""
    if DEFAULT_RUN:
        ahead(session, quick_start_step("3.11", _requirements("3.11")))
        ahead(session, world_step("3.12", _requirements("3.12")), *_page_steps())
    session.install(RUFF, *extra("docs"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    site = os.path.join(session.create_tmp(), "site")
    session.run("mkdocs", "build", "--strict", "--quiet", "--site-dir", site,
                env={"NO_MKDOCS_2_WARNING": "1"})  # fmt: skip


@nox.session(name="tests-3.11", python="3.11", download_python="never")
def tests_311(session: nox.Session) -> None:
    """The quick start's environment on Python 3.11 (megatron-core 0.16.1), made as the README
    prints it, where getting started's unit tier runs as printed; then what depends on the
    release there (Megatron-LM core_v0.16.1)."""
    if not collect(session, "quick-start-3.11"):  # not started ahead: this session alone
        ahead(session, quick_start_step("3.11", _requirements("3.11")))
        collect(session, "quick-start-3.11")
    run_quick_start_tests(session, "3.11", *PYTEST, *(session.posargs or RELEASE_TESTS))
    if DEFAULT_RUN:  # nothing later uses the world: its 2.3 GB go before the 3.12 suite runs
        shutil.rmtree(quick_start_tree("3.11"))


@nox.session(name="tests-3.12", python="3.12", download_python="never")
def tests_312(session: nox.Session) -> None:
    """The whole suite on megatron-core 0.19.2, then Bridge's tests and each stack's, in the
    virtualenv its page's install line makes."""
    _install(session)
    stacks = [] if session.posargs else _stack_pages()
    if not session.posargs:
        bridge = layer(session, "bridge-3.12")
        ahead(session, ("bridge-3.12", [(bridge, "-m", "megatron_lossfix", "install-bridge")]))
        if not started("page-"):  # this session alone
            ahead(session, *_page_steps())
    stack_tests = [_stack_test_file(doc_pages.install_line(page)[0]) for page in STACK_PAGES]
    ignore = [t for t in (*stack_tests, *STACK_COMMANDS_TESTS) if os.path.isfile(t)]
    elsewhere = [t for page, _, _ in stacks for t in PAGE_TESTS.get(page, ())]
    _pytest(session, "tests", *(f"--ignore={test}" for test in ignore),
            *(f"--deselect={test}" for test in elsewhere))  # fmt: skip
    if session.posargs:
        return
    collect(session, "bridge-3.12")
    # Side by side: Bridge's tests are one file (one worker); the stacks' keep the other busy.
    ahead(session, ("bridge-tests", [(bridge, "-m", "pytest", *PYTEST, *BRIDGE_TESTS)]))
    try:
        for page, stack, _ in stacks:
            collect(session, f"page-{stack}")
            _stack_tests(session, page, stack)
    finally:
        collect(session, "bridge-tests")


@nox.session(python=False, default=False)
def stacks(session: nox.Session) -> None:
    """What ``tests-3.12`` does for the stacks after the suite, alone: each stack page's install
    line, as printed, in a fresh virtualenv of its own, then the stack's tests there."""
    pages = _stack_pages()
    ahead(session, *_page_steps())
    for page, stack, _ in pages:
        collect(session, f"page-{stack}")
        _stack_tests(session, page, stack)


@nox.session(name="older-3.12", python="3.12", download_python="never", default=False)
def older_312(session: nox.Session) -> None:
    """What depends on the release, on megatron-core 0.17.1 and 0.18.2 (their Megatron-LM tags)."""
    for release in OLDER_312:
        _install(session, release)
        _pytest(session, *RELEASE_TESTS)
