"""Runtime self-check: the first step's gradient must not depend on how it is split.

Every plugin mode but ``token_mean_legacy`` gives a gradient that does not depend on how the step
is cut into micro-batches. With ``LossFixConfig(self_check=True)`` (``--lossfix-self-check``) the
schedule runs its first training step through :class:`SelfCheck`, which:

1. runs the step normally, recording the micro-batches that ``forward_step`` reads from every
   data iterator (every pipeline stage and model chunk);
2. snapshots every parameter's ``main_grad`` (``.grad`` without Megatron DDP), and compares
   it across the data x context-parallel ranks, which must all hold the same reduced gradient
   (two checksums per dense parameter, one all-reduce; with the distributed optimizer the
   gathered shards agree by construction, and a missing reduction is the structural guard's
   to refuse): a loop whose gradients were not reduced, or were rescaled on some ranks,
   fails here, naming the parameter that differs most;
3. runs the same data again, split differently: each micro-batch cut in two when the micro-batch
   size is even (memory-neutral), else groups of micro-batches merged (tensors concatenated along
   dim 0), else rows dealt to other micro-batches (same count and shapes: also used when
   ``forward_step`` broadcasts batches over tensor parallelism into fixed-shape buffers, as
   Megatron-LM's ``get_batch_on_this_tp_rank`` does). The plan depends on ``num_microbatches``,
   ``micro_batch_size`` and the layout only, so every stage of a pipeline agrees on it;
4. compares the two gradients (relative L2; squared norms all-reduced over the model-parallel
   group, and the expert-model-parallel group for experts, as Megatron's grad norm does: DP and
   CP replicas hold the same reduced gradient, so every rank reaches the same verdict);
5. puts back the first gradient, the RNG states and the schedule's step record, so that training
   continues exactly as without the check, and raises ``RuntimeError`` when they differ.

A loss that normalizes by something the split changes -- its own token count on top of the
plugin's weights (double scaling), the number of micro-batches, the raw mask instead of the
weights -- changes the gradient under the re-split. A constant factor does not, and is not caught.
With dropout the comparison runs twice more in eval mode (dropout masks cannot match across
splits); the kept gradient is still the normal, training-mode one. Costs one or two extra
forward/backward passes and one gradient copy, once. Skipped with a warning: ``off`` and
``token_mean_legacy`` (split-dependent by definition), MoE auxiliary/z losses and expert
capacity (batch-composition dependent by design, docs/design.md §1). MTP losses are normalized
like the main loss, so they are checked too.

"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.megatron_compat import resolve_groups
from megatron_lossfix.reduction import LossFixConfig, group_size
from megatron_lossfix.resplit import ResplitPlan, resplit
from megatron_lossfix.selfcheck_model import (
    agree_flags,
    broadcasts_batches,
    has_dropout,
    model_chunks,
    model_config_of,
    module_buffers,
    params_device,
    plan_resplit,
    relative_error,
    replica_spread,
    restore_grads,
    rng_state,
    set_rng_state,
    snapshot_grads,
    trainable_params,
    unshard_distributed_optimizer,
    why_not_checkable,
    zero_grads,
)

__all__ = ["SelfCheck", "SelfCheckError"]


class SelfCheckError(RuntimeError):
    """The gradient changed when the same step was re-split: the loss is normalized twice or
    not through the plugin's weights."""


class _Recorder:
    """Passes an iterator's items through and keeps (a shallow copy of) each one."""

    def __init__(self, source: Iterator) -> None:
        self._source = source
        self.items: list[Any] = []

    def __iter__(self) -> _Recorder:
        return self

    def __next__(self) -> Any:
        item = next(self._source)
        # A copy: forward_step may pop keys from the dict it is given.
        self.items.append(dict(item) if isinstance(item, Mapping) else item)
        return item


@dataclass(kw_only=True, slots=True)
class _NormalRun:
    """What the normal run of the checked step left: to compare with, and to put back."""

    call: dict
    """The step's keyword arguments, as the caller gave them."""
    chunks: list
    """The model chunks."""
    params: list[torch.nn.Parameter]
    """Their trainable parameters, each once."""
    recorders: list
    """Per data iterator, what ``forward_step`` read from it (None: no iterator)."""
    result: Any
    """What the schedule returned (handed back to the caller)."""
    record: Any
    """The schedule's record of the step."""
    rng: dict[str, Any]
    """The RNG states after the step."""
    buffers: list[torch.Tensor]
    """Copies of the registered buffers after the step."""
    grads: list[torch.Tensor | None]
    """Copies of the gradients after the step (full, not sharded)."""


# ------------------------------------------------------------------------------ the check


class SelfCheck:
    """The first training step's re-split check, owned by a schedule whose config has
    ``self_check=True``; the schedule hands it each step and the function that runs one.

    Raises :class:`SelfCheckError` (a ``RuntimeError``) on every rank when the gradient moved,
    after restoring the normal run's gradient. Skips, with a warning, reductions that depend on
    the split by definition (``off``, ``token_mean_legacy``) and models whose gradient does
    (MoE auxiliary losses, token dropping).
    """

    def __init__(self, config: LossFixConfig) -> None:
        self.tolerance = config.self_check_tolerance
        self.checked = False
        """Whether the first training step was seen (checked or skipped)."""
        self.last_error: float | None = None
        """The relative gradient change the check measured (None: none measured)."""
        self.last_plan: ResplitPlan | None = None
        """How the check re-split its step."""
        self.last_replica_spread: float | None = None
        """How far the checked step's gradient differed across data x context-parallel
        replicas (relative; 0 when they all hold the same reduced gradient)."""
        self._schedule: Any = None
        self._step: Callable[..., Any] | None = None

    def due(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call is the training step to check (the first one)."""
        return not self.checked and not kwargs.get("forward_only")

    def run(self, schedule: Any, step: Callable[..., Any], call: dict) -> Any:
        """Check ``call``, the first training step: ``step(**call)`` runs it unchecked;
        ``schedule`` (a ``LossFixSchedule``) holds its config and its record of the step."""
        self.checked = True
        self._schedule, self._step = schedule, step
        try:
            reason = why_not_checkable(schedule, call["model"])
            if reason:
                warnings.warn(f"megatron_lossfix self-check skipped: {reason}", stacklevel=3)
                return step(**call)
            return self._checked_step(call)
        finally:
            self._schedule = self._step = None

    # -- the check -----------------------------------------------------------------------------

    def _checked_step(self, call: dict) -> Any:
        normal = self._normal_run(call)
        groups = resolve_groups(call.get("pg_collection"))
        device = params_device(normal.params)
        # 2. The same data, split differently (every rank learns whether any rank can't).
        # Across ranks: every data x context-parallel replica must hold the same reduced
        # gradient (a loop that reduces wrongly or not at all differs here).
        spread, worst = replica_spread(normal.params, normal.grads, groups, device)
        reads = any(rec is not None and rec.items for rec in normal.recorders)
        keep_shapes = broadcasts_batches(reads, groups, device)
        plan = plan_resplit(call, normal.chunks, groups, keep_shapes)
        items, problem = self._resplit_data(normal.recorders, call["num_microbatches"], plan)
        # The replicas' verdict rides in this all-reduce: every rank of the model hears it.
        failed, changed, spread_max = agree_flags(
            [float(problem is not None), float(plan is not None and problem is None), spread],
            groups,
            device,
        )
        self.last_replica_spread = spread_max
        if not spread_max <= self.tolerance:
            raise SelfCheckError(self._replica_message(spread_max, spread, worst, normal, groups))
        if failed:
            raise ValueError(
                "megatron_lossfix self-check: "
                + (problem or "another rank could not re-split its micro-batches")
                + "; this data cannot be checked: drop --lossfix-self-check"
            )
        if not changed:
            warnings.warn(
                "megatron_lossfix self-check skipped: no rank can re-split its step (one "
                "micro-batch of one row)",
                stacklevel=3,
            )
            return normal.result
        self.last_plan = plan
        try:
            error = relative_error(normal.params, self._resplit_run(normal, items, plan), groups)
        finally:
            self._put_back(normal)
        self.last_error = error
        if not error <= self.tolerance:
            raise SelfCheckError(self._message(error, call["num_microbatches"], plan))
        # Every rank measured the same error (it is all-reduced): one line for the whole run.
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"megatron_lossfix self-check passed: re-running the first step's data "
                f"{self._how(call['num_microbatches'], plan)} changed the gradient by "
                f"{error:.2g} (relative L2; tolerance {self.tolerance:g})",
                flush=True,
            )
        return normal.result

    def _normal_run(self, call: dict) -> _NormalRun:
        """1. The normal step, recording what forward_step reads; then what it left."""
        chunks = model_chunks(call["model"])
        given = call["data_iterator"]
        as_list = isinstance(given, list)
        recorders = [
            None if it is None else _Recorder(it) for it in (given if as_list else [given])
        ]
        result = self._step(**{**call, "data_iterator": recorders if as_list else recorders[0]})
        record = self._schedule.last_step
        rng = rng_state()
        buffers = [b.detach().clone() for b in module_buffers(chunks)]
        unshard_distributed_optimizer(chunks)
        params = trainable_params(chunks)
        return _NormalRun(
            call=call,
            chunks=chunks,
            params=params,
            recorders=recorders,
            result=result,
            record=record,
            rng=rng,
            buffers=buffers,
            grads=snapshot_grads(params),
        )

    def _resplit_run(
        self, normal: _NormalRun, items: list, plan: ResplitPlan | None
    ) -> list[torch.Tensor | None]:
        """Run the re-split data; the gradient to compare the resulting one with."""
        count = plan.num_microbatches if plan is not None else normal.call["num_microbatches"]
        if has_dropout(model_config_of(normal.chunks), normal.chunks):
            # Dropout masks differ between any two runs: compare two dropout-free runs.
            return self._eval_mode_runs(normal, items, count, plan)
        self._rerun(normal, items, count, plan)
        unshard_distributed_optimizer(normal.chunks)
        return normal.grads

    def _put_back(self, normal: _NormalRun) -> None:
        """3. Training goes on from the normal run: its gradient, buffers, RNG, step record."""
        restore_grads(normal.params, normal.grads)
        with torch.no_grad():
            for buf, saved in zip(module_buffers(normal.chunks), normal.buffers, strict=True):
                buf.copy_(saved)
        set_rng_state(normal.rng)
        # The metrics are the normal run's (the schedule's own record, set where it is kept).
        self._schedule._last_step = normal.record

    def _eval_mode_runs(
        self, normal: _NormalRun, items: list, count: int, plan: ResplitPlan | None
    ) -> list[torch.Tensor | None]:
        """Without dropout: the original split (returned), then the re-split (left in place)."""
        chunks = normal.chunks
        training = [chunk.training for chunk in chunks]
        for chunk in chunks:
            chunk.eval()
        try:
            original = [None if rec is None else list(rec.items) for rec in normal.recorders]
            self._rerun(normal, original, normal.call["num_microbatches"], None)
            unshard_distributed_optimizer(chunks)
            reference = snapshot_grads(normal.params)
            self._rerun(normal, items, count, plan)
            unshard_distributed_optimizer(chunks)
        finally:
            for chunk, mode in zip(chunks, training, strict=True):
                chunk.train(mode)
        return reference

    def _resplit_data(
        self, recorders: list, num_microbatches: int, plan: ResplitPlan | None
    ) -> tuple[list, str | None]:
        """Per iterator, the re-split items (None where no iterator was given), or a problem."""
        mask_key = self._schedule.config.loss_mask_key
        out: list = []
        for c, rec in enumerate(recorders):
            if rec is None:
                out.append(None)
                continue
            items = rec.items
            if not items or plan is None:
                out.append(list(items))  # never read (a middle stage), or nothing to change
                continue
            if len(items) != num_microbatches:
                return [], (
                    f"forward_step read {len(items)} micro-batches from data iterator {c} but "
                    f"num_microbatches={num_microbatches}"
                )
            try:
                out.append(resplit(items, plan, mask_key=mask_key))
            except ValueError as exc:
                return [], f"cannot re-split data iterator {c}: {exc}"
        return out, None

    def _rerun(
        self, normal: _NormalRun, items: list, num_microbatches: int, plan: ResplitPlan | None
    ) -> None:
        zero_grads(normal.chunks)
        call = normal.call
        iterators = [None if it is None else iter(it) for it in items]
        kwargs = dict(call)
        kwargs["data_iterator"] = (
            iterators if isinstance(call["data_iterator"], list) else (iterators[0])
        )
        kwargs["num_microbatches"] = num_microbatches
        if plan is not None and plan.micro_batch_size is not None and "micro_batch_size" in call:
            kwargs["micro_batch_size"] = plan.micro_batch_size
        self._step(**kwargs)

    @staticmethod
    def _how(num_microbatches: int, plan: ResplitPlan | None) -> str:
        """How the re-run split the step, for the pass and failure messages."""
        if plan is None:
            return f"in the same {num_microbatches} micro-batches here (other ranks re-split)"
        if plan.kind == "shuffle":
            return f"in {num_microbatches} micro-batches with their rows dealt differently"
        cut = "each micro-batch cut in" if plan.kind == "split" else "merged in groups of"
        return (
            f"as {plan.num_microbatches} micro-batches instead of {num_microbatches} "
            f"({cut} {plan.factor})"
        )

    def _replica_message(
        self, spread_max: float, spread: float, worst: int, normal: _NormalRun, groups: Any
    ) -> str:
        """The failure when data-parallel replicas hold different gradients."""
        size = group_size(groups.dp_cp)
        if worst >= 0 and spread == spread_max:
            names = {id(p): n for c in normal.chunks for n, p in c.named_parameters()}
            where = f"most in {names.get(id(normal.params[worst]), 'a parameter')!r}"
        else:
            where = "between the replicas of another model-parallel rank"
        return (
            f"megatron_lossfix self-check failed: after the first step the gradient differs "
            f"across the {size} data x context-parallel ranks by {spread_max:.3g} (relative; "
            f"tolerance {self.tolerance:g}), {where}; those ranks must hold the same reduced "
            "gradient. The gradients were not reduced across data-parallel ranks, or were "
            "rescaled on some ranks: set config.finalize_model_grads_func = "
            "finalize_model_grads (megatron.core.distributed), keep the model in "
            "DistributedDataParallel, and do not reduce or rescale gradients elsewhere."
        )

    def _message(self, error: float, num_microbatches: int, plan: ResplitPlan | None) -> str:
        reduction = self._schedule.config.reduction
        how = self._how(num_microbatches, plan)
        return (
            f"megatron_lossfix self-check failed: re-running the first step's data {how} "
            f"changed the gradient by {error:.3g} (relative L2; tolerance {self.tolerance:g})"
            + (f" under reduction {reduction!r}" if reduction else "")
            + ". The loss depends on how the step is split, so it is not the mode's global "
            "normalization. Probably: (1) double scaling: loss_func divides the weighted sum "
            "by its own token count or by the number of micro-batches (a per-micro-batch mean, "
            "or calculate_per_token_loss plus a manual division), but the plugin's weights "
            "already normalize: return (sum(weights * loss), num_tokens, report) as "
            "megatron_lossfix.weighted_loss does; (2) the loss ignores the plugin's weights "
            "(batch['loss_weights']) and uses the raw loss mask; (3) the model mixes samples "
            "(batch statistics, token dropping). With bf16/fp16 compute rounding alone moves "
            "the gradient by about 1e-3: raise --lossfix-self-check-tolerance. The normal "
            "run's gradient was restored."
        )
