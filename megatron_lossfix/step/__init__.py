"""The Megatron step: one ``forward_backward_func`` call, normalized exactly (docs/design.md §6).

Read in the order a step runs: ``schedule`` (``LossFixSchedule``) calls ``driver`` (``Step``),
which reads the micro-batches (``read``), agrees on the counts with the other ranks (``agree``,
``agreement``), weighs them (``weigh``, with ``mtp``), wraps each micro-batch for Megatron's
schedule (``microbatch``), and settles the step after it (``after``), writing its
``record``. Around it: the ``counting_pass``, the first-step ``selfcheck`` (a package: the
check's phases, how it re-splits a step and how it compares gradients), the step's
``metrics``, and what differs between Megatron's releases and data-parallel wrappers
(``megatron_compat``, ``wrappers``).
"""

from __future__ import annotations

import warnings
from typing import Any

#: Names that ``megatron_lossfix.step`` held when it was one module; kept for one release.
_MOVED = {"Step": "driver", "StepRecord": "record", "StepData": "record"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = f"{__name__}.{_MOVED[name]}"
    warnings.warn(
        f"megatron_lossfix.step.{name} moved to {module}.{name}; the old address goes in the "
        "next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
