"""The package's layers point one way, and the package holds nothing but what it ships for
(docs/design.md §6).

Every module under ``megatron_lossfix/`` is parsed with ``ast``; its imports are read wherever
they stand (module level, inside functions, under ``if TYPE_CHECKING:``). Nothing is imported,
so the test runs in a fraction of a second and sees lazy imports too.

Layers, lowest first, one per folder; a module may import its own layer and the ones below:

0. ``runtime/``: the config, the table of modes, masks -> counts -> weights, the losses; plain
   PyTorch, never Megatron (not even lazily).
1. ``step/``: the Megatron step (schedule, driver and phases, agreement, counting pass, MTP,
   metrics, first-step check, Megatron's averaging and release facts) and ``harness/``
   (Megatron-Core on a CPU).
2. the flags: the package's ``args`` (flags -> config -> schedule).
3. ``integrations/``: Megatron-LM, Megatron Bridge, the patch tool, the RL frameworks.
4. ``rl/``: the RL objective, policy losses, the log-prob kernel.
5. the package's ``__init__``: the public names, re-exported from layers 0-4.
6. ``audit/``: what ``python -m megatron_lossfix audit`` runs (rank pool, oracle, layout
   matrix, tiny model, report).

``__main__`` (the command-line dispatcher) and ``patches`` (``python -m
megatron_lossfix.patches``, the public address of the patch tool) are entry points: they may
import anything, and no module imports them. At the package root only these, the flags and the
``__init__`` stand. Test helpers live under ``tests/``, the examples' own modules under
``examples/``; the package imports neither, and a package module that only tests import does not
belong in the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = "megatron_lossfix"
REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / PACKAGE

RUNTIME, STEP, FLAGS, INTEGRATIONS, RL, API, AUDIT, ENTRY = range(8)
LAYER_NAMES = (
    "runtime", "Megatron step", "flags", "integrations", "rl", "package API", "audit", "entry point"
)  # fmt: skip

#: Folder -> layer.
SUBPACKAGES: dict[str, int] = {
    "runtime": RUNTIME,
    "step": STEP,
    "harness": STEP,
    "integrations": INTEGRATIONS,
    "rl": RL,
    "audit": AUDIT,
}
ENTRY_POINTS = (f"{PACKAGE}.__main__", f"{PACKAGE}.patches")
#: The only modules at the package root besides ``__init__`` and the entry points.
ROOT_MODULES = {f"{PACKAGE}.args": FLAGS}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    if module == PACKAGE:
        return API
    if module in ENTRY_POINTS:
        return ENTRY
    if module in ROOT_MODULES:
        return ROOT_MODULES[module]
    parts = module.split(".")[1:]
    if len(parts) > 1 or MODULES[module].name == "__init__.py":
        if parts[0] in SUBPACKAGES:
            return SUBPACKAGES[parts[0]]
    raise AssertionError(
        f"{module} has no layer: put it in a layer's folder (or add its folder to SUBPACKAGES "
        "and docs/design.md §6)"
    )


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` reads from."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_in(tree: ast.AST, module: str | None) -> list[tuple[int, str, str | None]]:
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node) if module else node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append((node.lineno, submodule, None))
                else:
                    found.append((node.lineno, source, alias.name))
    return found


def imports(module: str) -> list[tuple[int, str, str | None]]:
    """``(line, imported module, imported name or None)`` for every import in ``module``.

    ``from megatron_lossfix.rl import objective`` imports the module
    ``megatron_lossfix.rl.objective``; ``from megatron_lossfix import LossFixSchedule`` imports
    a name of the package itself; a framework's folder that serves its adapter's names
    (``__getattr__ = serve(__name__, "adapter")``) imports ``<folder>.adapter``.
    """
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    served = [
        (node.lineno, f"{module}.{node.args[1].value}", None)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "serve"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Constant)
    ]
    return _imports_in(tree, module) + served


def _own(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _edges() -> dict[str, set[str]]:
    return {
        module: {target for _, target, _ in imports(module) if _own(target) and target != module}
        for module in MODULES
    }


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    """(a) No module imports a higher layer: the runtime never imports an integration, the RL
    code or the audit, the pure modules never import Megatron, and nothing imports an entry
    point."""
    own = layer_of(module)
    pure = own == RUNTIME
    wrong = []
    for line, target, _ in imports(module):
        if _own(target):
            if target not in MODULES:
                wrong.append(f"line {line}: {target} is not a module of the package")
            elif layer_of(target) > own or (layer_of(target) == ENTRY and target != module):
                wrong.append(f"line {line}: {target} ({LAYER_NAMES[layer_of(target)]})")
        elif pure and (target == "megatron" or target.startswith("megatron.")):
            wrong.append(f"line {line}: {target} (Megatron, from a pure runtime module)")
    assert not wrong, f"{module} ({LAYER_NAMES[own]}) imports upward:\n" + "\n".join(wrong)


def test_the_runtime_folder_is_not_empty():
    """The Megatron-free check above is not vacuous: the runtime folder holds modules."""
    assert sum(layer_of(m) == RUNTIME for m in MODULES) >= 5


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    """(b) A name another module needs is public: no ``from megatron_lossfix.x import _y``."""
    private = [
        f"line {line}: {name} from {target}"
        for line, target, name in imports(module)
        if _own(target)
        and target != module
        and name is not None
        and name.startswith("_")
        and not name.startswith("__")
    ]
    assert not private, f"{module} imports private names:\n" + "\n".join(private)


def test_no_import_cycles():
    """(c) The package's modules form no import cycle, lazy or type-only imports included."""
    edges = _edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# ------------------------------------------------------------- what the package is for


def _local_modules(folder: Path) -> set[str]:
    """Top-level import names that a folder's files provide when it is on ``sys.path``."""
    return {p.stem for p in folder.glob("*.py")} | {
        p.parent.name for p in folder.glob("*/__init__.py")
    }


def test_the_package_imports_neither_tests_nor_examples():
    """(d) Test helpers and the examples' modules stay out of the package's imports."""
    outside = (_local_modules(REPO / "tests") | _local_modules(REPO / "examples")) - {PACKAGE}
    outside |= {"tests", "examples"}
    wrong = [
        f"{module} line {line}: {target}"
        for module in MODULES
        for line, target, _ in imports(module)
        if target.split(".")[0] in outside
    ]
    assert not wrong, "the package imports test or example code:\n" + "\n".join(wrong)


#: Dotted module names in text that is not Python (shell scripts, the Megatron-LM patches).
_DOTTED = re.compile(rf"\b{PACKAGE}(?:\.\w+)+")


def _users_outside_tests() -> dict[str, set[str]]:
    """``module -> who uses it``, counting package modules (not the module itself), the
    examples, the Megatron-LM patches, the CI scripts and the entry points' command tables;
    tests are left out on purpose."""
    users: dict[str, set[str]] = {m: set() for m in MODULES}

    def note(target: str, user: str) -> None:
        # ``import a.b.c`` uses a.b.c and the packages above it.
        while target:
            if target in users and target != user:
                users[target].add(user)
            target = target.rpartition(".")[0]

    for module in MODULES:
        for _, target, _ in imports(module):
            note(target, module)
        if module in ENTRY_POINTS:  # command tables name modules as strings
            for target in _DOTTED.findall(MODULES[module].read_text()):
                note(target, module)
    sources = [*(REPO / "examples").rglob("*.py")]
    texts = [*(REPO / "examples").rglob("*.sh"), *(REPO / "patches").glob("*.patch")]
    texts += [*(REPO / ".ci").rglob("*")] if (REPO / ".ci").is_dir() else []
    for path in sources:
        for _, target, name in _imports_in(ast.parse(path.read_text()), None):
            note(
                f"{target}.{name}" if name and f"{target}.{name}" in MODULES else target, path.name
            )
    for path in texts:
        if path.is_file():
            for target in _DOTTED.findall(path.read_text(errors="replace")):
                note(target, path.name)
    return users


def test_no_package_module_only_tests_use():
    """(e) Every module is used by the package, an example, the Megatron-LM patches or an
    entry point; a module that only tests import belongs under tests/ (entry points and the
    package ``__init__`` files are exempt: ``python -m`` and ``import`` reach them)."""
    users = _users_outside_tests()
    exempt = {*ENTRY_POINTS, *(m for m, p in MODULES.items() if p.name == "__init__.py")}
    unused = sorted(m for m, who in users.items() if not who and m not in exempt)
    assert not unused, "package modules that only tests use (move them to tests/helpers):\n" + (
        "\n".join(unused)
    )


def test_the_usage_check_sees_examples_patches_and_entry_points():
    """The usage map is not vacuous: it sees an example's import, the Megatron-LM patches'
    import and the dispatcher's command table."""
    users = _users_outside_tests()
    assert "grpo_gpt.py" in users[f"{PACKAGE}.rl.objective"]
    assert any(u.endswith(".patch") for u in users[f"{PACKAGE}.integrations.megatron_lm"])
    assert f"{PACKAGE}.__main__" in users[f"{PACKAGE}.audit.command"]


# ------------------------------------------------------------------ no machine paths

#: An absolute path into a machine's own folders (home, scratch, temporary, mounted) or a user
#: folder; system paths such as /dev/null, /usr/bin/env, /proc and URL paths do not match.
MACHINE_PATH = re.compile(
    r"(?<![\w.:/~$}\-])/(?:work|tmp|home|root|Users|mnt|scratch|media|var/tmp)/[\w.\-]"
)

#: Where the rule applies: the package, tests, examples, docs, CI and the project's own files.
CHECKED = ("megatron_lossfix", "tests", "examples", "docs", "patches", ".ci", "README.md",
           "CHANGELOG.md", "setup.py", "pyproject.toml", "noxfile.py")  # fmt: skip
SUFFIXES = {".py", ".md", ".sh", ".patch", ".txt", ".toml", ".cfg", ".ini", ".json", ".yml", ""}


def _checked_files() -> list[Path]:
    """The files the rule applies to; this file's own samples of the rule are left out."""
    files = []
    for name in CHECKED:
        path = REPO / name
        found = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        files += [
            p
            for p in found
            if p.is_file() and p.suffix in SUFFIXES and p != Path(__file__).resolve()
        ]
    return files


def test_no_machine_paths():
    """(f) No absolute path of the machine the code was written on; a test that needs a folder
    takes it from pytest's ``tmp_path`` or an environment variable."""
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}"
        for path in _checked_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not hits, "machine paths:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "text, machine",
    [
        ("cd /work/main && make", True),
        ("--out /tmp/audit", True),
        ('Path("/home/someone/data")', True),
        ("> /dev/null 2>&1", False),
        ("#!/usr/bin/env bash", False),
        ("https://github.com/NVIDIA/Megatron-LM/tree/main/tmp/x", False),
        ("examples/data/default_corpus.jsonl", False),
        ("${HOME}/tmp/x", False),
    ],
)
def test_the_machine_path_rule(text, machine):
    assert bool(MACHINE_PATH.search(text)) is machine


def test_the_checks_see_lazy_and_relative_imports():
    """The parser is not vacuous: it finds a lazy Megatron import, and resolves a package-relative
    ``from megatron_lossfix.integrations.megatron_lm import patches`` to the module, and sees what
    a framework's folder serves."""
    found = imports(f"{PACKAGE}.step.megatron_compat")
    assert any(target == "megatron.core.pipeline_parallel" for _, target, _ in found)
    assert f"{PACKAGE}.integrations.megatron_lm.patches" in _edges()[f"{PACKAGE}.patches"]
    served = _edges()[f"{PACKAGE}.integrations.bridge"]
    assert f"{PACKAGE}.integrations.bridge.adapter" in served


FRAMEWORKS = sorted(
    p.name for p in (ROOT / "integrations").iterdir() if p.is_dir() and p.name[0] != "_"
)


def test_each_framework_has_one_folder_laid_out_one_way():
    """``integrations/`` holds one folder per framework and no loose module; each folder's
    package serves its main module's names (``adapter``; Megatron-LM's patch calls
    ``training``), and each stack audit stands in ``audit/stacks/<framework>/stack.py``, beside a
    framework folder of the same name."""
    loose = sorted(p.name for p in (ROOT / "integrations").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a framework's folder in integrations/: {loose}"
    assert {"megatron_lm", "bridge", "verl", "skyrl", "slime"} <= set(FRAMEWORKS)
    for name in FRAMEWORKS:
        served = [t for _, t, _ in imports(f"{PACKAGE}.integrations.{name}") if _own(t)]
        main = f"{PACKAGE}.integrations.{name}.{'training' if name == 'megatron_lm' else 'adapter'}"
        assert main in served and main in MODULES, f"integrations/{name}/ does not serve {main}"
    stacks = sorted(p.name for p in (ROOT / "audit" / "stacks").iterdir() if p.is_dir())
    stacks = [s for s in stacks if s[0] != "_"]
    loose = sorted(
        p.name for p in (ROOT / "audit" / "stacks").glob("*.py")
        if p.name not in ("__init__.py", "modes.py")
    )  # fmt: skip
    assert not loose, f"stack modules outside a framework's folder in audit/stacks/: {loose}"
    for name in stacks:
        assert f"{PACKAGE}.audit.stacks.{name}.stack" in MODULES, f"audit/stacks/{name}/stack.py"
        assert name in FRAMEWORKS, f"audit/stacks/{name}/ has no integrations/{name}/ beside it"
