"""Rank functions for tests/test_skyrl_stack.py (module-level, so the rank pool can pickle them)."""

from __future__ import annotations

from typing import Any


def bypassed_layout_grads(*args: Any, **kwargs: Any) -> Any:
    """The adapted row with the adapter bypassed: ``LossFixModelWrapper`` runs SkyRL's own
    ``forward_backward_mini_batch`` on the raw advantages (what a user gets who swaps the class
    but whose step never reaches the plugin)."""
    from megatron_lossfix.audit.stacks.skyrl.stack import provide_bridge_finalizer

    provide_bridge_finalizer()
    from skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper import (
        MegatronModelWrapper,
    )

    from megatron_lossfix.audit.stacks.skyrl.stack import skyrl_layout_grads
    from megatron_lossfix.integrations.skyrl import adapter

    cls = adapter.LossFixModelWrapper
    own = cls.forward_backward_mini_batch
    cls.forward_backward_mini_batch = MegatronModelWrapper.forward_backward_mini_batch
    try:
        return skyrl_layout_grads(*args, rows=("skyrl+lossfix",), **kwargs)
    finally:
        cls.forward_backward_mini_batch = own
