"""Rank functions and the pytest plugin for tests/test_roll_stack.py (module-level, so the rank
pool can pickle them and pytest can load the plugin with ``-p``, beside ``helpers.own_tests``)."""

from __future__ import annotations

from typing import Any

from helpers import own_tests


def bypassed_layout_grads(*args: Any, **kwargs: Any) -> Any:
    """The adapted rows with the adapter bypassed: the switch leaves ROLL's own functions (what
    a user gets whose step never reaches the plugin)."""
    from megatron_lossfix.audit.stacks.roll import ranks
    from megatron_lossfix.integrations import roll as adapter

    own = adapter.enable
    adapter.enable = lambda **kw: adapter.disable
    try:
        return ranks.roll_layout_grads(*args, **kwargs)
    finally:
        adapter.enable = own


def zeroed_mask_in_loss_grads(*args: Any, **kwargs: Any) -> Any:
    """The mask-in-loss row with its switch handing the adapter the zeroed meaning (what a user
    gets whose filtered tokens still count): its gradients must miss the excluded objective."""
    from megatron_lossfix.audit.stacks.roll import ranks
    from megatron_lossfix.integrations import roll as adapter

    own = adapter.enable
    adapter.enable = lambda **kw: own()
    try:
        return ranks.roll_layout_grads(*args, **kwargs)
    finally:
        adapter.enable = own


def pytest_configure(config: Any) -> None:
    """``-p helpers.roll_stack``: ROLL's own tests run with the adapter switched on, as a ROLL
    run that called ``megatron_lossfix.integrations.roll.enable()`` has it: ROLL's ``agg_loss``
    (``roll.utils.functionals``, where its tests look it up) is the adapter's, which outside a
    training step must give what ROLL's gives; the calls through it are counted."""
    import roll.utils.functionals as functionals

    from megatron_lossfix.integrations.roll import adapter

    adapter.enable()
    patched = functionals.agg_loss
    calls = {"agg_loss": 0}

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["agg_loss"] += 1
        return patched(*args, **kwargs)

    functionals.agg_loss = counted
    config.roll_calls = calls

    def at_end() -> dict[str, Any]:
        from roll.distributed.strategy.megatron_strategy import MegatronTrainStrategy

        on = MegatronTrainStrategy.train_step is adapter.lossfix_train_step
        return {"still_on": on and patched is adapter._agg_loss, "calls": dict(calls)}

    own_tests.report_at_end(at_end)


def pytest_terminal_summary(terminalreporter: Any, config: Any) -> None:
    calls = getattr(config, "roll_calls", {})
    terminalreporter.write_line(f"megatron_lossfix ROLL adapter on; agg_loss calls: {calls}")
