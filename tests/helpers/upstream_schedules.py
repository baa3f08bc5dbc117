"""A pytest plugin that runs Megatron-Core's own pipeline-schedule tests with the plugin swapped in.

Megatron-LM's ``tests/unit_tests/pipeline_parallel/test_schedules.py`` (any supported tag) is run
from a Megatron-LM checkout, one pytest per rank under torchrun::

    cd MEGATRON_LM_CHECKOUT
    LOSSFIX_SWAP=off PYTHONPATH=MEGATRON_LOSSFIX_REPO/tests torchrun --nproc-per-node 8 \\
        -m pytest -o addopts= --noconftest -p helpers.upstream_schedules \\
        tests/unit_tests/pipeline_parallel/test_schedules.py

``LOSSFIX_SWAP`` picks what the tests call: ``stock`` (Megatron's schedules, for the baseline) or
a reduction mode, for which each of Megatron's three schedules
(``forward_backward_no_pipelining``, ``..._pipelining_without_interleaving``,
``..._pipelining_with_interleaving``) is replaced, in ``megatron.core.pipeline_parallel
.schedules`` where the tests and ``get_forward_backward_func`` find it, by
``LossFixSchedule(LossFixConfig(reduction=mode), forward_backward_func=<that schedule>)``.

The tests hard-code NCCL and CUDA; here they run on CPU: ``init_process_group`` gets gloo,
``torch.cuda.device_count()`` answers 1 (the tests compute ``rank % device_count()``) and
``enable_cpu_megatron`` bridges the rest, and the process group times out after
``LOSSFIX_PG_TIMEOUT_S`` seconds (120 by default): on gloo,
``test_forward_backward_pipelining_without_interleaving_with_custom_pgs`` sometimes deadlocks,
stock and swapped alike (it creates its embedding groups with ``dist.new_group`` called with a
different rank list on each rank, which NCCL tolerates and gloo's eager connection setup may
not). Nothing of Megatron's code is kept in this repository;
``tests/test_upstream_schedules.py`` drives this plugin on trees from ``MEGATRON_LM_ARCHIVES``.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from megatron_lossfix.harness.cpu_megatron import enable_cpu_megatron
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.step.schedule import LossFixSchedule

SCHEDULES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
ENV = "LOSSFIX_SWAP"
TIMEOUT_ENV = "LOSSFIX_PG_TIMEOUT_S"
#: A folder where each rank writes ``rank<RANK>.json``: test id -> PASSED, FAILED, ERROR or
#: SKIPPED. Read from files, not from the ranks' interleaved output, whose summary lines eight
#: processes writing to one pipe can cut or merge.
OUTCOMES_ENV = "LOSSFIX_OUTCOMES_DIR"
_OUTCOMES: dict[str, str] = {}


def _use_gloo() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    init = dist.init_process_group
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "120")))

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") in (None, "nccl") and not args:
            kwargs["backend"] = "gloo"
        elif args and args[0] == "nccl":
            args = ("gloo", *args[1:])
        # A test that deadlocks (see the module docstring) fails after this, instead of after
        # the default 30 minutes.
        kwargs.setdefault("timeout", timeout)
        return init(*args, **kwargs)

    dist.init_process_group = init_process_group
    new_group = dist.new_group

    def bounded_new_group(*args: Any, **kwargs: Any) -> Any:
        # Subgroups default to 30 minutes (Megatron passes its own 30): bound them too.
        given = kwargs.get("timeout")
        kwargs["timeout"] = timeout if given is None else min(given, timeout)
        return new_group(*args, **kwargs)

    # new_subgroups_by_enumeration (HyperCommGrid) finds it in distributed_c10d's globals.
    dist.new_group = distributed_c10d.new_group = bounded_new_group
    if torch.cuda.device_count() == 0:
        torch.cuda.device_count = lambda: 1


def swap_schedules(mode: str) -> dict[str, Any]:
    """Replace Megatron's three schedules by the plugin wrapping each; returns the originals."""
    import megatron.core.pipeline_parallel.schedules as schedules

    originals = {name: getattr(schedules, name) for name in SCHEDULES}
    for name, stock in originals.items():
        setattr(
            schedules,
            name,
            # Megatron's tests count their own forward steps: no first-step re-runs.
            LossFixSchedule(
                LossFixConfig(reduction=mode, self_check=False), forward_backward_func=stock
            ),
        )
    return originals


def pytest_configure(config: Any) -> None:
    mode = os.environ.get(ENV, "stock")
    _use_gloo()
    enable_cpu_megatron()
    if mode != "stock":
        swap_schedules(mode)
    config.addinivalue_line("markers", "internal: Megatron-LM's marker for internal functions")


def pytest_report_header(config: Any) -> str:
    return f"megatron_lossfix: {ENV}={os.environ.get(ENV, 'stock')} (gloo, CPU bridge)"


def pytest_runtest_logreport(report: Any) -> None:
    """Each test's outcome on this rank: its call's, or ERROR where its setup or teardown
    failed (a failure is never overwritten by a later phase's pass)."""
    if report.when == "call":
        kind = {"passed": "PASSED", "failed": "FAILED", "skipped": "SKIPPED"}[report.outcome]
    elif report.failed:
        kind = "ERROR"
    elif report.skipped:  # skipped in its setup (a skip marker)
        kind = "SKIPPED"
    else:
        return
    if _OUTCOMES.get(report.nodeid) not in ("FAILED", "ERROR"):
        _OUTCOMES[report.nodeid] = kind


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    folder = os.environ.get(OUTCOMES_ENV)
    if folder:
        rank = os.environ.get("RANK", "0")
        Path(folder, f"rank{rank}.json").write_text(json.dumps(_OUTCOMES))


def pytest_unconfigure(config: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
