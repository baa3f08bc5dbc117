"""``python -m megatron_lossfix install-bridge``: install Megatron Bridge into this environment.

Run it with the Python of the environment to install into; that environment must already hold
torch and megatron-core 0.19 on Python 3.12 or newer (what Bridge 0.6 needs). It refuses anything
else in one line before touching the environment.

Why not ``pip install megatron-bridge==0.6.2``: on a machine without CUDA it fails, because a
dependency (fast-hadamard-transform) builds CUDA code; so do flashinfer, transformer-engine and
others Bridge lists but its GPT training loop never imports. So: Bridge without its
dependencies, then what ``pretrain()`` imports (``requirements.txt`` beside this file),
with torch and megatron-core held at the environment's own versions. Never
``pip install megatron``: an unrelated PyPI project that breaks the ``megatron`` namespace.

pip would list, after each step, every package Bridge names that is deliberately left out; the
steps run with ``--no-warn-conflicts`` and the command says once, in one line, what it left out.
The environment keeps a plain ``import megatron.core`` working (see ``requirements.txt``
on nvidia-resiliency-ext), so the plugin's examples and audit still run in it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["BRIDGE", "REQUIREMENTS", "environment_problem", "main"]

BRIDGE = "megatron-bridge==0.6.2"
#: What Bridge's GPT training loop imports, installed beside it (one requirement a line).
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
PYTHON_MIN = (3, 12)
CORE_LINE = "0.19"
#: The one line that makes an environment Bridge can go into (docs/bridge.md's).
MAKE_ENV = (
    "python3.12 -m venv .venv312 && .venv312/bin/pip install -q torch==2.13.0 "
    "megatron-core==0.19.2 -e . && .venv312/bin/python -m megatron_lossfix install-bridge"
)
_SMOKE = """
from megatron_lossfix.integrations.bridge.cpu import enable_cpu_bridge
enable_cpu_bridge()
from megatron.bridge.training.pretrain import pretrain
import megatron.bridge
print("megatron-bridge", megatron.bridge.__version__, "imports")
"""


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_problem(
    python: tuple[int, ...] | None = None,
    versions: dict[str, str | None] | None = None,
) -> str | None:
    """One line saying why this environment cannot take Bridge 0.6, or None when it can.

    ``python`` and ``versions`` (distribution -> version or None) default to this interpreter's.
    """
    python = tuple(sys.version_info[:3]) if python is None else python
    if versions is None:
        versions = {name: _version(name) for name in ("torch", "megatron-core")}
    found = ".".join(map(str, python))
    if python[:2] < PYTHON_MIN:
        return (
            f"Megatron Bridge 0.6 needs Python >= 3.12 and megatron-core {CORE_LINE}; this is "
            f"Python {found} ({sys.executable}). Make a 3.12 environment and install there: "
            f"{MAKE_ENV}"
        )
    if versions.get("torch") is None:
        return "torch is not installed in this environment; install it first: pip install torch"
    core = versions.get("megatron-core")
    if core is None or not (core == CORE_LINE or core.startswith(CORE_LINE + ".")):
        have = "not installed" if core is None else f"megatron-core {core}"
        return (
            f"Megatron Bridge 0.6 needs megatron-core {CORE_LINE}.x; this environment has "
            f"{have}: pip install megatron-core==0.19.2 first"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Check this environment, then install Bridge and what its training loop imports."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lossfix install-bridge",
        description="Install Megatron Bridge 0.6.2 into the environment of this Python (3.12 "
        "or newer, with torch and megatron-core 0.19 already installed), CUDA or not.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check the environment: print what is wrong in one line, exit non-zero",
    )
    args = parser.parse_args(list(argv or []))
    problem = environment_problem()
    if problem is not None:
        print(f"megatron_lossfix install-bridge: {problem}", file=sys.stderr)
        return 2
    if args.check:
        print("megatron_lossfix install-bridge: this environment can take Megatron Bridge 0.6")
        return 0
    # Bridge's own list names CUDA kernels and other models' code its GPT loop never imports:
    # pip would print each as a conflict after every step.
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-warn-conflicts"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as pins:
        # Bridge's requirements must not move torch or megatron-core.
        pins.write(f"torch=={_version('torch')}\nmegatron-core=={_version('megatron-core')}\n")
        pins.flush()
        for cmd in ([*pip, "--no-deps", BRIDGE], [*pip, "-c", pins.name, "-r", str(REQUIREMENTS)]):
            if subprocess.run(cmd).returncode != 0:
                print(f"megatron_lossfix install-bridge: failed: {' '.join(cmd)}", file=sys.stderr)
                return 1
    # Bridge logs each optional import it misses, with a traceback: shown only if this fails.
    smoke = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _SMOKE], capture_output=True, text=True
    )
    if smoke.returncode != 0:
        print(smoke.stdout + smoke.stderr, file=sys.stderr)
        print("megatron_lossfix install-bridge: failed: Bridge does not import", file=sys.stderr)
        return 1
    left_out = _left_out()
    print(
        f"megatron_lossfix install-bridge: {smoke.stdout.strip().splitlines()[-1]}; left out "
        "on purpose (not "
        f"imported by its GPT training loop): {', '.join(left_out) if left_out else 'nothing'}"
    )
    return 0


def _left_out() -> list[str]:
    """Bridge's requirements that are not installed (what pip would list as conflicts)."""
    import re

    missing = []
    for requirement in importlib.metadata.requires("megatron-bridge") or []:
        if ";" in requirement and "extra ==" in requirement:
            continue  # an optional extra
        name = re.split(r"[\s<>=!~\[;(]", requirement, maxsplit=1)[0]
        if _version(name) is None:
            missing.append(name)
    return sorted(set(missing))


if __name__ == "__main__":
    sys.exit(main())
