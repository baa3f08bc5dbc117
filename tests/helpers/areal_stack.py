"""Rank functions and the pytest plugin for tests/test_areal_stack.py (module-level, so the rank
pool can pickle them and pytest can load the plugin with ``-p``, beside ``helpers.own_tests``)."""

from __future__ import annotations

from typing import Any

from helpers import own_tests


def bypassed_layout_grads(*args: Any, **kwargs: Any) -> Any:
    """The adapted row with the adapter bypassed: the switch leaves AReaL's own ``train_batch``
    (what a user gets whose step never reaches the plugin)."""
    from megatron_lossfix.audit.stacks.areal import ranks
    from megatron_lossfix.integrations import areal as adapter

    own = adapter.enable
    adapter.enable = lambda **kw: adapter.disable
    try:
        return ranks.areal_layout_grads(*args[:4], rows=(ranks.ADAPTED_ROW,), settings=args[5])
    finally:
        adapter.enable = own


def zeroed_mask_in_loss_grads(*args: Any, **kwargs: Any) -> Any:
    """The mask-in-loss row with its switch handing the adapter the zeroed meaning (what a user
    gets whose dropped tokens still count): its gradients must miss the excluded objective."""
    from megatron_lossfix.audit.stacks.areal import ranks
    from megatron_lossfix.integrations import areal as adapter

    own = adapter.enable
    adapter.enable = lambda **kw: own()
    try:
        return ranks.areal_layout_grads(*args[:4], rows=(ranks.EXCLUDED_ROW,), settings=args[5])
    finally:
        adapter.enable = own


class _Hooks:
    """The adapter's loss-time hooks, held open for the session, and what they saw."""

    def __init__(self) -> None:
        import contextlib

        from megatron_lossfix.integrations.areal import adapter
        from megatron_lossfix.runtime.config import LossFixConfig

        self.seen: dict[str, Any] = {}
        self.calls = {"m2po": 0, "rejection": 0}
        step = adapter._Step(LossFixConfig(reduction=adapter.AREAL_MODE), lambda *a: None, None)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(adapter._recording(step, 0, self.seen))
        self._count()

    def _count(self) -> None:
        """Count the calls that go through the hooks (AReaL's module globals, as installed)."""
        from areal.trainer.ppo import actor
        from areal.utils.functional import functional

        hooked = {"m2po": (actor, "_apply_m2po_masking"),
                  "rejection": (functional, "apply_rejection_sampling")}  # fmt: skip
        for name, (module, attr) in hooked.items():
            inner = getattr(module, attr)

            def counted(*a: Any, _inner: Any = inner, _name: str = name, **k: Any) -> Any:
                self.calls[_name] += 1
                return _inner(*a, **k)

            setattr(module, attr, counted)
            self._stack.callback(setattr, module, attr, inner)

    def close(self) -> None:
        self._stack.close()


def pytest_configure(config: Any) -> None:
    """``-p helpers.areal_stack``: AReaL's own tests run with the adapter switched on, as an
    AReaL run that called ``megatron_lossfix.integrations.areal.enable()`` has it (its engine's
    ``train_batch`` is the adapter's), and with the adapter's loss-time hooks installed for the
    whole session (M2PO's mask and rejection sampling, which the adapter's step routes through
    its recorders): AReaL's loss functions must give what they give without them."""
    from megatron_lossfix.audit.stacks.areal.ranks import provide_megatron_bridge
    from megatron_lossfix.integrations import areal as adapter

    provide_megatron_bridge()
    adapter.enable()
    from areal.engine.megatron_engine import MegatronEngine

    schedule = MegatronEngine.train_batch.lossfix_schedule
    config.areal_adapter = schedule
    config.areal_hooks = hooks = _Hooks()

    def at_end() -> dict[str, Any]:
        on = getattr(MegatronEngine.train_batch, "lossfix_schedule", None) is schedule
        return {"adapter": f"train_batch ({schedule.config.reduction})", "still_on": on,
                "hook_calls": dict(hooks.calls), "hooks_recorded": sorted(hooks.seen)}  # fmt: skip

    own_tests.report_at_end(at_end)


def pytest_unconfigure(config: Any) -> None:
    hooks = getattr(config, "areal_hooks", None)
    if hooks is not None:
        hooks.close()


def _adapter_line(config: Any) -> str:
    schedule = getattr(config, "areal_adapter", None)
    return f"megatron_lossfix AReaL adapter on: train_batch ({schedule.config.reduction})"


def pytest_report_header(config: Any) -> str:
    return _adapter_line(config)


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    """Also under ``-q`` (which drops the header): the switch, and the hooks' calls."""
    hooks = getattr(config, "areal_hooks", None)
    if hooks is not None:
        calls = ", ".join(f"{k} {v}" for k, v in hooks.calls.items())
        terminalreporter.write_line(f"{_adapter_line(config)}; loss hooks called: {calls}")
