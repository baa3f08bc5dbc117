"""Framework stacks the audit can check instead of the plugin alone (``--stack NAME``).

``STACKS`` maps a name to its runner, ``runner(opts, *, pool, progress, terms, own_modes,
own_layouts) -> report`` (a report with ``to_json()``, ``table()`` and ``passed``). A runner
imports its framework only when called, so the audit never needs a framework it does not audit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["STACKS"]


def _skyrl(*args: Any, **kwargs: Any) -> Any:
    from megatron_lossfix.audit.stacks import skyrl

    return skyrl.run_stack(*args, **kwargs)


#: ``--stack`` name -> runner.
STACKS: dict[str, Callable[..., Any]] = {"skyrl": _skyrl}
