"""Megatron Bridge integration: the plugin's schedule inside Bridge's own training loop.

Bridge (``megatron.bridge``) trains through ``pretrain(config, forward_step_func)`` /
``finetune(...)``; its ``train()`` builds the step's ``forward_backward_func`` from the module
global ``megatron.bridge.training.train.get_forward_backward_func``. Two pieces:

- :func:`enable_bridge` replaces that global, so that every training step runs through
  :class:`BridgeLossFix` (:class:`~megatron_lossfix.LossFixSchedule` plus Bridge's plumbing);
  :func:`disable_bridge` puts Bridge's own back. Idempotent; calling it again changes the config.
- :func:`lossfix_forward_step` is Bridge's ``gpt_step.forward_step`` (same batches, model
  providers, packed THD data and context-parallel slicing) whose loss uses the micro-batch's
  plugin weights: ``sum(w * l)``. Where no weights are attached (evaluation, or the plugin
  disabled) it is exactly Bridge's ``masked_next_token_loss``.

Bridge logs ``lm loss`` as the sum over micro-batches and the DP x CP group of ``[sum, count]``
pairs, divided. The plugin reports ``[contribution to L, indicator]`` with the indicator 1 on
exactly one micro-batch of one DP x CP rank, so the logged ``lm loss`` is L of the step.

Evaluation stays stock Bridge (its ``evaluate`` keeps Megatron's schedule): Bridge sums
``[masked loss sum, token count]`` over every evaluation micro-batch and rank before dividing,
which already is the exact global token mean.

Importing this module imports neither Bridge nor Megatron.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.integrations.megatron_lm.batches import MasksToDevice
from megatron_lossfix.integrations.megatron_lm.metrics import LOSS_KEY, record_numbers
from megatron_lossfix.integrations.megatron_lm.training import MegatronLMLossFix
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.process_groups import StepGroups

__all__ = [
    "BridgeLossFix",
    "bridge_cu_seqlens",
    "disable_bridge",
    "enable_bridge",
    "lossfix_forward_step",
]

#: Where the plugin finds a packed micro-batch's sequence boundaries (Bridge's own keys hold them
#: as ``[1, n]`` with padding sentinels; this one holds the plain 1-D form).
_CU_SEQLENS_KEY = "lossfix_cu_seqlens"


def bridge_cu_seqlens(batch: Mapping) -> torch.Tensor | None:
    """A packed Bridge micro-batch's sequence boundaries, 1-D and trimmed; None when not packed.

    Bridge's packed (THD) batches carry ``cu_seqlens_q`` (and ``cu_seqlens_q_padded``) or the
    legacy ``cu_seqlens`` padded with negative sentinels (``cu_seqlens_argmin`` marks the end),
    each with a leading micro-batch dimension of 1. Token positions follow the padded boundaries
    when given (padding between sequences carries no loss and lands in the preceding sequence).
    """
    cu = None
    argmin = None
    for key in ("cu_seqlens_q_padded", "cu_seqlens_q", "cu_seqlens"):
        if batch.get(key) is not None:
            cu = batch[key]
            argmin = batch.get("cu_seqlens_argmin") if key == "cu_seqlens" else None
            break
    if cu is None:
        return None
    if cu.dim() > 1:
        if cu.shape[0] != 1:
            raise ValueError(
                f"packed micro-batches hold one packed row (micro-batch size 1); cu_seqlens has "
                f"shape {tuple(cu.shape)}"
            )
        cu = cu[0]
    if argmin is not None:
        # Host tensor from Bridge's packed datasets, like the one its get_batch reads.
        cu = cu[: int(torch.as_tensor(argmin).reshape(-1)[0])]
    else:
        negative = torch.nonzero(cu < 0)
        if negative.numel():
            cu = cu[: int(negative[0, 0])]
    return cu


class _LossStageBatches:
    """Adds the 1-D sequence boundaries of packed micro-batches for the plugin's counting."""

    def __init__(self, source: Iterator) -> None:
        self._source = source

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._source)
        if isinstance(batch, Mapping):
            cu = bridge_cu_seqlens(batch)
            if cu is not None:
                batch = {**batch, _CU_SEQLENS_KEY: cu}
        return batch


class BridgeLossFix(MegatronLMLossFix):
    """Bridge's ``forward_backward_func`` with exact, layout-invariant normalization.

    What it adds to Megatron-LM's wrapper is Bridge's data layout: every tensor-parallel rank
    has its own data iterator (no mask broadcast), packed micro-batches carry their boundaries
    as ``[1, n]`` tensors. ``last_metrics`` holds the step's global metrics (every rank) when
    ``record_metrics`` is on.

    Args:
        config: the plugin configuration (``off``: stock Megatron).
        forward_backward_func: the schedule Bridge's ``get_forward_backward_func`` returned.
        record_metrics: compute ``step_metrics()`` after every step (collectives over DP x CP
            and PP on every rank).
    """

    def __init__(
        self,
        config: LossFixConfig,
        forward_backward_func: Callable[..., Any],
        record_metrics: bool = False,
    ) -> None:
        # Sequence boundaries of packed batches come from Bridge's keys (see _LossStageBatches).
        # The first step is checked as in Megatron-LM's loop, packed micro-batches included.
        super().__init__(
            dataclasses.replace(config, cu_seqlens_key=_CU_SEQLENS_KEY), forward_backward_func
        )
        self.user_config = config
        # MegatronLMLossFix computes step metrics when it has somewhere to write them.
        self.metrics_out = "" if record_metrics else None

    def _loss_stage_iterators(self, data_iterator: Any, tp_group: Any, tp_rank: int) -> Any:
        key = self.config.loss_mask_key
        iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
        if iterators[-1] is not None:
            iterators[-1] = MasksToDevice(_LossStageBatches(iterators[-1]), key, None)
        return iterators if isinstance(data_iterator, list) else iterators[0]

    def _wrap_forward_step(
        self, forward_step_func: Callable, tp_rank: int, groups: StepGroups
    ) -> Callable:
        if groups.cp_size > 1 and self.config.reduction != "off":
            inner = forward_step_func

            def forward_step_func(data_iterator: Any, model: Any, *args: Any, **kw: Any) -> tuple:
                result = inner(data_iterator, model, *args, **kw)
                batch = getattr(data_iterator, "last", None)  # what the step read, if recorded
                if isinstance(batch, Mapping) and batch.get(_CU_SEQLENS_KEY) is not None:
                    # Bridge then splits each packed sequence over the CP ranks; the weights
                    # would be sliced as one dense row.
                    raise NotImplementedError(
                        "megatron_lossfix: packed (THD) batches with context parallelism are "
                        "not supported with the plugin yet; use context_parallel_size=1"
                    )
                return result

        # Every TP rank reads its own micro-batches in Bridge.
        return super()._wrap_forward_step(forward_step_func, 0, groups)


# ---------------------------------------------------------------------------------- the step
def lossfix_forward_step(
    state: Any, data_iterator: Any, model: Any, return_schedule_plan: bool = False
) -> tuple:
    """Bridge's GPT ``forward_step`` whose loss uses the plugin's per-token weights.

    Pass it to ``pretrain``/``finetune`` in place of ``megatron.bridge.training.gpt_step
    .forward_step``. The batch, the model call (packed sequences, MTP, context-parallel slicing)
    are Bridge's own; the returned loss function computes ``(sum(w * l), num_tokens, report)``
    with the weights :class:`BridgeLossFix` attached, or Bridge's ``masked_next_token_loss``
    when called without them (evaluation, plugin disabled).
    """
    from megatron.bridge.training import gpt_step

    output, loss_mask = gpt_step._forward_step_common(
        state, data_iterator, model, return_schedule_plan
    )
    rerun = state.cfg.rerun_state_machine
    stock = gpt_step._create_loss_function(
        loss_mask,
        check_for_nan_in_loss=rerun.check_for_nan_in_loss,
        check_for_spiky_loss=rerun.check_for_spiky_loss,
    )

    # BridgeLossFix binds `lossfix` (the name MegatronLMLossFix passes) on the loss stage.
    def loss_func(output_tensor: Any, lossfix: Callable | None = None) -> tuple:
        if lossfix is None:
            return stock(output_tensor)
        if isinstance(output_tensor, tuple):
            raise NotImplementedError(
                "megatron_lossfix: models that return (losses, new_loss_mask) (Bridge's VLMs) "
                "change the loss mask inside the model; the plugin's weights cannot follow"
            )
        return lossfix(output_tensor)

    return output, loss_func


# ---------------------------------------------------------------------------------- switching
@dataclasses.dataclass
class _Installed:
    config: LossFixConfig
    metrics_out: str | None
    original_getter: Callable[..., Any]
    original_train_step: Callable[..., Any]
    current: BridgeLossFix | None = None


_INSTALLED: _Installed | None = None


def enable_bridge(
    config: LossFixConfig | Mapping[str, Any], *, metrics_out: str | None = None
) -> None:
    """Make Bridge's training loop (``pretrain``, ``finetune``) run the plugin's schedule.

    ``config`` is a :class:`~megatron_lossfix.LossFixConfig` (a kw-only dataclass, like the
    sections of Bridge's ``ConfigContainer``) or a mapping of its fields, e.g. the
    ``lossfix`` node of a Hydra/OmegaConf override set (``lossfix.reduction=sequence_mean``).
    Patches ``megatron.bridge.training.train.get_forward_backward_func`` (what ``train()``
    calls once, before its loop) to return a :class:`BridgeLossFix` around Bridge's schedule.
    Use :func:`lossfix_forward_step` as the forward step. With ``metrics_out``, global rank 0
    writes one JSON line per training iteration there: ``iteration``, ``loss`` (L; under ``off``
    what Bridge logs), ``lm_loss`` (what Bridge logs), ``grad_norm``, ``num_tokens``,
    ``num_sequences`` (None under ``off``), ``step_time_s``, ``reduction``. Call again to
    change the config; :func:`disable_bridge` undoes it.
    """
    global _INSTALLED
    if isinstance(config, Mapping):
        config = LossFixConfig(**config)
    if not isinstance(config, LossFixConfig):
        raise TypeError(
            f"config must be a LossFixConfig or a mapping of its fields, got "
            f"{type(config).__name__}"
        )
    from megatron.bridge.training import train as bridge_train

    if _INSTALLED is None:
        _INSTALLED = _Installed(
            config=config,
            metrics_out=metrics_out,
            original_getter=bridge_train.get_forward_backward_func,
            original_train_step=bridge_train.train_step,
        )
    else:
        _INSTALLED.config, _INSTALLED.metrics_out = config, metrics_out
    installed = _INSTALLED
    original = installed.original_getter

    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> BridgeLossFix:
        installed.current = BridgeLossFix(
            installed.config,
            original(*args, **kwargs),
            record_metrics=installed.metrics_out is not None,
        )
        return installed.current

    bridge_train.get_forward_backward_func = get_forward_backward_func
    bridge_train.train_step = _recording_train_step(installed)


def disable_bridge() -> None:
    """Give Bridge its own ``get_forward_backward_func`` and ``train_step`` back (no-op when
    :func:`enable_bridge` was not called)."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    from megatron.bridge.training import train as bridge_train

    bridge_train.get_forward_backward_func = _INSTALLED.original_getter
    bridge_train.train_step = _INSTALLED.original_train_step
    _INSTALLED = None


def _recording_train_step(installed: _Installed) -> Callable[..., Any]:
    """Bridge's ``train_step`` followed, with ``metrics_out``, by one JSON line per step.

    Bridge logs the grad norm and loss rounded; comparisons across layouts need every digit.
    The logged ``lm loss`` exists on the last pipeline stage only: it is sent to rank 0.
    """
    train_step = installed.original_train_step
    if installed.metrics_out is None:
        return train_step
    started = []

    @functools.wraps(train_step)
    def recorded_train_step(*args: Any, **kwargs: Any) -> tuple:
        rank0 = dist.get_rank() == 0
        if not started:
            started.append(True)
            if rank0:
                open(installed.metrics_out, "w").close()  # a fresh file per run
        start = time.perf_counter()
        global_state = kwargs.get("global_state", args[5] if len(args) > 5 else None)
        pg_collection = kwargs.get("pg_collection", args[6] if len(args) > 6 else None)
        iteration = global_state.train_state.step + 1
        result = train_step(*args, **kwargs)
        wrapper = installed.current
        metrics = wrapper.last_metrics if wrapper is not None else None
        if metrics is None:
            return result
        loss_dict, grad_norm = result[0], result[5]
        logged = loss_dict.get(LOSS_KEY) if isinstance(loss_dict, Mapping) else None
        logged = None if logged is None else float(logged)
        pp = getattr(pg_collection, "pp", None)
        if pp is not None and dist.get_world_size(pp) > 1:
            box = [logged]
            last = dist.get_global_rank(pp, dist.get_world_size(pp) - 1)
            dist.broadcast_object_list(box, src=last, group=pp)
            logged = box[0]
        if rank0:
            record = {
                "iteration": iteration,
                **record_numbers(metrics, logged),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "step_time_s": time.perf_counter() - start,
                "reduction": installed.config.reduction,
            }
            with open(installed.metrics_out, "a") as out:
                out.write(json.dumps(record) + "\n")
        wrapper.last_metrics = None
        return result

    return recorded_train_step
