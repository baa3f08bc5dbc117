"""Runtime self-check: the first step's gradient must not depend on how it is split.

Every plugin mode but ``token_mean_legacy`` gives a gradient that does not depend on how the step
is cut into micro-batches. ``SelfCheckingSchedule`` wraps a schedule (normally a
:class:`~megatron_lossfix.LossFixSchedule`) and, on the first step(s):

1. runs the step normally, recording the micro-batches that ``forward_step`` reads from every
   data iterator (every pipeline stage and model chunk);
2. snapshots every parameter's ``main_grad`` (``.grad`` without Megatron DDP);
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

Wire it from flags with :func:`with_self_check` (``--lossfix-self-check``).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.resplit import ResplitPlan, resplit, resplit_plan

__all__ = ["SelfCheckError", "SelfCheckingSchedule", "with_self_check"]

#: Modes whose gradient depends on the micro-batch split by design (or that are stock Megatron).
SPLIT_DEPENDENT_MODES = ("off", "token_mean_legacy")


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


# ------------------------------------------------------------------------------ gradients


def _chunks(model: Any) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def _params(chunks: list) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        for param in chunk.parameters():
            if id(param) not in seen and param.requires_grad:
                seen.add(id(param))
                out.append(param)
    return out


def _unshard_distributed_optimizer(chunks: list) -> None:
    """The distributed optimizer leaves each DP rank only its reduce-scattered shard of every
    bucket; gather the shards back so that ``main_grad`` is the full gradient. The optimizer
    reads only this rank's shard, which this does not change."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.use_distributed_optimizer:
            continue
        groups = [
            *getattr(chunk, "bucket_groups", []),
            *getattr(chunk, "expert_parallel_bucket_groups", []),
        ]
        for bucket_group in groups:
            group = bucket_group.intra_distributed_optimizer_instance_group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            for bucket in bucket_group.buckets:
                views = shard_buffer(bucket.grad_data, size)
                dist.all_gather(views, views[rank].clone(), group=group)


def _zero_grads(chunks: list) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()  # also resets DDP's per-step bucket state
        else:
            for param in chunk.parameters():
                grad = _grad_of(param)
                if grad is not None:
                    grad.zero_()


@dataclass
class _Groups:
    """Where the check communicates; None: a group of one (nothing to reduce)."""

    model_parallel: dist.ProcessGroup | None
    """TP x PP: squared norms of dense parameters; with data_parallel, spans every rank."""
    expert_model_parallel: dist.ProcessGroup | None
    """Expert TP x EP x PP: squared norms of expert parameters."""
    data_parallel: dist.ProcessGroup | None
    """DP x CP: only for agreeing on flags (replicas hold the same reduced gradient)."""
    tensor_parallel: dist.ProcessGroup | None
    pipeline: dist.ProcessGroup | None

    @staticmethod
    def size(group: dist.ProcessGroup | None) -> int:
        return 1 if group is None else dist.get_world_size(group)


def _counted(param: torch.nn.Parameter, tp_group: dist.ProcessGroup | None) -> bool:
    """Count each gradient element once over the model-parallel group, as Megatron's grad norm
    does: no TP-replicated copy but rank 0's, no tied-embedding copy."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False) or tp_group is None:
        return True
    return dist.get_rank(tp_group) == 0


def _relative_error(
    params: list[torch.nn.Parameter], reference: list[torch.Tensor | None], groups: _Groups
) -> float:
    """Relative L2 distance between the current gradient and ``reference`` over the whole model."""
    sums = {}
    for param, ref in zip(params, reference, strict=True):
        grad = _grad_of(param)
        if ref is None or grad is None or not _counted(param, groups.tensor_parallel):
            continue
        expert = not getattr(param, "allreduce", True)
        acc = sums.setdefault(expert, torch.zeros(2, dtype=torch.float64, device=grad.device))
        acc[0] += (grad.double() - ref.double()).square().sum()
        acc[1] += ref.double().square().sum()
    total = torch.zeros(2, dtype=torch.float64)
    for expert in (False, True):
        group = groups.expert_model_parallel if expert else groups.model_parallel
        acc = sums.get(expert)
        if acc is None:
            # Still take part in the collective: another rank of the group may hold such params.
            acc = torch.zeros(2, dtype=torch.float64, device=_device(params))
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(acc, group=group)
        total += acc.cpu()
    diff, ref = total.tolist()
    return (diff**0.5) / max(ref**0.5, 1e-30) if ref > 0 else float(diff > 0)


def _device(params: list[torch.nn.Parameter]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


# ------------------------------------------------------------------------------ state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        # get_states copies the dict; the tracker replaces (never mutates) its state tensors.
        state["tracker"] = get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001 - no tracker, nothing to restore
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "tracker" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def _model_config(chunks: list) -> Any:
    try:
        from megatron.core.utils import get_model_config

        return get_model_config(chunks[0])
    except Exception:  # noqa: BLE001 - not a Megatron model
        return None


def _split_dependent_features(config: Any) -> list[str]:
    """Model features whose gradient legitimately depends on batch composition."""
    if config is None:
        return []
    found = []
    if getattr(config, "num_moe_experts", None):
        if (getattr(config, "moe_aux_loss_coeff", 0) or 0) > 0:
            found.append("MoE load-balancing loss")
        if (getattr(config, "moe_z_loss_coeff", None) or 0) > 0:
            found.append("MoE z-loss")
        if getattr(config, "moe_expert_capacity_factor", None) is not None:
            found.append("MoE expert capacity (token dropping)")
    return found


def _has_dropout(config: Any, chunks: list) -> bool:
    if not any(chunk.training for chunk in chunks):
        return False
    if config is not None and (
        (getattr(config, "hidden_dropout", 0) or 0) > 0
        or (getattr(config, "attention_dropout", 0) or 0) > 0
    ):
        return True
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
        for chunk in chunks
        for m in chunk.modules()
    )


# ------------------------------------------------------------------------------ the wrapper


class SelfCheckingSchedule:
    """``schedule`` (same call signature) that checks split invariance on its first steps.

    Args:
        schedule: a :class:`~megatron_lossfix.LossFixSchedule` (or any ``forward_backward_func``).
        tolerance: largest relative L2 change of the gradient (1e-5 suits fp32; with bf16/fp16
            compute the re-split changes rounding: use about 1e-2).
        iterations: how many of the first training steps (``forward_only=False``) to check.
        model_parallel_group, expert_model_parallel_group: where squared norms are summed;
            default (from ``pg_collection`` or parallel_state) Megatron's model-parallel
            (TP x PP) and expert-tensor-model-pipeline groups.

    Raises :class:`SelfCheckError` (a ``RuntimeError``) on every rank when the gradient moved,
    after restoring the normal run's gradient. Skips, with a warning, reductions that depend on
    the split by definition (``off``, ``token_mean_legacy``) and models whose gradient does
    (MoE auxiliary losses, token dropping, MTP). Other attributes (``step_metrics``,
    ``last_step``, ``config``, ...) are the wrapped schedule's.
    """

    def __init__(
        self,
        schedule: Callable[..., Any],
        *,
        tolerance: float = 1e-5,
        iterations: int = 1,
        model_parallel_group: dist.ProcessGroup | None = None,
        expert_model_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {tolerance!r}")
        if iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {iterations!r}")
        self.schedule = schedule
        self.tolerance = float(tolerance)
        self.iterations = int(iterations)
        self.checked = 0
        """Training steps seen by the check so far (checked or skipped)."""
        self.last_error: float | None = None
        """The relative gradient change the last check measured (None: none measured)."""
        self.last_plan: ResplitPlan | None = None
        """How the last check re-split its step."""
        self._mp_group = model_parallel_group
        self._ep_group = expert_model_parallel_group

    def __getattr__(self, name: str) -> Any:
        # Called only for names not found on the wrapper: the wrapped schedule's API.
        if name == "schedule":
            raise AttributeError(name)
        return getattr(self.schedule, name)

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
        if kwargs.get("forward_only") or self.checked >= self.iterations:
            return self.schedule(**call)
        self.checked += 1
        reason = self._why_not(model)
        if reason:
            warnings.warn(f"megatron_lossfix self-check skipped: {reason}", stacklevel=2)
            return self.schedule(**call)
        return self._checked_step(call)

    # -- decisions (the same on every rank) ----------------------------------------------------

    def _why_not(self, model: Any) -> str | None:
        """Why this setup cannot be checked, from configuration alone."""
        reduction = getattr(getattr(self.schedule, "config", None), "reduction", None)
        if reduction in SPLIT_DEPENDENT_MODES:
            return (
                f"reduction {reduction!r} depends on the micro-batch split by definition "
                "(Megatron's mean of per-micro-batch means)"
            )
        features = _split_dependent_features(_model_config(_chunks(model)))
        if features:
            return (
                f"the model uses {', '.join(features)}, whose gradient depends on the batch "
                "composition by design (they are nonlinear in it; Megatron keeps them per "
                "micro-batch)"
            )
        return None

    def _groups(self, call: dict) -> _Groups:
        from megatron.core import parallel_state as ps

        initialized = ps.model_parallel_is_initialized()
        pg = call.get("pg_collection")

        def pick(given: Any, name: str, fallback: Callable[[], Any]) -> Any:
            if given is not None:
                return given
            group = getattr(pg, name, None) if pg is not None else None
            return group if group is not None else (fallback() if initialized else None)

        return _Groups(
            model_parallel=pick(self._mp_group, "mp", ps.get_model_parallel_group),
            expert_model_parallel=pick(
                self._ep_group, "tp_ep_pp", ps.get_expert_tensor_model_pipeline_parallel_group
            ),
            data_parallel=pick(
                None, "dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)
            ),
            tensor_parallel=pick(None, "tp", ps.get_tensor_model_parallel_group),
            pipeline=pick(None, "pp", ps.get_pipeline_model_parallel_group),
        )

    def _agree(self, flags: list[float], groups: _Groups, device: torch.device) -> list[float]:
        """Element-wise max of per-rank flags over every rank of the model: the model-parallel
        group, then the data x context-parallel group (together they span the grid)."""
        tensor = torch.tensor(flags, dtype=torch.float64, device=device)
        for group in (groups.model_parallel, groups.data_parallel):
            if _Groups.size(group) > 1:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor.tolist()

    def _broadcasts_batches(self, recorders: list, groups: _Groups, device: torch.device) -> bool:
        """Whether some tensor-parallel group has ranks that read data and ranks that do not:
        then ``forward_step`` broadcasts the batch (Megatron-LM's ``get_batch_on_this_tp_rank``)
        into buffers of the configured micro-batch shape, and only a shape-keeping re-split
        works."""
        reads = any(rec is not None and rec.items for rec in recorders)
        flags = torch.tensor([float(reads), float(not reads)], device=device)
        if _Groups.size(groups.tensor_parallel) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=groups.tensor_parallel)
        mixed = float(bool(flags[0] > 0 and flags[1] > 0))
        return bool(self._agree([mixed], groups, device)[0])

    def _plan(
        self, call: dict, chunks: list, groups: _Groups, keep_shapes: bool
    ) -> ResplitPlan | None:
        pp = _Groups.size(groups.pipeline)
        interleaved = None
        if len(chunks) > 1:
            config = _model_config(chunks)
            interleaved = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp
        return resplit_plan(
            call["num_microbatches"],
            call.get("micro_batch_size"),
            pipeline_size=pp,
            interleaved_group=interleaved,
            keep_shapes=keep_shapes,
        )

    # -- the check -----------------------------------------------------------------------------

    def _checked_step(self, call: dict) -> Any:
        chunks = _chunks(call["model"])
        groups = self._groups(call)
        params = _params(chunks)
        device = _device(params)

        # 1. The normal step, recording what forward_step reads.
        given = call["data_iterator"]
        as_list = isinstance(given, list)
        recorders = [
            None if it is None else _Recorder(it) for it in (given if as_list else [given])
        ]
        result = self.schedule(**{**call, "data_iterator": recorders if as_list else recorders[0]})
        step_record = getattr(self.schedule, "last_step", None)
        rng = _rng_state()
        buffers = [b.detach().clone() for b in _module_buffers(chunks)]
        _unshard_distributed_optimizer(chunks)
        kept = _snapshot(params)

        # 2. The same data, split differently (every rank learns whether any rank can't).
        keep_shapes = self._broadcasts_batches(recorders, groups, device)
        plan = self._plan(call, chunks, groups, keep_shapes)
        items, problem = self._resplit_data(recorders, call["num_microbatches"], plan)
        failed, changed = self._agree(
            [float(problem is not None), float(plan is not None and problem is None)],
            groups,
            device,
        )
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
            return result
        self.last_plan = plan
        count = plan.num_microbatches if plan is not None else call["num_microbatches"]
        try:
            if _has_dropout(_model_config(chunks), chunks):
                # Dropout masks differ between any two runs: compare two dropout-free runs.
                reference = self._eval_mode_runs(
                    call, chunks, params, recorders, items, count, plan
                )
            else:
                reference = kept
                self._rerun(call, chunks, items, count, plan)
                _unshard_distributed_optimizer(chunks)
            error = _relative_error(params, reference, groups)
        finally:
            # 3. Training goes on from the normal run: its gradient, buffers, RNG, step record.
            _restore(params, kept)
            with torch.no_grad():
                for buf, saved in zip(_module_buffers(chunks), buffers, strict=True):
                    buf.copy_(saved)
            _set_rng_state(rng)
            if step_record is not None:
                self.schedule.last_step = step_record
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
        return result

    def _eval_mode_runs(
        self,
        call: dict,
        chunks: list,
        params: list,
        recorders: list,
        items: list,
        count: int,
        plan: ResplitPlan | None,
    ) -> list[torch.Tensor | None]:
        """Without dropout: the original split (returned), then the re-split (left in place)."""
        training = [chunk.training for chunk in chunks]
        for chunk in chunks:
            chunk.eval()
        try:
            original = [None if rec is None else list(rec.items) for rec in recorders]
            self._rerun(call, chunks, original, call["num_microbatches"], None)
            _unshard_distributed_optimizer(chunks)
            reference = _snapshot(params)
            self._rerun(call, chunks, items, count, plan)
            _unshard_distributed_optimizer(chunks)
        finally:
            for chunk, mode in zip(chunks, training, strict=True):
                chunk.train(mode)
        return reference

    def _resplit_data(
        self, recorders: list, num_microbatches: int, plan: ResplitPlan | None
    ) -> tuple[list, str | None]:
        """Per iterator, the re-split items (None where no iterator was given), or a problem."""
        mask_key = getattr(getattr(self.schedule, "config", None), "loss_mask_key", "loss_mask")
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
        self,
        call: dict,
        chunks: list,
        items: list,
        num_microbatches: int,
        plan: ResplitPlan | None,
    ) -> None:
        _zero_grads(chunks)
        iterators = [None if it is None else iter(it) for it in items]
        kwargs = dict(call)
        kwargs["data_iterator"] = (
            iterators if isinstance(call["data_iterator"], list) else (iterators[0])
        )
        kwargs["num_microbatches"] = num_microbatches
        if plan is not None and plan.micro_batch_size is not None and "micro_batch_size" in call:
            kwargs["micro_batch_size"] = plan.micro_batch_size
        self.schedule(**kwargs)

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

    def _message(self, error: float, num_microbatches: int, plan: ResplitPlan | None) -> str:
        reduction = getattr(getattr(self.schedule, "config", None), "reduction", None)
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


def _module_buffers(chunks: list) -> list[torch.Tensor]:
    """Registered buffers (MoE expert bias and token counts, ...) that a re-run may update.
    ``nn.Module.buffers`` explicitly: Megatron DDP's ``buffers`` attribute is its grad buffers."""
    return [b for chunk in chunks for b in torch.nn.Module.buffers(chunk)]


def _snapshot(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if _grad_of(p) is None else _grad_of(p).detach().clone() for p in params]


@torch.no_grad()
def _restore(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads, strict=True):
        current = _grad_of(param)
        if grad is not None and current is not None:
            current.copy_(grad)
        elif grad is None and getattr(param, "main_grad", None) is None:
            param.grad = None  # the re-run created it


def with_self_check(schedule: Callable[..., Any], args: argparse.Namespace) -> Callable[..., Any]:
    """``schedule`` wrapped in :class:`SelfCheckingSchedule` when ``--lossfix-self-check`` was
    given (with ``--lossfix-self-check-tolerance``), else ``schedule`` itself.

    Raises ``ValueError`` when the check was asked for without ``--loss-reduction``.
    """
    if not getattr(args, "lossfix_self_check", False):
        return schedule
    if getattr(args, "loss_reduction", None) is None:
        raise ValueError("--lossfix-self-check needs --loss-reduction (the plugin must be on)")
    return SelfCheckingSchedule(
        schedule, tolerance=getattr(args, "lossfix_self_check_tolerance", 1e-5) or 1e-5
    )
