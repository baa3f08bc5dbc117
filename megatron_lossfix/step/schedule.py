"""``LossFixSchedule``: the drop-in ``forward_backward_func`` (docs/design.md §3, §5, §9).

It composes three pieces that know nothing of one another's insides: the step
(:class:`~megatron_lossfix.step.driver.Step`: read, agree, weigh, wrap, scale), the self-check of
the first training step unless the config opts out
(:class:`~megatron_lossfix.step.selfcheck.SelfCheck`, which runs the step and keeps its record), and
the step's global metrics (:func:`~megatron_lossfix.step.metrics.reduce_step_metrics` of that
record).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.modes import DEFAULT_MODE
from megatron_lossfix.step.driver import Step, StepRecord
from megatron_lossfix.step.metrics import reduce_step_metrics
from megatron_lossfix.step.selfcheck import first_step_check

__all__ = ["LossFixSchedule"]


class LossFixSchedule:
    """Megatron ``forward_backward_func`` with exact, layout-invariant loss normalization.

    Loss functions return ``(sum(weights * per_token_loss), num_tokens, report)`` with
    ``weights = batch[config.weights_key]`` (``weighted_loss`` builds it); with
    ``calculate_per_token_loss=False`` the 2-tuple ``(sum(weights * loss), report)`` works too.

    Args:
        config: the plugin configuration, or a mode name for its defaults.
        forward_backward_func: Megatron's schedule to wrap; by default Megatron's for the
            call's pipeline group and model chunks.
        pg_collection: process groups for calls that pass none; else ``parallel_state``.
    """

    def __init__(
        self,
        config: LossFixConfig | str,
        forward_backward_func: Callable[..., Any] | None = None,
        pg_collection: Any = None,
    ) -> None:
        if isinstance(config, str):
            config = LossFixConfig(reduction=config)
        elif not isinstance(config, LossFixConfig):
            raise TypeError(
                f"LossFixSchedule takes a LossFixConfig or a mode name such as {DEFAULT_MODE!r}, "
                f"got {type(config).__name__} {config!r:.60}; build one with "
                "LossFixConfig(reduction=...) (from flags: schedule_from_args(args))"
            )
        if forward_backward_func is not None and not callable(forward_backward_func):
            raise TypeError(
                "forward_backward_func must be Megatron's schedule function (callable) or None, "
                f"got {type(forward_backward_func).__name__}"
            )
        self.config = config
        self.step = Step(config, forward_backward_func, pg_collection)
        """The step itself, without the self-check."""
        self.self_check = first_step_check(config)
        """The first-step re-split check (on unless ``config.self_check=False``; None in
        ``off``), with what it measured."""

    @property
    def last_step(self) -> StepRecord | None:
        """This rank's record of the last step (None before the first, after a refused one)."""
        return self.step.last_step

    def __call__(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        **kwargs: Any,
    ) -> Any:
        call = dict(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            **kwargs,
        )
        if self.self_check is not None and self.self_check.due(call):
            return self.self_check.run(self.step, call)
        return self.step(**call)

    def step_metrics(self) -> dict[str, float]:
        """The last step's global metrics, on every rank (collectives over DP x CP and PP).

        ``loss`` is L (docs/design.md §2), ``num_tokens`` N, ``num_sequences`` S,
        ``mtp_loss_<j>`` each MTP layer's; 0-dim report entries named ``*_sum``/``*_count``,
        ``*_max``, ``*_min`` are summed, maxed, minimized over DP x CP. With ``off`` only the
        reports Megatron returned are reduced, by the same rules.
        """
        return reduce_step_metrics(self.step.last_step)
