"""Rank functions and the pytest plugin for tests/test_nemo_rl_stack.py (module-level, so the
rank pool can pickle them and pytest can load the plugin with ``-p``, beside
``helpers.own_tests``)."""

from __future__ import annotations

import contextlib
from typing import Any

from helpers import own_tests


def bypassed_layout_grads(*args: Any, **kwargs: Any) -> Any:
    """The adapted rows with the adapter bypassed: its switch does nothing (what a user gets
    whose worker never calls ``enable()``)."""
    from megatron_lossfix.audit.stacks.nemo_rl.ranks import nemo_rl_layout_grads
    from megatron_lossfix.integrations.nemo_rl import adapter

    own = adapter.enabled
    adapter.enabled = lambda on=True: contextlib.nullcontext()
    try:
        return nemo_rl_layout_grads(*args, **kwargs)
    finally:
        adapter.enabled = own


def pytest_configure(config: Any) -> None:
    """``-p helpers.nemo_rl_stack``: NeMo-RL's own tests run with the adapter switched on, as a
    NeMo-RL worker process that called ``enable()`` has it (its Megatron modules imported on
    CPU as the stack audit imports them)."""
    from megatron_lossfix.audit.stacks.nemo_rl.cpu import prepare_nemo_rl_imports
    from megatron_lossfix.integrations.nemo_rl import adapter

    prepare_nemo_rl_imports()
    adapter.enable()
    config.nemo_rl_adapter = adapter

    def at_end() -> dict[str, Any]:
        return {"still_on": adapter.is_enabled(), "hook_calls": adapter.hook_calls()}

    own_tests.report_at_end(at_end)


def pytest_report_header(config: Any) -> str:
    return "megatron_lossfix nemo-rl adapter on"
