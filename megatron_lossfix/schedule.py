"""A drop-in replacement for Megatron-Core's ``forward_backward_func`` that normalizes exactly.

``LossFixSchedule(config)(forward_step_func=..., data_iterator=..., model=..., ...)`` takes the
same keyword arguments as the function returned by ``get_forward_backward_func()``.

With ``reduction="off"`` it is stock Megatron, literally: the wrapped function gets the caller's
own ``forward_step_func``, ``data_iterator``, ``model`` and other arguments, and its result is
returned unchanged. Nothing is communicated, looked at or put into the batches (there is no
``batch[config.weights_key]``: a ``forward_step`` written for the plugin reads
``batch.get("loss_weights", batch["loss_mask"])`` to keep working). ``step_metrics()`` reads what
Megatron returned.

With a plugin mode, per step it:

1. reads the step's micro-batches on the last pipeline stage (the loss stage) before the schedule
   starts and counts loss tokens and sequences;
2. agrees with every rank of the step that the step can run: one all-reduce over the loss
   stage's data x context-parallel group carries the counts together with the cross-rank checks,
   and, with pipeline parallelism, one small all-reduce over the pipeline group hands the verdict
   to the other stages. A problem on any rank (no mask, a non-dict batch, a missing or
   unreadable iterator, a short iterator, a bad mask, an exception while reading; with
   DP x CP > 1, a model that is not Megatron DDP/FSDP or a config without
   ``finalize_model_grads_func``, checked once per model) makes every rank of the step raise,
   within the time of two small collectives, instead of leaving its peers blocked in
   Megatron's point-to-point or gradient communication;
3. puts per-token weights into every micro-batch dict (``batch[config.weights_key]``);
4. runs Megatron's own schedule, wrapping each ``loss_func`` so that what Megatron receives,
   after its internal averaging, yields exactly ``sum(w * loss)``:

   ===========================  =============================  ==============================
   Megatron path                 Megatron does                  the plugin hands it
   ===========================  =============================  ==============================
   calculate_per_token_loss=F    loss*cp/M, grads /(D*cp)       (sum(w*l) * M * D, report)
   calculate_per_token_loss=T    grads / all-reduced num_tokens  (sum(w*l) * N, n_local, report)
   ===========================  =============================  ==============================

   With ``calculate_per_token_loss=True`` and ``token_mean``, Megatron's own deferred division
   by the global token count already is the exact answer: the weights are the mask and
   ``(sum(m*l), n_local, report)`` goes through unchanged.

Not covered by the agreement: tensor-parallel peers (they read the same micro-batches and run
the same checks, so they fail alike), and errors raised inside ``loss_func`` while Megatron's
schedule runs (a malformed loss tuple), which can only be seen after the other stages have
entered the pipeline; those raise on the loss stage only (see the README's Limits).

User loss functions follow Tinker semantics: they return ``(sum(weights * per_token_loss),
report)`` using the weights found in their micro-batch. Nothing inside the micro-batch loop
synchronizes with the host.

The step's parts live in their own modules: ``batches`` (reading the loss
stage's micro-batches, building their weights), ``agreement`` (the two agreements, with the
counts), ``lossfunc`` (checking and rescaling the loss tuples). Each step builds one record,
:class:`~megatron_lossfix.metrics.StepState`, hands it to the functions that fill it, and keeps
it as :attr:`LossFixSchedule.last_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_lossfix.agreement import (
    UNREDUCED,
    LocalProblem,
    StepRefused,
    agree,
    agree_after,
    refuse_hybrid_cp,
    unreduced_gradients,
)
from megatron_lossfix.batches import MTPLayout, PreparedStep, mtp_step, prepare_step, step_weights
from megatron_lossfix.config import LossFixConfig
from megatron_lossfix.lossfunc import wrap_forward_step
from megatron_lossfix.megatron_compat import (
    StepGroups,
    resolve_groups,
    schedule_for,
    warn_if_untested,
)
from megatron_lossfix.metrics import StepState, reduce_step_metrics
from megatron_lossfix.selfcheck import SelfCheck

__all__ = ["LossFixSchedule", "StepGroups", "StepRefused", "resolve_groups"]


def _check_num_microbatches(num_microbatches: Any) -> None:
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or (num_microbatches < 1)
    ):
        # The same argument on every rank: every rank raises here, before any collective.
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")


#: The arguments every call names, in the order the steps take them.
_CALL_ARGS = ("forward_step_func", "data_iterator", "model", "num_microbatches")


class LossFixSchedule:
    """Megatron ``forward_backward_func`` with exact, layout-invariant loss normalization.

    Loss functions return Megatron's documented 3-tuple with a plain weighted sum,
    ``(sum(weights * per_token_loss), num_tokens, report)``, where ``weights`` is
    ``batch[config.weights_key]`` and ``num_tokens`` the loss tokens this micro-batch holds on
    this rank (:func:`megatron_lossfix.losses.weighted_loss` builds it). With
    ``calculate_per_token_loss=False`` the 2-tuple ``(sum(weights * loss), report)`` works too.

    Args:
        config: the plugin configuration, or a mode name (``"token_mean"``) for that mode's
            default settings; anything else is refused here, before the first step.
        forward_backward_func: Megatron's schedule to wrap; by default
            Megatron's schedule for the call's pipeline group and model chunks (PP/VPP).
        pg_collection: process groups, used when the call passes none; else parallel_state.
            With ``off`` it is used for the metrics only: Megatron gets the caller's arguments.
    """

    def __init__(
        self,
        config: LossFixConfig | str,
        forward_backward_func: Callable[..., Any] | None = None,
        pg_collection: Any = None,
    ) -> None:
        if isinstance(config, str):
            config = LossFixConfig(reduction=config)  # a mode name: its default settings
        elif not isinstance(config, LossFixConfig):
            raise TypeError(
                "LossFixSchedule takes a LossFixConfig or a mode name such as 'token_mean', "
                f"got {type(config).__name__} {config!r:.60}; build one with "
                "LossFixConfig(reduction=...) (from flags: schedule_from_args(args))"
            )
        if forward_backward_func is not None and not callable(forward_backward_func):
            raise TypeError(
                "forward_backward_func must be Megatron's schedule function (callable) or None, "
                f"got {type(forward_backward_func).__name__}"
            )
        warn_if_untested()
        self.config = config
        self._inner = forward_backward_func
        self._pg_collection = pg_collection
        self._last_step: StepState | None = None
        self.self_check = SelfCheck(config) if config.self_check else None
        """The first-step re-split check (``config.self_check``), with what it measured."""
        # The structural guard's verdict per model (see _structure_problem).
        self._structure: dict[tuple, str | None] = {}

    @property
    def last_step(self) -> StepState | None:
        """The record of the last step on this rank (None before the first step and after a
        refused one); :meth:`step_metrics` reduces it."""
        return self._last_step

    def _inner_func(self, model: Any = None, pp_group: Any = None) -> Callable[..., Any]:
        """The wrapped schedule; without one, Megatron's own. ``off`` asks for it exactly as
        stock code does; plugin modes name the pipeline group and model chunks."""
        if self._inner is not None:
            return self._inner
        if model is not None:
            return schedule_for(model, pp_group)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()

    # ------------------------------------------------------------------ the step
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
        if self.self_check is not None and self.self_check.due(kwargs):
            return self.self_check.run(self, self._unchecked_step, call)
        return self._unchecked_step(**call)

    def _unchecked_step(self, **call: Any) -> Any:
        """One step without the self-check (what the check runs, and re-runs re-split)."""
        step = self._stock_step if self.config.reduction == "off" else self._plugin_step
        args = [call.pop(name) for name in _CALL_ARGS]
        return step(*args, call)

    def _stock_step(
        self,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        kwargs: dict,
    ) -> Any:
        """``off``: the wrapped schedule with the caller's own objects; its result, unchanged,
        is also what ``step_metrics()`` reads (the loss stage's reports)."""
        self._last_step = None
        result = self._inner_func()(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            **kwargs,
        )
        pg_collection = kwargs.get("pg_collection")
        self._last_step = StepState(
            reduction="off",
            per_token=None,
            passthrough=True,
            groups=None,
            num_microbatches=num_microbatches,
            pg_collection=self._pg_collection if pg_collection is None else pg_collection,
            reports=list(result) if isinstance(result, (list, tuple)) else [],
        )
        return result

    def _plugin_step(
        self,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        kwargs: dict,
    ) -> Any:
        """Read and count, agree, weight, run Megatron's schedule, agree again (§3)."""
        _check_num_microbatches(num_microbatches)
        cfg = self.config
        self._last_step = None  # a refused step leaves no metrics behind
        chunks = model if isinstance(model, list) else [model]
        refuse_hybrid_cp(chunks[0])
        if kwargs.get("pg_collection") is None and self._pg_collection is not None:
            kwargs["pg_collection"] = self._pg_collection
        groups = resolve_groups(kwargs.get("pg_collection"))
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        prepared = prepare_step(cfg, chunks[0], groups, iterators, num_microbatches)
        unreduced = self._structure_problem(chunks, prepared, groups)
        if unreduced is not None:
            prepared.problem = unreduced  # the fix to name first: no step can be right without
        # The step's one record: filled by the agreement (counts) and the loss functions.
        state = StepState(
            reduction=cfg.reduction,
            per_token=prepared.per_token,
            passthrough=prepared.per_token and cfg.reduction == "token_mean",
            groups=groups,
            num_microbatches=num_microbatches,
            masks=prepared.masks,
            segments=prepared.segments,
        )
        mtp_masks = prepared.mtp_masks
        mtp_counts = agree(cfg, state, prepared.problem, mtp_masks, prepared.mtp_layers)
        self._last_step = state
        wrapped_step = forward_step_func
        if groups.is_last_stage:
            step_iter = self._weighted(prepared, state, mtp_masks, mtp_counts)
            iterators = [*iterators[:-1], step_iter]
            wrapped_step = wrap_forward_step(cfg, forward_step_func, step_iter, state)
        result = self._inner_func(model, groups.pp)(
            forward_step_func=wrapped_step,
            data_iterator=iterators if isinstance(data_iterator, list) else iterators[0],
            model=model,
            num_microbatches=num_microbatches,
            **kwargs,
        )
        try:
            agree_after(state)
        except StepRefused:
            self._last_step = None
            raise
        return result

    def _structure_problem(
        self, chunks: list, prepared: PreparedStep, groups: StepGroups
    ) -> LocalProblem | None:
        """The structural guard (``agreement.unreduced_gradients``), checked once per model,
        config and group size and then cached; the problem it finds for the agreement."""
        key = (*map(id, chunks), id(prepared.model_config), groups.dp_cp_size)
        if key not in self._structure:
            try:
                self._structure[key] = unreduced_gradients(chunks, prepared.model_config, groups)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                name = type(exc).__name__
                self._structure[key] = f"checking the model's DP wrapping raised {name}: {exc}"
        message = self._structure[key]
        return None if message is None else LocalProblem(UNREDUCED, message)

    def _weighted(
        self,
        prepared: PreparedStep,
        state: StepState,
        mtp_masks: list,
        mtp_counts: list,
    ) -> Any:
        """The loss stage's iterator over the weighted micro-batches; sets ``state.mtp``."""
        step_iter = step_weights(self.config, prepared, state.counts, state.passthrough)
        if prepared.mtp_layers:
            layout = MTPLayout(
                per_token=bool(state.per_token),
                num_tokens=state.counts.num_tokens,
                num_microbatches=state.num_microbatches,
                groups=state.groups,
            )
            state.mtp = mtp_step(
                self.config, mtp_masks, mtp_counts, layout, prepared.model_config, step_iter
            )
        return step_iter

    # ------------------------------------------------------------------ metrics
    def step_metrics(self) -> dict[str, float]:
        """The last step's global metrics, on every rank (collectives over DP x CP and PP).

        ``loss`` is L of docs/design.md §2, ``num_tokens`` N and ``num_sequences`` S; report
        entries that are 0-dim tensors named ``*_sum``/``*_count``, ``*_max`` or ``*_min`` are
        reduced that way over DP x CP.

        With ``off`` the plugin saw nothing of the step but what Megatron returned: the loss
        stage's list of reports (the last element of each loss tuple). Only those report
        entries are reduced, by the same rules; ``loss``, ``num_tokens`` and ``num_sequences``
        are absent unless the loss function reported them itself (under those names with a
        ``_sum`` suffix, e.g. ``num_tokens_sum``). Stock Megatron's loss is the caller's to
        report: e.g. each micro-batch's ``sum(m * l) / n`` as ``*_sum`` with a ``*_count`` of 1
        gives the mean of per-micro-batch means that stock optimizes.
        """
        return reduce_step_metrics(self._last_step)
