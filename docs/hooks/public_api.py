"""The API reference is complete: every name in ``megatron_lossfix.__all__`` has a docstring and
an entry on docs/api.md (a missing one fails ``mkdocs build --strict``).

Read with ``ast``, without importing the package (the docs build needs no torch)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.public_api")
REPO = Path(__file__).resolve().parents[2]


def public_names() -> dict[str, str]:
    """``__all__`` of the package, each name mapped to the module it is imported from."""
    tree = ast.parse((REPO / "megatron_lossfix" / "__init__.py").read_text())
    origin = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    names = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
    )
    return {name: origin.get(name, "megatron_lossfix") for name in names}


def has_docstring(module: str, name: str) -> bool:
    """A function or class with a docstring, or a constant with a ``#:`` comment above it."""
    path = REPO / (module.replace(".", "/") + ".py")
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return ast.get_docstring(node) is not None
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        if any(getattr(t, "id", None) == name for t in targets):
            above = source.splitlines()[node.lineno - 2].strip()
            return above.startswith("#:")
    return False


def on_page_markdown(markdown: str, page, **_) -> str:
    if page.file.src_uri != "api.md":
        return markdown
    for name, module in public_names().items():
        if f"::: megatron_lossfix.{name}" not in markdown:
            log.warning(f"docs/api.md has no entry '::: megatron_lossfix.{name}'")
        if not has_docstring(module, name):
            log.warning(f"{module}.{name} is public (in __all__) but has no docstring")
    return markdown
