"""Framework stacks the audit can check instead of the plugin alone (``--stack NAME``).

Each entry names a module with ``run_stack(opts, *, pool=None, progress=None) -> StackReport``;
it is imported only when chosen, so the audit never needs a framework it does not audit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["STACKS", "stack_runner"]

#: ``--stack`` name -> module holding its ``run_stack``.
STACKS: dict[str, str] = {
    "skyrl": "megatron_lossfix.audit.stacks.skyrl",
}


def stack_runner(name: str) -> Callable[..., Any]:
    """The ``run_stack`` of stack ``name`` (imports its module)."""
    if name not in STACKS:
        raise ValueError(f"unknown stack {name!r}; choose from {', '.join(STACKS)}")
    return importlib.import_module(STACKS[name]).run_stack
