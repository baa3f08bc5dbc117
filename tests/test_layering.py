"""The package's layers point one way (docs/design.md §6).

Every module under ``megatron_lossfix/`` is parsed with ``ast``; its imports are read wherever
they stand (module level, inside functions, under ``if TYPE_CHECKING:``). Nothing is imported,
so the test runs in a fraction of a second and sees lazy imports too.

Layers, lowest first; a module may import its own layer and the ones below:

0. math: the reduction math and losses, plain PyTorch; never imports Megatron.
1. Megatron glue: the schedule, its metrics and self-check, flags, version differences.
2. integrations: Megatron-LM, Megatron Bridge, LoRA, the CPU bridge, the patch tool.
3. the package's ``__init__``: the public names, re-exported from layers 0-2.
4. verification harness: ``megatron_lossfix.testing`` and the audit built on it.

``megatron_lossfix.__main__`` is the command-line dispatcher: a top-level entry point that may
import anything (it does so lazily, by module name, so that ``--help`` stays cheap) and that no
module imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = "megatron_lossfix"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

MATH, GLUE, INTEGRATION, API, HARNESS, ENTRY = range(6)
LAYER_NAMES = ("math", "Megatron glue", "integration", "package API", "harness", "entry point")

LAYERS: dict[str, int] = {
    # math
    "reduction": MATH,
    "config": MATH,
    "losses": MATH,
    "policy_losses": MATH,
    "rl_losses": MATH,
    "logprobs": MATH,
    "datasets": MATH,
    "resplit": MATH,
    # Megatron glue
    "megatron_compat": GLUE,
    "agreement": GLUE,
    "metrics": GLUE,
    "mtp": GLUE,
    "batches": GLUE,
    "lossfunc": GLUE,
    "stock": GLUE,
    "schedule": GLUE,
    "selfcheck_model": GLUE,
    "selfcheck": GLUE,
    "args": GLUE,
    # integrations
    "cpu_compat": INTEGRATION,
    "cpu_megatron_lm": INTEGRATION,
    "cpu_megatron_bridge": INTEGRATION,
    "lora": INTEGRATION,
    "megatron_lm": INTEGRATION,
    "bridge": INTEGRATION,
    "patches": INTEGRATION,
    "training": INTEGRATION,
    "seeded_params": INTEGRATION,
    # the package's public names
    "": API,
    # verification harness
    "audit": HARNESS,
    "audit_report": HARNESS,
    "audit_options": HARNESS,
    "testing": HARNESS,
    "testing.*": HARNESS,
    # command-line dispatcher
    "__main__": ENTRY,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    short = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    if short in LAYERS:
        return LAYERS[short]
    parent = short.rpartition(".")[0]
    if parent and f"{parent}.*" in LAYERS:
        return LAYERS[f"{parent}.*"]
    raise AssertionError(f"{module} has no layer: add it to LAYERS (and docs/design.md §6)")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` reads from."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[int, str, str | None]]:
    """``(line, imported module, imported name or None)`` for every import in ``module``.

    ``from megatron_lossfix import patches`` imports the module ``megatron_lossfix.patches``;
    ``from megatron_lossfix import LossFixSchedule`` imports a name of the package itself.
    """
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append((node.lineno, submodule, None))
                else:
                    found.append((node.lineno, source, alias.name))
    return found


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
    """(a) No module imports a higher layer: runtime code never imports the harness, the math
    layer never imports Megatron, and nothing imports the command-line dispatcher."""
    own = layer_of(module)
    wrong = []
    for line, target, _ in imports(module):
        if _own(target):
            if target not in MODULES:
                wrong.append(f"line {line}: {target} is not a module of the package")
            elif layer_of(target) > own:
                wrong.append(f"line {line}: {target} ({LAYER_NAMES[layer_of(target)]})")
        elif own == MATH and (target == "megatron" or target.startswith("megatron.")):
            wrong.append(f"line {line}: {target} (Megatron, from the math layer)")
    assert not wrong, f"{module} ({LAYER_NAMES[own]}) imports upward:\n" + "\n".join(wrong)


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


def test_the_checks_see_lazy_and_relative_imports():
    """The parser is not vacuous: it finds a lazy Megatron import, and resolves a package-relative
    ``from megatron_lossfix import patches`` to the module."""
    found = imports(f"{PACKAGE}.megatron_compat")
    assert any(target == "megatron.core.pipeline_parallel" for _, target, _ in found)
    assert f"{PACKAGE}.patches" in _edges()[f"{PACKAGE}.testing.megatron_lm_run"]
