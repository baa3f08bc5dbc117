"""The pages' install lines, run as printed (``noxfile.py`` lists the pages): each in a fresh
copy of this tree, ``.nox/page-<stack>``, where it makes the page's own virtualenv
(``.venv-<stack>``) that the page's tests then run with; and the files those virtualenvs
share, kept once on the disk (``SHARE_FILES``). Likewise the quick start's environment: the
README's install line and getting started's unit-tier line, in a fresh clone
(``quick_start_step``). A line is read from its page as the page tests read it
(``helpers.doc_pages``, on the path ``noxfile.py`` sets), never retyped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import TYPE_CHECKING

from helpers import doc_pages
from nox_background import Step
from nox_worlds import extra

if TYPE_CHECKING:  # nox only for the types: the tests import this module without it
    import nox


def page_lines(pages: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``(page, stack, line)`` of each of ``pages`` whose install line can run here: one that
    names an unset variable (``"$SLIME_SOURCE"``) is left out, saying so, except under CI
    (``CI`` set), where that stops the run: CI runs every page's line."""
    out = []
    for page in pages:
        stack, line = doc_pages.install_line(page)
        unset = [name for name in re.findall(r"\$\{?(\w+)", line) if not os.environ.get(name)]
        if unset:
            needs = f"nox > {page}: its install line needs {', '.join(unset)}"
            # tests/helpers/inputs.in_ci's rule; that module needs pytest, nox's venv has none
            if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
                raise SystemExit(f"{needs}; CI runs every page's line (.ci/run sets it)")
            print(f"{needs}; its stack's tests are left out (they skip)")
            continue
        out.append((page, stack, line))
    return out


def page_tree(stack: str) -> str:
    """``.nox/page-<stack>``: where the stack's page line runs, a copy of this tree."""
    return os.path.abspath(os.path.join(".nox", f"page-{stack}"))


def copy_tree(dest: str) -> None:
    """A fresh copy of this tree at ``dest``: the files a clone has (git's tracked and
    not-ignored ones), without what earlier runs built (``.nox``, virtualenvs, egg-info)."""
    shutil.rmtree(dest, ignore_errors=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        if os.path.isfile(name):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(name, os.path.join(dest, name))


def fresh_clone(dest: str) -> None:
    """``copy_tree``, committed in a git repository of its own, as a fresh clone is: the tests
    that ask git what it ignores ask the copy's own repository."""
    copy_tree(dest)
    git = ("git", "-c", "user.name=nox", "-c", "user.email=nox@localhost")
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "-m", "fresh clone")):
        subprocess.run([*git, *args], cwd=dest, capture_output=True, check=True)


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


def page_step(stack: str, line: str) -> Step:
    """The ``ahead`` step that runs the page's install line, as printed, in a fresh copy of
    the tree (it makes ``.venv-<stack>`` there), then installs the test tools into that
    virtualenv and shares its files with those before it (``SHARE_FILES``). pip compiles no
    bytecode (``PIP_NO_COMPILE``, as for the worlds): what is installed is the same."""
    tree = page_tree(stack)
    copy_tree(tree)
    pip = (os.path.join(".venv-" + stack, "bin", "pip"), "install", "-q", "--no-compile")
    tools = [r for r in extra("test") if r.startswith("pytest")]
    return f"page-{stack}", [
        ("cd", tree), ("export", "PIP_NO_COMPILE=1", f"NOX_DIR={os.path.dirname(tree)}"),
        ("bash", "-c", line), (*pip, *tools), ("bash", "-c", SHARE_FILES),
    ]  # fmt: skip


def run_page_tests(session: nox.Session, stack: str, *args: str) -> None:
    """pytest with ``args``, with the Python of the virtualenv the stack's page line made, in
    that copy of the tree."""
    tree = page_tree(stack)
    python = os.path.join(tree, f".venv-{stack}", "bin", "python")
    with session.chdir(tree):
        session.run(python, "-m", "pytest", *args, external=True)


def quick_start_tree(python: str) -> str:
    """``.nox/quick-start-<python>``: where the quick start's environment is made, a fresh
    clone of this tree (its virtualenv: ``.venv`` there)."""
    return os.path.abspath(os.path.join(".nox", f"quick-start-{python}"))


def quick_start_step(python: str, requirements: tuple[str, ...]) -> Step:
    """The ``ahead`` step that makes the quick start's environment as a reader with Python
    ``python`` makes it, in a fresh clone (``quick_start_tree``): the README's install line
    (``doc_pages.quick_start_install``), then getting started's unit-tier line
    (``doc_pages.unit_tier_line``), each as printed, with ``python<python>`` as the lines'
    ``python3``; the unit tier must pass there. Then it adds ``requirements`` to that ``.venv``
    (what the release's tests need beyond). pip compiles no bytecode (``PIP_NO_COMPILE``)."""
    tree = quick_start_tree(python)
    fresh_clone(tree)
    # A virtualenv without pip whose python3 is python<python>: first on PATH, it is the
    # lines' python3 (the virtualenv they make is python<python>'s own, not one inside it).
    python3 = os.path.join(os.path.dirname(tree), f"python3-is-{python}")
    pip = (os.path.join(".venv", "bin", "python"), "-m", "pip", "install", "-q", "--no-compile")
    path = os.pathsep.join([os.path.join(python3, "bin"), os.environ["PATH"]])
    return f"quick-start-{python}", [
        (f"python{python}", "-m", "venv", "--clear", "--without-pip", python3),
        ("cd", tree), ("export", "PIP_NO_COMPILE=1", f"PATH={path}"),
        ("bash", "-c", doc_pages.quick_start_install()),
        ("bash", "-c", doc_pages.unit_tier_line()),
        (*pip, *requirements),
    ]  # fmt: skip


def run_quick_start_tests(session: nox.Session, python: str, *args: str) -> None:
    """pytest with ``args``, with the Python of the quick start's ``.venv`` (its console
    scripts first on PATH), in that fresh clone."""
    tree = quick_start_tree(python)
    bin_dir = os.path.join(tree, ".venv", "bin")
    path = session.env.get("PATH", os.environ["PATH"])
    session.env["PATH"] = os.pathsep.join([bin_dir, path])
    with session.chdir(tree):
        session.run(os.path.join(bin_dir, "python"), "-m", "pytest", *args, external=True)
