"""The test worlds' virtualenvs (``noxfile.py`` says what goes into each): the requirements
``setup.py`` names, read without running it; a world installed ahead into
``.nox/world-<python>`` (``nox_background.ahead``), which the session's own virtualenv then sees;
virtualenvs layered over a session's; pyenv's interpreters made visible to nox.
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
from collections.abc import Iterable
from typing import TYPE_CHECKING

from nox_background import Step, collect

if TYPE_CHECKING:  # nox only for the types: the tests import this module without it
    import nox

#: pip compiles every module it installs to bytecode (12,000 files a world); the tests import a
#: fraction of them, which Python compiles on first import. The 3.11 world installed in 40 s
#: with this, 117 s without.
NO_COMPILE = ("--no-compile",)
_SITE = "import site; print(site.getsitepackages()[0])"


def expose_pyenv_versions(minors: Iterable[str]) -> None:
    """With pyenv, ``python3.12`` is a shim that answers only for the active versions; activate
    the newest installed of each of ``minors`` (``3.11``, ``3.12``) so that nox finds them."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    if "PYENV_VERSION" in os.environ or not shutil.which("pyenv"):
        return
    versions = [
        os.path.basename(path)
        for minor in minors
        for path in sorted(glob.glob(os.path.join(root, "versions", f"{minor}.*")))[-1:]
    ]
    if versions:
        os.environ["PYENV_VERSION"] = ":".join(versions)


def setup_kwarg(name: str) -> object:
    """The value of ``setup.py``'s keyword argument ``name``, read without running it."""
    with open("setup.py", encoding="utf-8") as f:
        tree = ast.parse(f.read())
    value = next(
        kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
        for kw in node.keywords if kw.arg == name
    )  # fmt: skip
    return ast.literal_eval(value)


def extra(name: str) -> list[str]:
    """The requirements of ``setup.py``'s extra ``name``, read without installing the project
    (the docs build reads the sources; it needs neither torch nor megatron-core)."""
    return setup_kwarg("extras_require")[name]


def world(python: str) -> str:
    """The folder of the ``python`` world that an earlier session builds ahead."""
    return os.path.abspath(os.path.join(".nox", f"world-{python}"))


def world_step(python: str, requirements: tuple[str, ...]) -> Step:
    """The ``ahead`` step that installs ``requirements`` into the ``python`` world,
    ``.nox/world-<python>`` (``install`` uses it)."""
    folder = world(python)
    pip = (os.path.join(folder, "bin", "python"), "-m", "pip", "install", "-q", *NO_COMPILE)
    return f"world-{python}", [(f"python{python}", "-m", "venv", "--clear", folder),
                               (*pip, *requirements)]  # fmt: skip


def install(session: nox.Session, *requirements: str) -> None:
    """Install ``requirements`` into the session's virtualenv; when ``lint`` started this
    world ahead (``.nox/world-<python>``), the virtualenv sees that world's packages (as a
    ``layer`` does) and pip finds all but what the world lacks (the project)."""
    folder = world(session.python)
    if collect(session, f"world-{session.python}"):
        see(session, os.path.join(folder, "bin", "python"), "python")
        # Its console scripts (torchrun, ...) too: nox puts this virtualenv's own before them.
        path = session.env.get("PATH", os.environ["PATH"])
        session.env["PATH"] = os.pathsep.join([os.path.join(folder, "bin"), path])
    session.install(*NO_COMPILE, *requirements)


def layer(session: nox.Session, name: str) -> str:
    """A new virtualenv ``.nox/<name>`` that sees this session's packages after its own (a
    ``.pth`` file), so that torch and megatron-core are not installed again (about 80 s of CPU
    and 4.7 GB each); pip installs into it what it lacks. Returns its Python."""
    venv = os.path.abspath(os.path.join(".nox", name))
    session.run("python", "-m", "venv", "--clear", venv)
    python = os.path.join(venv, "bin", "python")
    see(session, "python", python)
    return python


def see(session: nox.Session, below: str, above: str) -> None:
    """Let the Python ``above`` import what the Python ``below`` has installed, after its own."""
    sites = [session.run(python, "-c", _SITE, silent=True, external=True).strip()
             for python in (below, above)]  # fmt: skip
    with open(os.path.join(sites[1], "_layer.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({sites[0]!r})\n")
