"""Integrations with the training loops that run Megatron-Core: one folder per framework, each
laid out one way.

* ``<framework>/adapter.py``: what a user switches on; the folder's package serves the adapter's
  names at ``megatron_lossfix.integrations.<framework>`` (the documented address).
* ``<framework>/cpu.py``: that framework's training loop on a machine without CUDA, where it
  needs more than :mod:`megatron_lossfix.harness.cpu_megatron`.
* the framework's own plumbing beside them, named by what it does.

Folders: ``megatron_lm`` (Megatron-LM: what the patched ``pretrain_gpt.py`` and ``training.py``
call in ``training``, the patch tool ``patches``, and ``rl`` with the RL replay's ``rl_*`` for
``train_rl.py``), ``bridge`` (Megatron Bridge), ``verl``, ``skyrl``, ``slime``. A framework's
stack audit (``python -m megatron_lossfix audit --stack NAME``) stands in the audit layer, in
``megatron_lossfix/audit/stacks/<framework>/``, laid out the same way.

Built on the layers below; imported by module name, never by ``import megatron_lossfix``,
because these modules import Megatron-LM, Bridge or an RL framework.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def serve(package: str, module: str) -> Callable[[str], Any]:
    """A package's module-level ``__getattr__`` that serves the names of its module ``module``
    (imported on first use), so that ``package.name`` is ``package.module.name``."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
