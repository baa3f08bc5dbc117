"""Rank functions and the pytest plugin for tests/test_slime_stack.py (module-level, so the rank
pool can pickle them and pytest can load the plugin with ``-p``, beside ``helpers.own_tests``)."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from helpers import own_tests


def bypassed_layout_grads(*args: Any, **kwargs: Any) -> Any:
    """The adapted row with the adapter bypassed: the switch hands slime Megatron's own schedule
    (what a user gets whose step never reaches the plugin)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lossfix.audit.stacks.slime.stack import slime_layout_grads
    from megatron_lossfix.integrations.slime import adapter

    own = adapter.enable

    def bypass(slime_args: Any, **kwargs: Any) -> Any:
        from slime.backends.megatron_utils import model as slime_model

        fbf = get_forward_backward_func()
        slime_model.get_forward_backward_func = lambda *a, **k: fbf
        return fbf

    adapter.enable = bypass
    try:
        return slime_layout_grads(*args[:5], rows=("slime+lossfix",), settings=args[6])
    finally:
        adapter.enable = own


def zeroed_mask_in_loss_grads(*args: Any, **kwargs: Any) -> Any:
    """The mask-in-loss row with its switch handing the adapter the zeroed meaning (what a user
    gets whose dropped tokens still count): its gradients must miss the excluded objective."""
    from megatron_lossfix.audit.stacks.slime.ranks import EXCLUDED_ROW, slime_layout_grads
    from megatron_lossfix.integrations.slime import adapter

    own = adapter.enable_mask_in_loss
    adapter.enable_mask_in_loss = adapter.enable
    try:
        return slime_layout_grads(*args[:5], rows=(EXCLUDED_ROW,), settings=args[6])
    finally:
        adapter.enable_mask_in_loss = own


def pytest_configure(config: Any) -> None:
    """``-p helpers.slime_stack``: slime's own tests run with the adapter switched on, as a slime
    run with ``--custom-megatron-init-path megatron_lossfix.integrations.slime.enable`` has it:
    Megatron-Core on the CPU, and slime's schedule lookup answered by the adapter."""
    import megatron_lossfix
    from megatron_lossfix.integrations.slime import adapter

    megatron_lossfix.enable_cpu_megatron()
    _one_rank_megatron()
    fbf = adapter.enable(Namespace(calculate_per_token_loss=False))
    from slime.backends.megatron_utils import model as slime_model

    assert slime_model.get_forward_backward_func() is fbf
    config.slime_adapter = fbf

    def at_end() -> dict[str, Any]:
        # slime's own tests call its reducer and policy loss directly: the adapter's own loss
        # call (which replaces the reducer while it runs) is not reached, only its switch.
        return {"adapter": f"{type(fbf).__name__} ({fbf.config.reduction})",
                "still_on": slime_model.get_forward_backward_func() is fbf}  # fmt: skip

    own_tests.report_at_end(at_end)


def _one_rank_megatron() -> None:
    """Megatron-Core's parallel state on one gloo rank (every size 1): slime's CPU tests stand
    a stub in for ``megatron.core.mpu`` that says CP = 1, which the real module, imported with
    the adapter, says only once initialized."""
    import os
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def pytest_report_header(config: Any) -> str:
    fbf = getattr(config, "slime_adapter", None)
    return f"megatron_lossfix slime adapter on: {type(fbf).__name__} ({fbf.config.reduction})"
