"""A drop-in replacement for Megatron-Core's ``forward_backward_func`` that normalizes exactly.

``LossFixSchedule(config)(forward_step_func=..., data_iterator=..., model=..., ...)`` takes the
same keyword arguments as the function returned by ``get_forward_backward_func()``. Per step it:

1. reads the step's micro-batches on the last pipeline stage (the loss stage) and counts loss
   tokens and sequences with one all-reduce (``reduction.count_tokens``);
2. puts per-token weights into every micro-batch dict (``batch[config.weights_key]``);
3. runs Megatron's own schedule, wrapping each ``loss_func`` so that what Megatron receives,
   after its internal averaging, yields exactly ``sum(w * loss)``:

   ===========================  =============================  ==============================
   Megatron path                 Megatron does                  the plugin hands it
   ===========================  =============================  ==============================
   calculate_per_token_loss=F    loss*cp/M, grads /(D*cp)       (sum(w*l) * M * D, report)
   calculate_per_token_loss=T    grads / all-reduced num_tokens  (sum(w*l) * N, n_local, report)
   ===========================  =============================  ==============================

   With ``calculate_per_token_loss=True`` and ``token_mean``, Megatron's own deferred division
   by the global token count already is the exact answer: no pre-pass (streaming data), the
   weights are the mask, and ``(sum(m*l), n_local, report)`` goes through unchanged.

User loss functions follow Tinker semantics: they return ``(sum(weights * per_token_loss),
report)`` using the weights found in their micro-batch. Nothing inside the micro-batch loop
synchronizes with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.config import MODES, LossFixConfig
from megatron_lossfix.megatron_compat import schedule_for, warn_if_untested
from megatron_lossfix.reduction import (
    StepCounts,
    _bad_mask_message,
    _check_masks,
    _float_masks,
    bad_mask_values,
    count_tokens,
    weights_from_counts,
)

__all__ = ["LossFixSchedule", "StepGroups", "resolve_groups"]


@dataclass(frozen=True, slots=True)
class StepGroups:
    """The process groups the plugin needs, taken from Megatron's ``ProcessGroupCollection``."""

    dp: dist.ProcessGroup | None
    """Data-parallel group without context parallelism: sequence and token counts."""
    cp: dist.ProcessGroup | None
    """Context-parallel group: per-sequence counts of CP-sharded data."""
    dp_cp: dist.ProcessGroup | None
    """Data x context-parallel group: the step's reported loss."""
    pp: dist.ProcessGroup | None
    """Pipeline group: finding the last (loss) stage, sharing metrics with the other stages."""

    @property
    def dp_size(self) -> int:
        return _size(self.dp)

    @property
    def cp_size(self) -> int:
        return _size(self.cp)

    @property
    def is_last_stage(self) -> bool:
        return self.pp is None or dist.get_rank(self.pp) == _size(self.pp) - 1


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _ProblemOnAnotherRank(ValueError):
    """Raised on every rank when some data-parallel rank's micro-batches failed validation."""


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_groups(pg_collection: Any = None) -> StepGroups:
    """Groups from an explicit ``ProcessGroupCollection``, else from Megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    def pick(name: str, fallback: Callable[[], Any]) -> Any:
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        return group if group is not None else fallback()

    return StepGroups(
        dp=pick("dp", lambda: ps.get_data_parallel_group(with_context_parallel=False)),
        cp=pick("cp", ps.get_context_parallel_group),
        dp_cp=pick("dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        pp=pick("pp", ps.get_pipeline_model_parallel_group),
    )


class _StepIterator:
    """Yields one step's micro-batches with weights attached; remembers which came last.

    ``source`` is either the step's pre-read micro-batches or, for streaming modes, the user's
    iterator itself (read lazily, one micro-batch per forward step)."""

    def __init__(self, source: Iterator, limit: int, attach: Callable[[Any, int], dict]):
        self._source = source
        self._limit = limit
        self._attach = attach
        self.index = -1

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.index + 1 >= self._limit:
            raise StopIteration
        try:
            batch = next(self._source)
        except StopIteration:
            raise ValueError(
                f"the data iterator ran out after {self.index + 1} micro-batches but "
                f"num_microbatches={self._limit}"
            ) from None
        self.index += 1
        return self._attach(batch, self.index)


@dataclass(slots=True)
class _StepState:
    """What one step recorded on this rank, for metrics (tensors stay on device)."""

    reduction: str
    per_token: bool
    streaming: bool
    groups: StepGroups
    counts: StepCounts | None = None
    masks: list[torch.Tensor] = field(default_factory=list)
    segments: list[tuple[torch.Tensor | None, int | None]] = field(default_factory=list)
    contributions: list[torch.Tensor] = field(default_factory=list)
    local_tokens: list[torch.Tensor] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)


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
        self.last_step: _StepState | None = None

    # ------------------------------------------------------------------ the step
    def __call__(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        **kwargs: Any,
    ) -> list:
        from megatron.core.utils import get_model_config

        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or (
            num_microbatches < 1
        ):
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        cfg = self.config
        chunks = model if isinstance(model, list) else [model]
        per_token = bool(get_model_config(chunks[0]).calculate_per_token_loss)
        if kwargs.get("pg_collection") is None and self._pg_collection is not None:
            kwargs["pg_collection"] = self._pg_collection
        groups = resolve_groups(kwargs.get("pg_collection"))
        # Megatron's deferred per-token division is already exact for token_mean, and `off` is
        # stock: both read the data lazily (streaming) and use the mask as the weights.
        streaming = cfg.reduction == "off" or (per_token and cfg.reduction == "token_mean")
        state = _StepState(
            reduction=cfg.reduction, per_token=per_token, streaming=streaming, groups=groups
        )
        self.last_step = state

        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        wrapped_step = forward_step_func
        if groups.is_last_stage:
            # The loss is computed by the last model chunk of the last pipeline stage.
            source = iterators[-1]
            if source is None:
                raise ValueError("the last pipeline stage needs a data iterator: it holds the loss")
            if streaming:
                self._agree(groups, per_token, problem=None)
                attach = self._attach_mask_weights
            else:
                batches, attach = self._prepare_step(source, num_microbatches, groups, per_token)
                source = iter(batches)
            step_iter = _StepIterator(source, num_microbatches, attach)
            iterators = [*iterators[:-1], step_iter]
            wrapped_step = self._wrap_forward_step(
                forward_step_func, step_iter, streaming, num_microbatches, groups
            )

        inner = self._inner
        if inner is None:
            inner = schedule_for(model, groups.pp)
        result = inner(
            forward_step_func=wrapped_step,
            data_iterator=iterators if isinstance(data_iterator, list) else iterators[0],
            model=model,
            num_microbatches=num_microbatches,
            **kwargs,
        )
        if streaming and cfg.validate and state.masks:
            # Streaming data is checked after the step (one sync), before any optimizer step.
            _check_masks(state.masks, check_values=True)
        return result

    # ------------------------------------------------------------------ the pre-pass
    def _fingerprint(self, per_token: bool) -> float:
        """A small integer that differs between any two (reduction, per-token) settings."""
        return float(1 + 2 * MODES.index(self.config.reduction) + int(per_token))

    def _agree(
        self,
        groups: StepGroups,
        per_token: bool,
        problem: torch.Tensor | None,
        counts: Callable[[torch.Tensor], StepCounts] | None = None,
    ) -> StepCounts | None:
        """The step's one collective: counts (when given) plus cross-rank checks, summed over DP.

        Every rank of the DP group contributes ``[fp, fp**2, problems]``; all fingerprints are
        equal exactly when ``sum(fp)**2 == D * sum(fp**2)``, and a problem on any rank (a bad
        mask, a short iterator) makes every rank raise instead of leaving the others hanging
        in a collective. Costs one device sync when ``validate`` is on or a problem is local.
        """
        fp = self._fingerprint(per_token)
        device = problem.device if problem is not None else _default_device()
        local_problem = problem if problem is not None else torch.zeros((), device=device)
        piggyback = torch.stack(
            [
                torch.tensor(fp, dtype=torch.float64, device=device),
                torch.tensor(fp * fp, dtype=torch.float64, device=device),
                local_problem.to(torch.float64),
            ]
        )
        result = None
        if counts is not None:
            result = counts(piggyback)
            reduced = result.piggyback
        else:
            # Same length as count_tokens' [N, S, *piggyback], so that even ranks that disagree
            # on the mode (one counting, one streaming) meet in a well-formed collective.
            reduced = torch.cat([piggyback.new_zeros(2), piggyback])
            if groups.dp_size > 1:
                dist.all_reduce(reduced, group=groups.dp)
            reduced = reduced[2:]
        if not (self.config.validate or problem is not None):
            return result
        fp_sum, fp_sq, problems = reduced.tolist()
        if fp_sum * fp_sum != groups.dp_size * fp_sq:
            raise ValueError(
                "data-parallel ranks disagree on the loss reduction or calculate_per_token_loss "
                f"(this rank: {self.config.reduction!r}, per-token={per_token}); give every "
                "rank the same --loss-reduction"
            )
        if problems > 0:
            raise _ProblemOnAnotherRank(
                "a data-parallel rank found a problem with its micro-batches this step (see "
                "that rank's error); every rank stops"
            )
        return result

    def _prepare_step(
        self, source: Iterator, num_microbatches: int, groups: StepGroups, per_token: bool
    ) -> tuple[list, Callable[[Any, int], dict]]:
        """Pre-read the step, count tokens once; return the batches and how to attach weights."""
        cfg = self.config
        state = self.last_step
        error: ValueError | None = None
        try:
            batches = []
            for k in range(num_microbatches):
                try:
                    batches.append(next(source))
                except StopIteration:
                    raise ValueError(
                        f"the data iterator ran out after {k} micro-batches but "
                        f"num_microbatches={num_microbatches}"
                    ) from None
            masks = _float_masks([self._mask_of(b, k) for k, b in enumerate(batches)])
            segments = [self._segments_of(b, masks[k], k) for k, b in enumerate(batches)]
        except ValueError as exc:
            error = exc
        if error is not None:
            # Still take part in the step's collective, so the other ranks fail too, not hang.
            try:
                self._agree(groups, per_token, problem=torch.ones((), device=_default_device()))
            except _ProblemOnAnotherRank:
                pass
            raise error
        bad = bad_mask_values(masks) if cfg.validate else None
        try:
            counts = self._agree(
                groups,
                per_token,
                problem=None if bad is None else bad.sum(),
                counts=lambda piggyback: count_tokens(
                    masks,
                    dp_group=groups.dp,
                    cp_group=groups.cp if cfg.data_is_cp_sharded else None,
                    segment_ids=[seg for seg, _ in segments],
                    num_segments=[num for _, num in segments],
                    piggyback=piggyback,
                ),
            )
        except _ProblemOnAnotherRank:
            if bad is not None and bool(bad.any()):
                raise ValueError(_bad_mask_message(int(bad.nonzero()[0, 0]))) from None
            raise
        state.masks = masks
        state.segments = segments
        state.counts = counts
        weights = weights_from_counts(
            masks,
            counts,
            cfg.reduction,
            norm_constant=cfg.norm_constant,
            segment_ids=[seg for seg, _ in segments],
        )
        return batches, lambda batch, k: self._with_weights(batch, k, weights[k])

    def _mask_of(self, batch: Any, k: int) -> torch.Tensor:
        key = self.config.loss_mask_key
        if not isinstance(batch, Mapping) or key not in batch:
            raise ValueError(
                f"micro-batch {k} must be a dict holding the loss mask under {key!r} "
                f"(LossFixConfig.loss_mask_key); got {type(batch).__name__}"
                + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            )
        return batch[key]

    def _attach_mask_weights(self, batch: Any, k: int) -> dict:
        mask = _float_masks([self._mask_of(batch, k)])[0]
        self.last_step.masks.append(mask)
        self.last_step.segments.append(self._segments_of(batch, mask, k))
        return self._with_weights(batch, k, mask)

    def _with_weights(self, batch: Mapping, k: int, weights: torch.Tensor) -> dict:
        if self.config.check_finite:
            # Rollout data (advantages, old and reference log-probs) is where NaN usually
            # enters RL; naming the tensor and micro-batch beats a NaN loss three steps later.
            for key, value in batch.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(
                    torch.isfinite(value).all()
                ):
                    raise FloatingPointError(
                        f"micro-batch {k}: {key!r} holds NaN or Inf (check_finite is on)"
                    )
        return {**batch, self.config.weights_key: weights}

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
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or (
            cu_seqlens.numel() < 2
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

    def _wrap_forward_step(
        self,
        forward_step_func: Callable,
        step_iter: _StepIterator,
        streaming: bool,
        num_microbatches: int,
        groups: StepGroups,
    ) -> Callable:
        state = self.last_step
        if streaming:
            scale = None
        elif state.per_token:
            # Megatron divides the summed gradient by the all-reduced num_tokens, which is N.
            scale = state.counts.num_tokens.to(torch.float32)
        else:
            # The schedule multiplies by cp/M and DDP divides by D*cp: undo both.
            scale = float(num_microbatches * groups.dp_size)
        sizes = (num_microbatches, groups.dp_size, groups.cp_size)

        def forward_step(data_iterator: Any, model: Any, *args: Any) -> tuple:
            output, loss_func = forward_step_func(data_iterator, model, *args)
            if data_iterator is not step_iter:
                return output, loss_func  # another model chunk: Megatron never calls its loss
            k = step_iter.index
            if k < 0:
                raise ValueError(
                    "forward_step_func returned without reading its micro-batch from the data "
                    "iterator on the loss stage"
                )

            def loss(output_tensor: Any, *a: Any, **kw: Any) -> tuple:
                outputs = loss_func(output_tensor, *a, **kw)
                if kw.get("non_loss_data"):
                    return outputs
                return self._convert(outputs, k, scale, streaming, sizes)

            return output, loss

        return forward_step

    def _convert(
        self,
        outputs: Any,
        k: int,
        scale: torch.Tensor | float | None,
        streaming: bool,
        sizes: tuple[int, int, int],
    ) -> tuple:
        """Check one micro-batch's loss tuple and return what Megatron should receive."""
        cfg = self.config
        state = self.last_step
        per_token = state.per_token
        if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
            raise ValueError(
                "loss_func must return (loss, num_tokens, report) or (loss, report); got "
                + (f"a tuple of length {len(outputs)}" if isinstance(outputs, (tuple, list))
                   else type(outputs).__name__)
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
        if cfg.check_finite:
            self._check_finite_outputs(loss, report, k)
        num_tokens = outputs[1] if len(outputs) == 3 else None
        state.contributions.append(self._contribution(loss, num_tokens, sizes))
        if num_tokens is not None:
            state.local_tokens.append(num_tokens.detach())
        state.reports.append(report)
        if streaming:
            return tuple(outputs)  # Megatron's own semantics, untouched
        if per_token:
            return loss * scale, num_tokens, report
        return loss * scale, report

    @staticmethod
    def _check_finite_outputs(loss: torch.Tensor, report: Any, k: int) -> None:
        if not bool(torch.isfinite(loss).all()):
            raise FloatingPointError(
                f"loss of micro-batch {k} is not finite ({loss.item()}); check_finite is on"
            )
        for key, value in (report.items() if isinstance(report, Mapping) else ()):
            # Extremes (ratio_min/_max) may legitimately be +-inf on a zero-token micro-batch.
            if (
                isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and bool(torch.isnan(value).any())
            ):
                raise FloatingPointError(
                    f"report entry {key!r} of micro-batch {k} is NaN (check_finite is on)"
                )

    def _contribution(
        self, loss: torch.Tensor, num_tokens: torch.Tensor | None, sizes: tuple[int, int, int]
    ) -> torch.Tensor:
        """This micro-batch's share of the step's reported loss (summed over DP x CP later)."""
        loss = loss.detach().reshape(())
        if self.config.enabled or self.last_step.per_token:
            return loss  # streaming per-token steps are divided by N in the metrics
        m, d, cp = sizes
        if num_tokens is None:  # stock 2-tuple: loss * cp / M, grads / (D * cp)
            return loss / (m * d)
        return loss / torch.clamp(num_tokens, min=1) / (m * d * cp)

    # ------------------------------------------------------------------ metrics
    def step_metrics(self) -> dict[str, float]:
        """The last step's global metrics, on every rank (collectives over DP x CP and PP).

        ``loss`` is L of DESIGN §2 (with ``off``: the stock per-micro-batch mean Megatron
        optimizes), ``num_tokens`` N and ``num_sequences`` S; report entries that are 0-dim
        tensors named ``*_sum``/``*_count``, ``*_max`` or ``*_min`` are reduced that way over
        DP x CP.
        """
        from megatron_lossfix.metrics import reduce_step_metrics

        return reduce_step_metrics(self.last_step, self.config)
