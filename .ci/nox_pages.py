"""The pages' install lines, run as printed (``noxfile.py`` lists the pages): each in a fresh
copy of this tree, ``.nox/page-<stack>``, where it makes the page's own virtualenv
(``.venv-<stack>``) that the page's tests then run with; and the files those virtualenvs
share, kept once on the disk (``SHARE_FILES``). A line is read from its page as the page tests
read it (``helpers.doc_pages``, on the path ``noxfile.py`` sets), never retyped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import nox
from helpers import doc_pages
from nox_background import Step
from nox_worlds import extra


def page_lines(pages: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``(page, stack, line)`` of each of ``pages`` whose install line can run here: one that
    names an unset variable (``"$SLIME_SOURCE"``) is left out, saying so."""
    out = []
    for page in pages:
        stack, line = doc_pages.install_line(page)
        unset = [name for name in re.findall(r"\$\{?(\w+)", line) if not os.environ.get(name)]
        if unset:
            print(f"nox > {page}: its install line needs {', '.join(unset)}; its stack's tests "
                  "are left out (they skip)")  # fmt: skip
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
