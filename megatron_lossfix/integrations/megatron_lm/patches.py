"""Apply, check and revert our patch of a Megatron-LM checkout.

    python -m megatron_lossfix.patches apply  PATH_TO_MEGATRON_LM
    python -m megatron_lossfix.patches check  PATH_TO_MEGATRON_LM
    python -m megatron_lossfix.patches revert PATH_TO_MEGATRON_LM
    python -m megatron_lossfix.patches list

The patch makes Megatron-LM's ``pretrain_gpt.py`` and ``train_rl.py`` (its GRPO loop) accept
``--loss-reduction`` (and our other flags); with the flags absent nothing changes. Its code lives
in :mod:`megatron_lossfix.integrations.megatron_lm.training` and ``.rl``; the diffs are a
few lines per script.

The diffs are the repository's top-level ``patches/*.patch`` (the single source: an editable
install reads them there, a wheel installs them to ``<prefix>/share/megatron_lossfix/patches``,
``MEGATRON_LOSSFIX_PATCHES`` overrides both). Each one names the Megatron-Core version it was made
for in a header line ``Megatron-Core-Version: X`` (``main`` for the development branch); the
checkout's version is read from ``megatron/core/package_info.py``. The patch naming that version
is used; otherwise one made for the same release series (``0.19.x``), then any other patch, the
first that fits the tree exactly, with a note saying which.

Every command is safe to repeat: ``apply`` on a patched tree and ``revert`` on a pristine one say
so and change nothing; a tree that matches neither (edited, or another version) is refused with
nothing changed. Exit status: 0 done / applied, 1 ``check``: not applied but applies cleanly,
2 error (not a Megatron-LM tree, unsupported version, conflicts).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

__all__ = [
    "PatchError",
    "PatchInfo",
    "State",
    "apply",
    "available_patches",
    "check",
    "check_checkout",
    "command_parser",
    "main",
    "megatron_core_version",
    "patches_dir",
    "revert",
    "select_patch",
]

#: Files every Megatron-LM checkout we support has (besides the ones a patch touches).
_MARKERS = ("megatron/core/package_info.py", "megatron/training/__init__.py")
_VERSION_KEY = "Megatron-Core-Version"
_ENV_DIR = "MEGATRON_LOSSFIX_PATCHES"


class PatchError(RuntimeError):
    """A patch operation that cannot go ahead; the message says why and what to do."""


class State(Enum):
    """Where a checkout stands with respect to one patch."""

    APPLIED = "applied"
    NOT_APPLIED = "not applied (applies cleanly)"
    CONFLICT = "conflicts (the files differ from what the patch expects)"


@dataclass(frozen=True)
class PatchInfo:
    """One diff of ``patches/``: its file, the version it targets and the files it touches."""

    path: Path
    version: str
    """``Megatron-Core-Version`` from the header (e.g. ``0.16.1``, or ``main``)."""
    files: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path.stem


# ---------------------------------------------------------------------------------- discovery
def patches_dir() -> Path:
    """The directory holding the ``*.patch`` files (see the module docstring)."""
    candidates = []
    if os.environ.get(_ENV_DIR):
        candidates.append(Path(os.environ[_ENV_DIR]))
    # Source checkout / editable install: <repo>/megatron_lossfix/integrations/megatron_lm/training/
    # patches.py -> <repo>/patches.
    candidates.append(Path(__file__).resolve().parents[3] / "patches")
    # Wheel: setup.py's data_files.
    candidates.append(Path(sys.prefix) / "share" / "megatron_lossfix" / "patches")
    for directory in candidates:
        if directory.is_dir() and any(directory.glob("*.patch")):
            return directory
    raise PatchError(
        "no Megatron-LM patches found (looked in "
        + ", ".join(str(c) for c in candidates)
        + f"); set {_ENV_DIR} to the repository's patches/ directory"
    )


def _parse_patch(path: Path) -> PatchInfo:
    text = path.read_text(encoding="utf-8")
    version = None
    for line in text.splitlines():
        if line.startswith("--- "):
            break  # the header ends where the first diff begins
        if line.startswith(f"{_VERSION_KEY}:"):
            version = line.split(":", 1)[1].strip()
    if not version:
        raise PatchError(f"{path} has no '{_VERSION_KEY}: ...' header line")
    files = tuple(
        dict.fromkeys(m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", text, re.MULTILINE))
    )
    if not files:
        raise PatchError(f"{path} holds no unified diff ('+++ b/PATH' lines)")
    return PatchInfo(path=path, version=version, files=files)


def available_patches(directory: Path | None = None) -> list[PatchInfo]:
    """Every patch in ``directory`` (default :func:`patches_dir`), released versions first."""
    directory = patches_dir() if directory is None else Path(directory)
    infos = [_parse_patch(p) for p in sorted(directory.glob("*.patch"))]
    # Exact releases before the development branch when falling back.
    return sorted(infos, key=lambda i: (i.version == "main", i.name))


def megatron_core_version(target: Path) -> str:
    """``MAJOR.MINOR.PATCH[PRE]`` from ``megatron/core/package_info.py`` (read, not imported)."""
    text = (target / "megatron/core/package_info.py").read_text(encoding="utf-8")
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
        m = re.search(rf"^{key}\s*=\s*['\"]?([^'\"\s#]*)['\"]?", text, re.MULTILINE)
        parts[key] = m.group(1) if m else ""
    if not (parts["MAJOR"] and parts["MINOR"] and parts["PATCH"]):
        raise PatchError(f"cannot read the Megatron-Core version from {target}/megatron/core")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


def check_checkout(target: Path, files: Sequence[str] = ()) -> Path:
    """``target`` resolved when it is the root of a Megatron-LM checkout holding ``files``;
    else :class:`PatchError`, one line naming the directory to pass."""
    target = Path(target).expanduser()
    if not target.is_dir():
        raise PatchError(f"{target} is not a directory: pass the root of a Megatron-LM checkout")
    missing = [f for f in (*_MARKERS, *files) if not (target / f).is_file()]
    if missing:
        raise PatchError(
            f"{target} is not a Megatron-LM checkout (missing {', '.join(missing)}); pass the "
            "directory that holds pretrain_gpt.py and megatron/"
        )
    return target.resolve()


# ---------------------------------------------------------------------------------- backends
def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # `git apply` inside an enclosing repository resolves paths from that repository's root and
    # silently skips files outside the current directory: stop the search at the target.
    env["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def _applies(patch: Path, target: Path, *, reverse: bool = False, dry_run: bool = True) -> tuple:
    """(ok, message) of applying ``patch`` (or its reverse) to ``target``."""
    if shutil.which("git"):
        cmd = ["git", "apply", "-p1", "--whitespace=nowarn"]
        cmd += ["--check"] if dry_run else []
        cmd += ["--reverse"] if reverse else []
    elif shutil.which("patch"):
        # No fuzz: a patch that only applies loosely is a conflict. Forward: --forward skips
        # (fails on) an applied patch; reverse: --force stops patch from "helpfully" applying
        # an unapplied patch forward instead.
        cmd = ["patch", "-p1", "--fuzz=0", "--silent", "--no-backup-if-mismatch"]
        cmd += ["--reverse", "--force"] if reverse else ["--forward", "--batch"]
        cmd += ["--dry-run"] if dry_run else []
    else:
        raise PatchError("neither git nor patch is installed; one of them is needed")
    proc = _run([*cmd, "-i" if cmd[0] == "patch" else "--", str(patch)], target)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _state(info: PatchInfo, target: Path) -> tuple[State, str]:
    # Reverse first: a patched tree must read as applied even if the forward check fails.
    ok, _ = _applies(info.path, target, reverse=True)
    if ok:
        return State.APPLIED, ""
    ok, message = _applies(info.path, target)
    if ok:
        return State.NOT_APPLIED, ""
    return State.CONFLICT, message


# ---------------------------------------------------------------------------------- commands
def select_patch(
    target: Path, name: str | None = None, directory: Path | None = None
) -> tuple[PatchInfo, State, str]:
    """The patch for ``target`` and the tree's state with it (and a note on how it was chosen).

    ``name``: a patch file's stem (``megatron_lm_core_v0.16.1``) or version (``0.16.1``,
    ``main``) to use instead of choosing by version.
    """
    target = check_checkout(target)
    patches = available_patches(directory)
    if name is not None:
        chosen = [p for p in patches if name in (p.name, p.version)]
        if not chosen:
            raise PatchError(
                f"no patch named {name!r}; known: {', '.join(p.name for p in patches)}"
            )
        info = chosen[0]
        check_checkout(target, info.files)
        state, _ = _state(info, target)
        return info, state, f"patch {info.name} (chosen by name)"
    version = megatron_core_version(target)
    exact = [p for p in patches if p.version == version]
    if exact:
        info = exact[0]
        check_checkout(target, info.files)
        state, message = _state(info, target)
        if state is State.CONFLICT:
            raise PatchError(
                f"{target} is Megatron-Core {version}, but its files differ from what "
                f"{info.path.name} expects (local edits?); nothing was changed.\n{message}"
            )
        return info, state, f"Megatron-Core {version}: patch {info.name}"
    return _nearest_fitting_patch(target, version, patches)


def _nearest_fitting_patch(
    target: Path, version: str, patches: list[PatchInfo]
) -> tuple[PatchInfo, State, str]:
    """For a version no patch was made for: one of the same release series (0.19.x) first;
    then, for a version newer than every release patch (the development branch), the main
    patch; then the releases, nearest first. The first that fits exactly (applied, or applies
    cleanly)."""
    series = _series(version)
    releases = sorted(
        (p for p in patches if _series(p.version) is not None),
        key=lambda p: abs(_number(p.version) - _number(version)),
    )
    ordered = [p for p in releases if _series(p.version) == series]
    newest = max((_number(p.version) for p in releases), default=0.0)
    if _number(version) > newest:
        ordered += [p for p in patches if _series(p.version) is None]
    ordered += [p for p in (*releases, *patches) if p not in ordered]
    for info in ordered:
        if not all((target / f).is_file() for f in info.files):
            continue
        state, _ = _state(info, target)
        if state is not State.CONFLICT:
            if _series(info.version) == series:
                how = f"made for {info.version}, the same release series"
            elif _series(info.version) is None and _number(version) > newest:
                how = "made for the development branch; this version is newer than every release"
            else:
                how = f"made for {info.version}; this version has no patch of its own, and it fits"
            return info, state, f"Megatron-Core {version}: patch {info.name} ({how})"
    supported = ", ".join(f"{p.version} ({p.name})" for p in patches)
    raise PatchError(
        f"{target} is Megatron-Core {version}, which no patch supports (supported: "
        f"{supported}) and none applies cleanly; check out a supported Megatron-LM version"
    )


def _number(version: str) -> float:
    """A sortable number for ``MAJOR.MINOR.PATCH`` (minor and patch below 1000)."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return float(int(m[1]) * 1e6 + int(m[2]) * 1e3 + int(m[3])) if m else float("inf")


def _series(version: str) -> str | None:
    """``MAJOR.MINOR`` of a release version (``0.19`` for ``0.19.1``); None for ``main``."""
    m = re.match(r"(\d+)\.(\d+)\.", version)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def check(target: Path, name: str | None = None, directory: Path | None = None) -> State:
    """The state of ``target`` (raises :class:`PatchError` when it is not patchable)."""
    return select_patch(target, name, directory)[1]


def apply(target: Path, name: str | None = None, directory: Path | None = None) -> str:
    """Apply the patch; a no-op when already applied. Returns what happened, in words."""
    target = Path(target)
    info, state, how = select_patch(target, name, directory)
    if state is State.APPLIED:
        return f"{how}: already applied to {target}; nothing to do"
    if state is State.CONFLICT:
        raise PatchError(f"{how}: {state.value}; nothing was changed")
    ok, message = _applies(info.path, target, dry_run=False)
    if not ok:  # the dry run passed: only a race or a disk error gets here
        raise PatchError(f"applying {info.path.name} failed:\n{message}")
    return f"{how}: applied to {target} ({', '.join(info.files)})"


def revert(target: Path, name: str | None = None, directory: Path | None = None) -> str:
    """Revert the patch; a no-op when not applied. Returns what happened, in words."""
    target = Path(target)
    info, state, how = select_patch(target, name, directory)
    if state is State.NOT_APPLIED:
        return f"{how}: not applied to {target}; nothing to revert"
    if state is State.CONFLICT:
        raise PatchError(f"{how}: {state.value}; nothing was changed")
    ok, message = _applies(info.path, target, reverse=True, dry_run=False)
    if not ok:
        raise PatchError(f"reverting {info.path.name} failed:\n{message}")
    return f"{how}: reverted in {target}"


def command_parser() -> argparse.ArgumentParser:
    """The command line's parser: ``apply``, ``revert``, ``check``, ``list``."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lossfix.patches",
        description="Patch a Megatron-LM checkout so that pretrain_gpt.py and train_rl.py take "
        "--loss-reduction.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command, help_text in (
        ("apply", "apply the patch (no-op when already applied)"),
        ("revert", "revert the patch (no-op when not applied)"),
        ("check", "report the state: exit 0 applied, 1 not applied, 2 cannot apply"),
    ):
        p = sub.add_parser(command, help=help_text)
        p.add_argument("path", type=Path, help="root of the Megatron-LM checkout")
        p.add_argument(
            "--patch",
            default=None,
            help="use this patch (file stem or version) instead of "
            "choosing by the checkout's Megatron-Core version",
        )
    sub.add_parser("list", help="list the patches and the versions they are made for")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; returns the exit status (see the module docstring)."""
    args = command_parser().parse_args(argv)
    try:
        if args.command == "list":
            for info in available_patches():
                print(f"{info.name}: Megatron-Core {info.version}; {', '.join(info.files)}")
            return 0
        if args.command == "apply":
            print(apply(args.path, args.patch))
            return 0
        if args.command == "revert":
            print(revert(args.path, args.patch))
            return 0
        info, state, how = select_patch(args.path, args.patch)
        print(f"{how}: {state.value}")
        return {State.APPLIED: 0, State.NOT_APPLIED: 1}.get(state, 2)
    except PatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
