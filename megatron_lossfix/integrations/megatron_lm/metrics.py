"""``--lossfix-metrics-out`` under Megatron-LM: one JSON line per training step.

:func:`record_train_steps` wraps ``training.train_step`` so that the last rank appends the
step's loss and counts (:func:`record_numbers`), its grad norm with every digit (the log prints
3 decimals; comparisons across layouts need all of them), its time and the mode.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

__all__ = ["LOSS_KEY", "record_numbers", "record_train_steps"]

#: The report key Megatron-LM's ``pretrain_gpt.py`` logs as ``lm loss``.
LOSS_KEY = "lm loss"


def record_numbers(metrics: dict, logged: float | None) -> dict:
    """A metrics record's loss and counts: the plugin's; under ``off``, where the plugin sees
    nothing of the step, the loss Megatron logged and no counts."""
    return {
        "loss": metrics.get("loss", logged),
        "lm_loss": logged,
        "num_tokens": int(metrics["num_tokens"]) if "num_tokens" in metrics else None,
        "num_sequences": int(metrics["num_sequences"]) if "num_sequences" in metrics else None,
    }


def record_train_steps(wrapper: Any) -> None:
    """Make ``training.train_step`` append one JSON line per step to ``--lossfix-metrics-out``
    (``wrapper.metrics_out``) from the metrics of ``wrapper``, the step's
    :class:`~megatron_lossfix.integrations.megatron_lm.training.MegatronLMLossFix`.

    The log prints the grad norm with 3 decimals; comparisons across layouts need all of them.
    ``train()`` looks ``train_step`` up at every iteration, so wrapping the module attribute
    here (called from ``train()`` before its loop) takes effect for this run only.
    """
    from megatron.training import training

    train_step = training.train_step
    if getattr(train_step, "_lossfix_wrapped", False):
        train_step = train_step.__wrapped__
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    if last_rank:
        open(wrapper.metrics_out, "w").close()

    @functools.wraps(train_step)
    def recorded_train_step(*args: Any, **kwargs: Any) -> tuple:
        result = train_step(*args, **kwargs)
        metrics = wrapper.last_metrics
        if last_rank and metrics is not None:
            loss_dict, grad_norm = result[0], result[5]
            logged = loss_dict.get(LOSS_KEY) if isinstance(loss_dict, Mapping) else None
            logged = None if logged is None else float(logged)
            record = {
                "iteration": int(kwargs.get("iteration", 0) or 0) + 1,
                **record_numbers(metrics, logged),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "step_time_s": time.perf_counter() - wrapper._step_start,
                "reduction": wrapper.config.reduction,
            }
            with open(wrapper.metrics_out, "a") as out:
                out.write(json.dumps(record) + "\n")
        wrapper.last_metrics = None
        return result

    recorded_train_step._lossfix_wrapped = True
    training.train_step = recorded_train_step
