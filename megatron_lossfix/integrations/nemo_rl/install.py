"""``python -m megatron_lossfix install-nemo-rl NEMO_RL MEGATRON_BRIDGE MEGATRON_LM``: NeMo-RL
from its sources, into this environment.

NeMo-RL is not on the package index (its ``nemo-rl`` there is an empty 0.0.0). At the commit
this project measured (7ea279a) it asks for Python >= 3.13.14 and megatron-core 0.20.0, while
the Megatron Bridge it pins asks for Python < 3.13, and megatron-core 0.20.0 is not on the
index either. Each argument is a clone of the repository at NeMo-RL's pins or its
``git archive`` (``.tar.gz``):

* NeMo-RL and Megatron Bridge install from their sources without their dependencies (their
  lists pin CUDA builds, vLLM, Transformer Engine, ...; the ``[nemo-rl]`` extra of this project
  brings what their Megatron loss path imports on CPU), NeMo-RL past its ``requires-python``.
  NeMo-RL's ``pyproject.toml`` lists the package ``nemo_rl`` alone (its users install it
  editable): its tree is copied to ``<environment>/src/nemo-rl`` and installed editable from
  there;
* Megatron-LM's ``megatron/core`` and ``megatron/training`` (what the index's megatron-core
  wheels ship) install as the distribution ``megatron-core`` at the version its
  ``package_info.py`` names (0.20.0 at the pin), in place of the index's release installed
  before it (which brought its dependencies); the rest of the tree is not packaged.

Run it with the Python of the environment to install into (3.12, with torch, the index's
megatron-core and this project's ``[nemo-rl]`` extra installed: docs/nemo_rl.md's line).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["core_version", "main", "source_tree"]

_PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "megatron-core"
version = "{version}"
description = "Megatron-Core from a Megatron-LM tree ({origin})"
requires-python = ">=3.10"

[tool.setuptools.packages.find]
include = ["megatron.core", "megatron.core.*", "megatron.training", "megatron.training.*"]

[tool.setuptools.package-data]
"*" = ["*.json", "*.yaml", "*.cpp", "Makefile"]
"""


def source_tree(source: str, into: Path, *, marker: str) -> Path:
    """The tree of ``source`` (a directory, or a ``git archive`` ``.tar.gz`` unpacked under
    ``into``) that holds ``marker``: the directory itself, or the archive's one top folder."""
    path = Path(source)
    if path.is_dir():
        root = path
    elif path.is_file() and tarfile.is_tarfile(path):
        with tarfile.open(path) as archive:
            archive.extractall(into, filter="data")
        tops = [p for p in into.iterdir() if p.is_dir()]
        root = tops[0] if len(tops) == 1 else into
    else:
        raise SystemExit(
            f"megatron_lossfix install-nemo-rl: {source!r} is neither a directory nor a .tar.gz "
            "archive: give a clone or its git archive"
        )
    if not (root / marker).exists():
        raise SystemExit(f"megatron_lossfix install-nemo-rl: {source} has no {marker}")
    return root


def core_version(tree: Path) -> str:
    """The version ``megatron/core/package_info.py`` of a Megatron-LM tree names."""
    text = (tree / "megatron" / "core" / "package_info.py").read_text(encoding="utf-8")
    parts = [re.search(rf"^{key} = (\S+)", text, re.M) for key in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise SystemExit(f"megatron_lossfix install-nemo-rl: no version in {tree}")
    pre = re.search(r"^PRE_RELEASE = '([^']*)'", text, re.M)
    return ".".join(p.group(1) for p in parts if p) + (pre.group(1) if pre else "")


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-warn-conflicts", *args]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"megatron_lossfix install-nemo-rl: failed: {' '.join(cmd)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Install NeMo-RL, Megatron Bridge and Megatron-Core from the three sources."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lossfix install-nemo-rl",
        description="Install NeMo-RL and Megatron Bridge from their sources without their "
        "dependencies, and Megatron-LM's megatron/core as megatron-core, into this Python's "
        "environment (docs/nemo_rl.md).",
    )
    parser.add_argument("nemo_rl", help="NVIDIA-NeMo/RL: a clone or its git archive (.tar.gz)")
    parser.add_argument(
        "megatron_bridge", help="NVIDIA-NeMo/Megatron-Bridge at NeMo-RL's pin: a clone or archive"
    )
    parser.add_argument(
        "megatron_lm", help="NVIDIA/Megatron-LM at that Bridge's pin: a clone or archive"
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if sys.version_info[:2] < (3, 12):
        print("megatron_lossfix install-nemo-rl: needs Python 3.12", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = []
        for name, source, marker in (
            ("nemo-rl", args.nemo_rl, "nemo_rl"),
            ("bridge", args.megatron_bridge, "src/megatron/bridge"),
            ("megatron-lm", args.megatron_lm, "megatron/core"),
        ):
            (work / name).mkdir()
            trees.append(source_tree(source, work / name, marker=marker))
        nemo_rl, bridge, megatron_lm = trees
        version = core_version(megatron_lm)
        core = work / "megatron-core"
        for package in ("core", "training"):  # as the index's wheels of megatron-core ship
            shutil.copytree(megatron_lm / "megatron" / package, core / "megatron" / package)
        origin = os.path.basename(os.path.normpath(args.megatron_lm))
        (core / "pyproject.toml").write_text(
            _PYPROJECT.format(version=version, origin=origin), encoding="utf-8"
        )
        # No build isolation: the [nemo-rl] extra holds the build tools (setuptools, wheel);
        # an isolated build would fetch Bridge's build requirement torch a second time.
        kept = Path(sys.prefix) / "src" / "nemo-rl"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(nemo_rl, kept)
        _pip("--no-deps", "--no-build-isolation", "--ignore-requires-python",
             "-e", str(kept), str(bridge), str(core))  # fmt: skip
    print(f"megatron_lossfix install-nemo-rl: nemo-rl, megatron-bridge, megatron-core {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
