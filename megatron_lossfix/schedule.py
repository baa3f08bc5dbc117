"""A drop-in replacement for Megatron-Core's ``forward_backward_func`` that normalizes exactly.

``LossFixSchedule(config)(forward_step_func=..., data_iterator=..., model=..., ...)`` takes the
same keyword arguments as the function returned by ``get_forward_backward_func()``.

With ``reduction="off"`` it is stock Megatron: the wrapped function is called with the caller's
arguments, nothing is communicated and nothing is required of the batches, the loss tuple, the
iterator or the model config. It only looks on (the loss tuples Megatron receives, and loss masks
where the micro-batches are dicts holding one, which it also hands to the loss function as
``batch[config.weights_key]``) so that ``step_metrics()`` can report what it could see.

With a plugin mode, per step it:

1. reads the step's micro-batches on the last pipeline stage (the loss stage) before the schedule
   starts and counts loss tokens and sequences;
2. agrees with every rank of the step that the step can run: one all-reduce over the loss
   stage's data x context-parallel group carries the counts together with the cross-rank checks,
   and, with pipeline parallelism, one small all-reduce over the pipeline group hands the verdict
   to the other stages. A problem on any rank (no mask, a non-dict batch, a missing or
   unreadable iterator, a short iterator, a bad mask, an exception while reading) makes every
   rank of the step raise, within the time of two small collectives, instead of leaving its
   peers blocked in Megatron's point-to-point or gradient communication;
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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.agreement import (
    DISAGREE,
    LOSS_FUNC,
    MALFORMED,
    MASK_VALUES,
    MTP_PROBLEM,
    NO_ITERATOR,
    NOT_DICT,
    OTHER,
    RAN_OUT,
    SLOT_FP,
    SLOT_FP2,
    SLOT_KIND0,
    SLOT_N,
    SLOT_PROBLEMS,
    SLOT_RANK_SUM,
    SLOT_S,
    UNREADABLE,
    VECTOR_LEN,
    LocalProblem,
    StepRefused,
    agreement_vector,
    default_device,
    refuse_hybrid_cp,
    refuse_sharded_mtp,
    verdict,
)
from megatron_lossfix.config import MODES, LossFixConfig
from megatron_lossfix.megatron_compat import (
    StepGroups,
    group_size,
    resolve_groups,
    schedule_for,
    slice_batch_for_cp,
    warn_if_untested,
)
from megatron_lossfix.metrics import StepState, reduce_step_metrics
from megatron_lossfix.mtp import MTPStep, active, install_hooks
from megatron_lossfix.reduction import (
    StepCounts,
    bad_mask_values,
    count_tokens,
    float_masks,
    shifted_masks,
    weights_from_counts,
)

__all__ = ["LossFixSchedule", "StepGroups", "StepRefused", "resolve_groups"]


class _StepIterator:
    """Yields one step's pre-read micro-batches with weights attached; remembers which came
    last."""

    def __init__(self, batches: list, attach: Callable[[Any, int], dict]):
        self._batches = batches
        self._attach = attach
        self.index = -1

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.index + 1 >= len(self._batches):
            raise StopIteration
        self.index += 1
        return self._attach(self._batches[self.index], self.index)


class _Observer:
    """``off``: the caller's iterator, looked through. ``next()`` returns what the source
    returns (a dict holding a loss mask gains the mask as its weights, unless it has weights
    already) and raises what the source raises; other attributes are the source's."""

    def __init__(self, source: Any, on_batch: Callable[[Any], Any]):
        self._source = source
        self._on_batch = on_batch

    def __iter__(self) -> _Observer:
        return self

    def __next__(self) -> Any:
        return self._on_batch(next(self._source))

    def __getattr__(self, name: str) -> Any:
        if name in ("_source", "_on_batch"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self._source, name)


class LossFixSchedule:
    """Megatron ``forward_backward_func`` with exact, layout-invariant loss normalization.

    Loss functions return Megatron's documented 3-tuple with a plain weighted sum,
    ``(sum(weights * per_token_loss), num_tokens, report)``, where ``weights`` is
    ``batch[config.weights_key]`` and ``num_tokens`` the loss tokens this micro-batch holds on
    this rank (:func:`megatron_lossfix.losses.weighted_loss` builds it). With
    ``calculate_per_token_loss=False`` the 2-tuple ``(sum(weights * loss), report)`` works too.

    Args:
        config: the plugin configuration.
        forward_backward_func: Megatron's schedule to wrap; by default
            Megatron's schedule for the call's pipeline group and model chunks (PP/VPP).
        pg_collection: process groups, used when the call passes none; else parallel_state.
            With ``off`` it is used for the metrics only: Megatron gets the caller's arguments.
    """

    def __init__(
        self,
        config: LossFixConfig,
        forward_backward_func: Callable[..., Any] | None = None,
        pg_collection: Any = None,
    ) -> None:
        warn_if_untested()
        self.config = config
        self._inner = forward_backward_func
        self._pg_collection = pg_collection
        self.last_step: StepState | None = None

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
        step = self._stock_step if self.config.reduction == "off" else self._plugin_step
        return step(forward_step_func, data_iterator, model, num_microbatches, kwargs)

    # ------------------------------------------------------------------ off: stock, looked on
    def _stock_step(
        self,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        kwargs: dict,
    ) -> Any:
        state = StepState(
            reduction="off",
            per_token=None,
            passthrough=True,
            groups=None,
            num_microbatches=num_microbatches,
            model=model,
            pg_collection=(
                self._pg_collection
                if kwargs.get("pg_collection") is None
                else kwargs["pg_collection"]
            ),
        )
        self.last_step = state
        # Only the loss chunk's iterator is looked through (the last one; on other pipeline
        # stages nobody calls its loss function and what it reads is never used).
        if isinstance(data_iterator, list) and data_iterator:
            data_iterator = [*data_iterator[:-1], self._observed(data_iterator[-1], state)]
        elif not isinstance(data_iterator, list):
            data_iterator = self._observed(data_iterator, state)

        def forward_step(*args: Any, **kw: Any) -> Any:
            returned = forward_step_func(*args, **kw)
            if not (isinstance(returned, tuple) and len(returned) == 2) or returned[1] is None:
                return returned
            output, loss_func = returned

            def loss(output_tensor: Any, *a: Any, **lkw: Any) -> Any:
                outputs = loss_func(output_tensor, *a, **lkw)
                if not lkw.get("non_loss_data"):
                    self._record_stock(outputs, state)
                return outputs

            return output, loss

        return self._inner_func()(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            **kwargs,
        )

    def _observed(self, source: Any, state: StepState) -> Any:
        # Only real iterators: None, a range or a list go to Megatron as they are, to fail (or
        # not) exactly as they do there.
        if source is None or not hasattr(source, "__next__"):
            return source
        return _Observer(source, lambda batch: self._observe_batch(batch, state))

    def _observe_batch(self, batch: Any, state: StepState) -> Any:
        cfg = self.config
        k = len(state.masks) + state.unmasked
        mask = batch.get(cfg.loss_mask_key) if isinstance(batch, Mapping) else None
        if cfg.check_finite and isinstance(batch, Mapping):
            self._check_finite_inputs(batch, k)
        try:
            if not isinstance(mask, torch.Tensor):
                raise ValueError("no loss mask")
            mask = float_masks([mask])[0]
            segments = self._segments_of(batch, mask, k)
        except ValueError:
            state.unmasked += 1  # stock has no requirement on the batch: recorded, never refused
            return batch
        state.masks.append(mask)
        state.segments.append(segments)
        if cfg.weights_key in batch:
            return batch
        return {**batch, cfg.weights_key: mask}

    def _record_stock(self, outputs: Any, state: StepState) -> None:
        """Remember a loss tuple's numbers for the metrics; never judge it (Megatron does)."""
        loss = num_tokens = report = None
        if isinstance(outputs, (tuple, list)) and len(outputs) in (2, 3):
            loss, report = outputs[0], outputs[-1]
            if len(outputs) == 3 and isinstance(outputs[1], torch.Tensor):
                num_tokens = outputs[1].detach()
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # A copy: Megatron scales the returned tensor in place right after this call.
            loss = loss.detach().clone().reshape(())
            if self.config.check_finite:
                self._check_finite_outputs(loss, report, len(state.raw))
        else:
            loss = None
        state.raw.append((loss, num_tokens))
        state.reports.append(report)

    # ------------------------------------------------------------------ plugin modes
    def _plugin_step(
        self,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        kwargs: dict,
    ) -> Any:
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or (num_microbatches < 1)
        ):
            # The same argument on every rank: every rank raises here, before any collective.
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        cfg = self.config
        self.last_step = None  # a refused step leaves no metrics behind
        chunks = model if isinstance(model, list) else [model]
        refuse_hybrid_cp(chunks[0])
        if kwargs.get("pg_collection") is None and self._pg_collection is not None:
            kwargs["pg_collection"] = self._pg_collection
        groups = resolve_groups(kwargs.get("pg_collection"))
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]

        problem: LocalProblem | None = None
        per_token = False
        mtp_layers = 0
        batches: list = []
        masks: list[torch.Tensor] = []
        segments: list = []
        try:
            from megatron.core.utils import get_model_config

            # A plain ModelParallelConfig has no such field: Megatron's default behaviour.
            model_config = get_model_config(chunks[0])
            per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
            mtp_layers = int(getattr(model_config, "mtp_num_layers", None) or 0)
            refuse_sharded_mtp(mtp_layers, cfg)
            if groups.is_last_stage:
                batches, masks, segments = self._read_step(iterators[-1], num_microbatches)
                if mtp_layers and any(seg is not None for seg, _ in segments):
                    raise LocalProblem(
                        MTP_PROBLEM,
                        "packed micro-batches (cu_seqlens) with multi-token prediction: the "
                        "plugin normalizes MTP layers over whole rows only",
                    )
        except StepRefused:
            raise
        except LocalProblem as exc:
            problem = exc
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
            problem = LocalProblem(OTHER, f"preparing the step raised {type(exc).__name__}: {exc}")
            problem.__cause__ = exc

        passthrough = per_token and cfg.reduction == "token_mean"
        state = StepState(
            reduction=cfg.reduction,
            per_token=per_token,
            passthrough=passthrough,
            groups=groups,
            num_microbatches=num_microbatches,
            model=model,
        )
        mtp_masks = [shifted_masks(masks, j) for j in range(1, mtp_layers + 1)] if masks else []
        counts, mtp_counts = self._agree(
            groups, per_token, masks, segments, problem, mtp_masks, mtp_layers
        )
        state.masks, state.segments, state.counts = masks, segments, counts
        self.last_step = state

        wrapped_step = forward_step_func
        if groups.is_last_stage:
            if passthrough:
                weights = masks  # Megatron's deferred division by N is the exact token mean
            else:
                weights = weights_from_counts(
                    masks,
                    counts,
                    cfg.reduction,
                    norm_constant=cfg.norm_constant,
                    segment_ids=[seg for seg, _ in segments],
                )
            step_iter = _StepIterator(
                batches, lambda batch, k: self._with_weights(batch, k, weights[k])
            )
            if mtp_layers:
                state.mtp = self._mtp_step(
                    mtp_masks, mtp_counts, model_config, groups, state, step_iter
                )
            iterators = [*iterators[:-1], step_iter]
            wrapped_step = self._wrap_forward_step(
                forward_step_func, step_iter, num_microbatches, groups, state
            )
        result = self._inner_func(model, groups.pp)(
            forward_step_func=wrapped_step,
            data_iterator=iterators if isinstance(data_iterator, list) else iterators[0],
            model=model,
            num_microbatches=num_microbatches,
            **kwargs,
        )
        self._agree_after(groups, state)
        return result

    def _read_step(
        self, source: Any, num_microbatches: int
    ) -> tuple[list, list[torch.Tensor], list]:
        """The loss stage's micro-batches, their float masks and packed-sequence segments.

        Raises ``LocalProblem`` naming what is wrong; the caller shares it with every rank."""
        if source is None:
            raise LocalProblem(
                NO_ITERATOR,
                "the last pipeline stage needs a data iterator: it holds the loss (got None)",
            )
        batches = []
        for k in range(num_microbatches):
            try:
                batches.append(next(source))
            except StopIteration:
                raise LocalProblem(
                    RAN_OUT,
                    f"the data iterator ran out after {k} micro-batches but "
                    f"num_microbatches={num_microbatches}",
                ) from None
            except Exception as exc:
                hint = (
                    "; pass an iterator (iter(...)), not an iterable"
                    if not hasattr(source, "__next__")
                    else ""
                )
                problem = LocalProblem(
                    UNREADABLE,
                    f"reading micro-batch {k} from the data iterator raised "
                    f"{type(exc).__name__}: {exc}{hint}",
                )
                raise problem from exc
        raw_masks = []
        for k, batch in enumerate(batches):
            try:
                raw_masks.append(self._mask_of(batch, k))
            except ValueError as exc:
                raise LocalProblem(NOT_DICT, str(exc)) from None
        try:
            masks = float_masks(raw_masks)
            segments = [self._segments_of(b, masks[k], k) for k, b in enumerate(batches)]
        except ValueError as exc:
            raise LocalProblem(MALFORMED, str(exc)) from None
        return batches, masks, segments

    def _fingerprint(self, per_token: bool) -> float:
        """A small integer that differs between any two (reduction, per-token) settings."""
        return float(1 + 2 * MODES.index(self.config.reduction) + int(per_token))

    def _agree(
        self,
        groups: StepGroups,
        per_token: bool,
        masks: list[torch.Tensor],
        segments: list,
        problem: LocalProblem | None,
        mtp_masks: list[list[torch.Tensor]] = (),
        mtp_layers: int = 0,
    ) -> tuple[StepCounts | None, list[StepCounts]]:
        """Count the step's tokens and agree, on every rank of the step, that it can run.

        The loss stage sums ``[N, S, fp, fp**2, problems...]`` over its data x context-parallel
        group (the counts' own all-reduce: CP ranks hold the same sequences, so N and S are
        divided by the CP size); with pipeline parallelism every stage then sums the verdict
        over the pipeline group. All fingerprints are equal exactly when
        ``sum(fp)**2 == n * sum(fp**2)``. One device sync, after the last collective. Returns
        the counts on the loss stage, None elsewhere, and those of each MTP layer's shifted
        masks (``mtp_masks``; empty elsewhere), which ride in the same all-reduce; raises on
        every rank when any refused.
        """
        cfg = self.config
        # On the accelerator whatever device the masks are on: NCCL reduces CUDA tensors only,
        # and every stage must bring the same kind of tensor to the pipeline all-reduce.
        device = default_device()
        fp = self._fingerprint(per_token)
        rank = dist.get_rank() if dist.is_initialized() else 0
        vec = agreement_vector(problem, rank, device, mtp_layers)
        vec[SLOT_FP], vec[SLOT_FP2] = fp, fp * fp

        local_counts = bad = None
        mtp_local: list[StepCounts] = []
        # CP shards are counted with one more all-reduce over CP, of a size only healthy ranks
        # know: with sharded data the checks go first (one extra collective in this layout).
        sharded_cp = cfg.data_is_cp_sharded and groups.cp_size > 1
        if groups.is_last_stage:
            if problem is None:
                if cfg.validate:
                    bad = bad_mask_values(masks)
                    flagged = bad.any().to(device=device, dtype=torch.float64)
                    vec[SLOT_PROBLEMS] += flagged
                    vec[SLOT_RANK_SUM] += flagged * (rank + 1)
                    vec[SLOT_KIND0 + MASK_VALUES] += flagged
                if not sharded_cp:
                    local_counts = self._count(masks, segments, None)
                    vec[SLOT_N], vec[SLOT_S] = local_counts.num_tokens, local_counts.num_sequences
                    mtp_local = [self._count(m, segments, None) for m in mtp_masks]
                    for j, layer in enumerate(mtp_local):
                        vec[VECTOR_LEN + 2 * j] = layer.num_tokens
                        vec[VECTOR_LEN + 2 * j + 1] = layer.num_sequences
            vec = self._reduce(vec, groups.dp_cp)
            # Disagreement inside the group becomes a problem that every stage hears of.
            n = float(groups.dp_cp_size)
            disagree = (vec[SLOT_FP] * vec[SLOT_FP] != n * vec[SLOT_FP2]).to(vec.dtype)
            vec[SLOT_KIND0 + DISAGREE] += disagree
            vec[SLOT_PROBLEMS] += disagree
            vec[SLOT_FP], vec[SLOT_FP2] = fp, fp * fp
            if sharded_cp and problem is None and vec[SLOT_PROBLEMS].item() == 0:
                local_counts = self._count(masks, segments, groups.cp)
                totals = torch.stack([local_counts.num_tokens, local_counts.num_sequences])
                totals = self._reduce(totals.to(device), groups.dp)
                vec[SLOT_N], vec[SLOT_S] = totals[0] * groups.cp_size, totals[1] * groups.cp_size
        if groups.pp_size > 1:
            vec = self._reduce(vec, groups.pp)
        verdict(vec.tolist(), groups, self.config.reduction, per_token, problem, bad)
        if local_counts is None:
            return None, []
        # Every CP rank holds the same sequences (whole, or after the CP sum of shards).
        replicas = float(groups.cp_size)
        mask_device = masks[0].device

        def totals(at: int, local: StepCounts) -> StepCounts:
            return StepCounts(
                num_tokens=(vec[at] / replicas).to(mask_device),
                num_sequences=(vec[at + 1] / replicas).to(mask_device),
                seq_tokens=local.seq_tokens,
                mb_tokens=local.mb_tokens,
                dp_size=groups.dp_size,
            )

        layers = [totals(VECTOR_LEN + 2 * j, c) for j, c in enumerate(mtp_local)]
        return totals(SLOT_N, local_counts), layers

    def _agree_after(self, groups: StepGroups, state: StepState) -> None:
        """Refuse the step on every rank if the loss stage hit an error inside the schedule.

        Such an error (a loss function that raised or returned no one-element tensor, a
        forward step that never read its micro-batch, a non-finite loss under check_finite)
        does not stop the loss stage: it hands Megatron a zero loss and lets the schedule end,
        so no peer is left in point-to-point or in DDP's all-reduce. Then this one small
        all-reduce over DP x CP (loss stage) and, with pipelining, over the pipeline group tells
        every rank; the step's gradients are not to be used. A single-rank step needs none.
        """
        problem = state.problem
        if problem is None and groups.dp_cp_size <= 1 and groups.pp_size <= 1:
            return  # nobody to tell, nothing to tell: no device sync
        rank = dist.get_rank() if dist.is_initialized() else 0
        vec = agreement_vector(problem, rank, default_device())
        if groups.is_last_stage:
            vec = self._reduce(vec, groups.dp_cp)
        vec = self._reduce(vec, groups.pp)
        values = vec.tolist()  # fingerprints stay 0: no disagreement to find here
        if values[SLOT_PROBLEMS] > 0:
            self.last_step = None
            verdict(values, groups, self.config.reduction, bool(state.per_token), problem, None)

    @staticmethod
    def _count(
        masks: list[torch.Tensor], segments: list, cp_group: dist.ProcessGroup | None
    ) -> StepCounts:
        """This rank's counts (over its CP shards when ``cp_group`` is given), not over DP."""
        return count_tokens(
            masks,
            global_counts=False,
            cp_group=cp_group,
            segment_ids=[seg for seg, _ in segments],
            num_segments=[num for _, num in segments],
        )

    @staticmethod
    def _reduce(vec: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        if group_size(group) > 1:
            dist.all_reduce(vec, group=group)
        return vec

    # ------------------------------------------------------------------ batches
    def _mask_of(self, batch: Any, k: int) -> torch.Tensor:
        key = self.config.loss_mask_key
        if not isinstance(batch, Mapping) or key not in batch:
            raise ValueError(
                f"micro-batch {k} must be a dict holding the loss mask under {key!r} "
                f"(LossFixConfig.loss_mask_key); got {type(batch).__name__}"
                + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            )
        return batch[key]

    def _with_weights(self, batch: Mapping, k: int, weights: torch.Tensor) -> dict:
        if self.config.check_finite:
            self._check_finite_inputs(batch, k)
        return {**batch, self.config.weights_key: weights}

    @staticmethod
    def _check_finite_inputs(batch: Mapping, k: int) -> None:
        # Rollout data (advantages, old and reference log-probs) is where NaN usually enters
        # RL; naming the tensor and micro-batch beats a NaN loss three steps later.
        for key, value in batch.items():
            if (
                isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and not bool(torch.isfinite(value).all())
            ):
                raise FloatingPointError(
                    f"micro-batch {k}: {key!r} holds NaN or Inf (check_finite is on)"
                )

    def _segments_of(
        self, batch: Mapping, mask: torch.Tensor, k: int
    ) -> tuple[torch.Tensor | None, int | None]:
        """Packed (THD) micro-batch: each token's sequence index from ``cu_seqlens``."""
        cu_seqlens = batch.get(self.config.cu_seqlens_key)
        if cu_seqlens is None:
            return None, None
        if self.config.data_is_cp_sharded:
            raise ValueError(
                "packed sequences need whole sequences from the data iterator: slice them for "
                "context parallelism in forward_step (data_is_cp_sharded=False)"
            )
        if (
            not isinstance(cu_seqlens, torch.Tensor)
            or cu_seqlens.dim() != 1
            or (cu_seqlens.numel() < 2)
        ):
            raise ValueError(
                f"micro-batch {k}: {self.config.cu_seqlens_key!r} must be a 1-D tensor of "
                "cumulative sequence lengths starting at 0"
            )
        if mask.shape[0] != 1:
            raise ValueError(
                f"micro-batch {k} is packed ({self.config.cu_seqlens_key!r} given) but its mask "
                f"is {tuple(mask.shape)}; packed micro-batches are [1, total_tokens]"
            )
        positions = torch.arange(mask.shape[1], device=mask.device)
        boundaries = cu_seqlens.to(device=mask.device, dtype=torch.long)[1:].contiguous()
        # Tokens past the last boundary (padding) land in one extra, normally empty, segment.
        segment = torch.searchsorted(boundaries, positions, right=True)
        return segment[None, :], cu_seqlens.numel()

    # ------------------------------------------------------------------ the loss
    def _wrap_forward_step(
        self,
        forward_step_func: Callable,
        step_iter: _StepIterator,
        num_microbatches: int,
        groups: StepGroups,
        state: StepState,
    ) -> Callable:
        if state.passthrough:
            scale = None
        elif state.per_token:
            # Megatron divides the summed gradient by the all-reduced num_tokens, which is N.
            scale = state.counts.num_tokens.to(torch.float32)
        else:
            # The schedule multiplies by cp/M and DDP divides by D*cp: undo both.
            scale = float(num_microbatches * groups.dp_size)

        def forward_step(data_iterator: Any, model: Any, *args: Any) -> tuple:
            if data_iterator is not step_iter:
                # Another model chunk: Megatron never calls its loss.
                return forward_step_func(data_iterator, model, *args)
            with active(state.mtp):  # the model computes its MTP losses in this call
                output, loss_func = forward_step_func(data_iterator, model, *args)
            k = step_iter.index
            if state.mtp is not None and state.mtp.problem and state.problem is None:
                state.problem = LocalProblem(MTP_PROBLEM, state.mtp.problem)

            def loss(output_tensor: Any, *a: Any, **kw: Any) -> tuple:
                if state.problem is not None:
                    return self._zero_loss(output_tensor, state)
                try:
                    if k < 0:
                        raise ValueError(
                            "forward_step_func returned without reading its micro-batch from "
                            "the data iterator on the loss stage"
                        )
                    outputs = loss_func(output_tensor, *a, **kw)
                    if kw.get("non_loss_data"):
                        return outputs
                    return self._convert(outputs, k, scale, state)
                except Exception as exc:  # noqa: BLE001 - every rank hears of it after the step
                    message = f"{type(exc).__name__}: {exc}"
                    if f"micro-batch {k}" not in message:
                        message = f"micro-batch {k}: {message}"
                    state.problem = LocalProblem(LOSS_FUNC, message)
                    state.problem.__cause__ = exc
                    return self._zero_loss(output_tensor, state)

            return output, loss

        return forward_step

    def _mtp_step(
        self,
        mtp_masks: list[list[torch.Tensor]],
        mtp_counts: list[StepCounts],
        model_config: Any,
        groups: StepGroups,
        state: StepState,
        step_iter: _StepIterator,
    ) -> MTPStep:
        """Each MTP layer's weights: the mode over the layer's shifted masks with their global
        counts, times what undoes Megatron's averaging of the MTP loss, sliced for CP."""
        cfg = self.config
        install_hooks()
        if state.per_token:
            # finalize_model_grads divides every gradient by the all-reduced num_tokens, N.
            factor: torch.Tensor | float = state.counts.num_tokens.to(torch.float32)
        else:
            # The schedule scales the MTP loss by 1/M (by no CP factor, unlike the main loss)
            # and DDP divides the gradient by D * cp.
            factor = float(state.num_microbatches * groups.dp_size * groups.cp_size)
        weights = []
        for masks, counts in zip(mtp_masks, mtp_counts, strict=True):
            layer = weights_from_counts(
                masks, counts, cfg.reduction, norm_constant=cfg.norm_constant
            )
            layer = [w * factor for w in layer]
            if groups.cp_size > 1:
                layer = [slice_batch_for_cp({"w": w}, groups.cp)["w"] for w in layer]
            weights.append(layer)
        return MTPStep(
            weights=weights,
            factor=factor,
            scale=float(model_config.mtp_loss_scaling_factor) / len(weights),
            microbatch=lambda: step_iter.index,
        )

    def _convert(
        self, outputs: Any, k: int, scale: torch.Tensor | float | None, state: StepState
    ) -> tuple:
        """Check one micro-batch's loss tuple and return what Megatron should receive."""
        per_token = state.per_token
        if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
            raise ValueError(
                "loss_func must return (loss, num_tokens, report) or (loss, report); got "
                + (
                    f"a tuple of length {len(outputs)}"
                    if isinstance(outputs, (tuple, list))
                    else type(outputs).__name__
                )
            )
        loss, report = outputs[0], outputs[-1]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise ValueError(
                f"loss_func must return a one-element loss tensor first, got "
                f"{type(loss).__name__}{shape} (micro-batch {k})"
            )
        if len(outputs) == 2 and per_token:
            raise ValueError(
                "calculate_per_token_loss=True needs loss_func to return (loss, num_tokens, "
                "report), the loss tokens of the micro-batch on this rank; got (loss, report). "
                "Return a 3-tuple (megatron_lossfix.weighted_loss does), or set "
                "calculate_per_token_loss=False."
            )
        if self.config.check_finite:
            self._check_finite_outputs(loss, report, k)
        num_tokens = outputs[1] if len(outputs) == 3 else None
        state.contributions.append(loss.detach().reshape(()))
        if num_tokens is not None:
            state.local_tokens.append(num_tokens.detach())
        state.reports.append(report)
        if state.passthrough:
            return outputs  # Megatron's own semantics, untouched
        if per_token:
            return loss * scale, num_tokens, report
        return loss * scale, report

    @staticmethod
    def _zero_loss(output_tensor: Any, state: StepState) -> tuple:
        """A loss of 0 with the output's graph, in the form Megatron expects: the schedule ends
        normally (backward sends zero gradients upstream) and the step is refused after it."""
        if isinstance(output_tensor, torch.Tensor) and output_tensor.is_floating_point():
            zero = (output_tensor * 0).sum().float()
        else:
            zero = torch.zeros((), device=default_device())
        if state.per_token:
            return zero, torch.zeros((), dtype=torch.int, device=zero.device), {}
        return zero, {}

    @staticmethod
    def _check_finite_outputs(loss: torch.Tensor, report: Any, k: int) -> None:
        if not bool(torch.isfinite(loss).all()):
            raise FloatingPointError(
                f"loss of micro-batch {k} is not finite ({loss.item()}); check_finite is on"
            )
        for key, value in report.items() if isinstance(report, Mapping) else ():
            # Extremes (ratio_min/_max) may legitimately be +-inf on a zero-token micro-batch.
            if (
                isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and bool(torch.isnan(value).any())
            ):
                raise FloatingPointError(
                    f"report entry {key!r} of micro-batch {k} is NaN (check_finite is on)"
                )

    # ------------------------------------------------------------------ metrics
    def step_metrics(self) -> dict[str, float]:
        """The last step's global metrics, on every rank (collectives over DP x CP and PP).

        ``loss`` is L of docs/design.md §2 (with ``off``: the stock per-micro-batch mean Megatron
        optimizes), ``num_tokens`` N and ``num_sequences`` S; report entries that are 0-dim
        tensors named ``*_sum``/``*_count``, ``*_max`` or ``*_min`` are reduced that way over
        DP x CP. With ``off`` a number is left out when the step did not show it: ``loss`` when
        a loss was not a one-element tensor, ``num_tokens`` when neither loss masks nor
        3-tuples gave it, ``num_sequences`` without loss masks.
        """
        return reduce_step_metrics(self.last_step, self.config)
