"""The plugin's step: Megatron's ``forward_backward_func``, normalizing exactly (docs/design.md §3).

A :class:`Step` is called with the keyword arguments of the function
``get_forward_backward_func()`` returns. With ``off`` it calls the wrapped function with the
caller's own arguments and returns its result unchanged. With a mode, one step, each phase a
module of its own that takes values and returns values:

1. **read**: the loss stage (last pipeline stage) reads the step's micro-batches, their loss
   masks and packed-sequence segments (:mod:`megatron_lossfix.step.read`);
2. **agree**: every rank agrees that the step can run, the step's counts riding in the same
   all-reduce (:mod:`megatron_lossfix.step.agree`, :mod:`megatron_lossfix.step.agreement`);
3. **weigh**: each micro-batch gets its weights, ``batch[config.weights_key]``, and each MTP
   layer its own (:mod:`megatron_lossfix.step.weigh`, :mod:`megatron_lossfix.step.mtp`);
4. **wrap** and **scale**: Megatron's schedule runs; each loss tuple is checked and multiplied
   by what undoes Megatron's averaging, so the gradient is that of ``sum(w * l)``
   (:mod:`megatron_lossfix.step.microbatch`);
5. **after the schedule**: if a loss function failed inside it (the loss stage ran on with zero
   losses), a second agreement refuses the step on every rank; the same all-reduce carries the
   counts of the masks the loss decided (:mod:`megatron_lossfix.runtime.mask_in_loss`), by which a
   ``mask_in_loss`` step scales its gradients once (:mod:`megatron_lossfix.step.after`).

With ``mask_in_loss`` and a model whose gradient has terms outside the loss (or
``counting_pass``), a forward-only counting pass (:mod:`megatron_lossfix.step.counting_pass`) runs
between 3 and 4 and the counts agree before the real pass instead.

Each step that goes through leaves its :class:`StepRecord` in :attr:`Step.last_step`: what the
step's metrics reduce (:mod:`megatron_lossfix.step.metrics`) and the self-check keeps
(:mod:`megatron_lossfix.step.selfcheck`); :mod:`megatron_lossfix.step.record` says which phase
writes which field. Nothing in the micro-batch loop synchronizes with the host.
Tensor-parallel peers are not part of the agreement: they read the same data and fail alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import megatron_lossfix.step.megatron_compat as megatron_compat
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mask_in_loss import Phase
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.weights import shifted_masks
from megatron_lossfix.step.after import after_schedule, agree_kept
from megatron_lossfix.step.agree import agree_counts
from megatron_lossfix.step.agreement import Problem
from megatron_lossfix.step.counting_pass import counting_pass
from megatron_lossfix.step.microbatch import MicroBatches, PassLog, PassSettings, wrap_forward_step
from megatron_lossfix.step.read import model_settings, read_step_data, structure_problem
from megatron_lossfix.step.record import StepData, StepRecord
from megatron_lossfix.step.weigh import (
    kept_phase,
    kept_step,
    loss_factor,
    microbatch_weights,
    mtp_weights,
)

__all__ = ["Step", "StepData", "StepRecord"]


class Step:
    """Megatron's ``forward_backward_func`` with exact, layout-invariant loss normalization.

    Args:
        config: the plugin configuration.
        forward_backward_func: Megatron's schedule to wrap; by default Megatron's for the
            call's pipeline group and model chunks.
        pg_collection: process groups for calls that pass none; else ``parallel_state``.
    """

    def __init__(
        self,
        config: LossFixConfig,
        forward_backward_func: Callable[..., Any] | None = None,
        pg_collection: Any = None,
    ) -> None:
        megatron_compat.warn_if_untested()
        self.config = config
        self.inner = forward_backward_func
        self.pg_collection = pg_collection
        self.last_step: StepRecord | None = None
        """This rank's record of the last step: None before the first and after a step that
        raised (a refused one too)."""
        self.halves: Callable[[list, list], tuple[list, list]] | None = None
        """What the first-step check sets for its runs over halves of the loss tokens: the loss
        stage's forward steps get ``halves(batches, weights)``, the micro-batches and weights
        halved alike, after the step weighed them whole (docs/design.md §9); None: as read."""

    def __call__(self, **call: Any) -> Any:
        self.last_step = None  # a step that raises leaves no record behind
        given = call.get("pg_collection")
        record = StepRecord(
            config=self.config,
            num_microbatches=call["num_microbatches"],
            pg_collection=self.pg_collection if given is None else given,
        )
        if mode_of(self.config.reduction).stock:
            result = self._stock(call, record)
        else:
            result = self._plugin(call, record)
        self.last_step = record
        return result

    def _stock(self, call: dict, record: StepRecord) -> Any:
        """``off``: the wrapped function with the caller's own objects, its result unchanged."""
        func = self.inner
        if func is None:  # asked for each step, as stock code does (it reads parallel_state)
            from megatron.core.pipeline_parallel import get_forward_backward_func

            func = get_forward_backward_func()
        result = func(**call)
        record.reports = list(result) if isinstance(result, (list, tuple)) else []
        return result

    def _plugin(self, call: dict, record: StepRecord) -> Any:
        """Read, agree (with the counts), weigh, wrap, run Megatron's schedule, agree again.
        Each phase returns its values; this writes each into the record once."""
        cfg, model, m = self.config, call["model"], call["num_microbatches"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            # The same argument on every rank: every rank raises here, before any collective.
            raise ValueError(f"num_microbatches must be a positive int, got {m!r}")
        chunks = model if isinstance(model, list) else [model]
        record.model_config, error = model_settings(cfg, chunks[0])
        mtp_layers = int(getattr(record.model_config, "mtp_num_layers", None) or 0)
        if record.pg_collection is not None:
            call["pg_collection"] = record.pg_collection  # the schedule's when the call gave none
        record.groups = megatron_compat.resolve_groups(record.pg_collection)
        given = call["data_iterator"]
        iterators = list(given) if isinstance(given, list) else [given]
        data, problem = StepData(), None
        if error is not None:
            message = f"preparing the step raised {type(error).__name__}: {error}"
            problem = Problem.OTHER.refusal(message, error)
        elif record.groups.is_last_stage:
            data, problem = read_step_data(cfg, iterators[-1], m, mtp_layers)
        # The structural guard's problem is the fix to name first: no step is right without it.
        problem = structure_problem(chunks, record.model_config, record.groups) or problem
        mtp_masks = [shifted_masks(data.masks, j) for j in range(1, mtp_layers + 1)]
        agreed = agree_counts(cfg, record.groups, record.per_token, problem, data, mtp_masks)
        record.counts, record.grouped = agreed.counts, agreed.grouped
        forward_only = bool(call.get("forward_only"))
        record.phase = kept_phase(cfg, record.model_config, forward_only, record.grouped)
        schedule = self.inner or megatron_compat.schedule_for(model, record.groups.pp)
        real = counting = settings = None  # the passes over the loss stage's micro-batches
        if record.groups.is_last_stage:
            record.kept = kept_step(record, data)
            weights, batches = microbatch_weights(record, data), data.batches
            if self.halves is not None:
                batches, weights = self.halves(batches, weights)
            record.mtp = mtp_weights(record, mtp_masks, agreed.mtp)
            scale = loss_factor(record)
            settings = PassSettings(
                cfg, record.per_token, record.passthrough, scale, record.kept, record.mtp
            )
            real = MicroBatches(batches, weights, cfg)
            counting = MicroBatches(batches, weights, cfg)
            iterators[-1] = real
        forward_step_func, log = call["forward_step_func"], PassLog()
        call["forward_step_func"] = wrap_forward_step(forward_step_func, real, settings, log)
        if record.phase is Phase.COUNT:
            counting_log = PassLog()
            counting_settings = None if settings is None else replace(settings, counting=True)
            counting_step = wrap_forward_step(
                forward_step_func, counting, counting_settings, counting_log
            )
            loss_iterators = None if counting is None else (counting, real)
            iterators = counting_pass(schedule, call, counting_step, iterators, loss_iterators)
            record.kept_counts = agree_kept(record, counting_log.problem, counted=True)
        call["data_iterator"] = iterators if isinstance(given, list) else iterators[0]
        result = schedule(**call)
        record.contributions, record.reports = log.contributions, log.reports
        kept_counts, record.loss_scale = after_schedule(record, chunks, forward_only, log.problem)
        if kept_counts is not None:
            record.kept_counts = kept_counts
        return result
