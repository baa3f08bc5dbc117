"""``LossFixSchedule``: Megatron's ``forward_backward_func``, normalizing exactly.

Called with the keyword arguments of the function ``get_forward_backward_func()`` returns. With
``off`` it calls the wrapped function with the caller's own arguments and returns its result
unchanged. With a mode, one step (docs/design.md §3):

1. the loss stage (last pipeline stage) reads the step's micro-batches (:meth:`_read`);
2. every rank agrees that the step can run (:func:`_agree`): one all-reduce over the loss
   stage's DP x CP group carries the counts with the cross-rank checks, one over the pipeline
   group the verdict; a problem on any rank makes every rank raise :class:`StepRefused` rather
   than leave its peers blocked in Megatron's communication;
3. each micro-batch gets its weights, ``batch[config.weights_key]`` (:meth:`_weighted`);
4. Megatron's schedule runs; each loss tuple is checked and multiplied by what undoes
   Megatron's averaging, so the gradient is that of ``sum(w * l)`` (:meth:`_wrap`);
5. if a loss function failed inside it (the loss stage ran on with zero losses), a second small
   agreement refuses the step on every rank (:func:`_agree_after`).

Nothing in the micro-batch loop synchronizes with the host. Tensor-parallel peers are not part
of the agreement: they read the same data and fail alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import megatron_lossfix.megatron_compat as megatron_compat
import megatron_lossfix.reduction as reduction
from megatron_lossfix.mtp import MTPStep, active, mtp_step
from megatron_lossfix.reduction import LossFixConfig, StepCounts
from megatron_lossfix.selfcheck import SelfCheck


class StepRefused(ValueError):
    """Raised on every rank of a step the plugin refused: on the rank whose data caused it the
    message says what is wrong, on its peers which rank reported what kind of problem."""


class ProblemOnAnotherRank(StepRefused):
    """Raised on the ranks whose own data was fine when another rank of the step refused."""


# What a rank can report, one slot each in the agreement vector.
KINDS: tuple[str, ...] = (
    "the loss stage has no data iterator",
    "the loss stage's data iterator could not be read",
    "the loss stage's data iterator ran out before num_microbatches",
    "a micro-batch is not a dict holding the loss mask",
    "a loss mask is malformed",
    "a loss mask holds values other than 0 and 1",
    "an error while preparing the step",
    "ranks disagree on the loss reduction or calculate_per_token_loss",
    "the loss function failed or returned what the plugin cannot use",
    "the multi-token prediction loss could not be normalized",
    "the model's gradients are not reduced across data-parallel ranks",
)
(
    NO_ITERATOR, UNREADABLE, RAN_OUT, NOT_DICT, MALFORMED, MASK_VALUES, OTHER, DISAGREE,
    LOSS_FUNC, MTP_PROBLEM, UNREDUCED,
) = range(len(KINDS))  # fmt: skip
# The agreement vector (float64: exact counts below 2**53): [N, S, fingerprint, fingerprint**2,
# ranks with a problem, sum of their (global rank + 1), one count per kind], then N and S of
# each MTP layer's shifted masks.
SLOT_N, SLOT_S, SLOT_FP, SLOT_FP2, SLOT_PROBLEMS, SLOT_RANK_SUM, SLOT_KIND0 = range(7)
VECTOR_LEN = SLOT_KIND0 + len(KINDS)
REFUSAL_PREFIX = "megatron_lossfix refused this step: "


def local_problem(kind: int, message: str, cause: BaseException | None = None) -> StepRefused:
    """This rank's reason to refuse the step, which the agreement tells every rank."""
    problem = StepRefused(message)
    problem.kind, problem.__cause__ = kind, cause
    return problem


@dataclass(slots=True)
class StepState:
    """One step on this rank, filled in by the schedule as it runs (tensors stay on device)."""

    reduction: str
    groups: megatron_compat.StepGroups | None
    """None with ``off`` until the metrics resolve them."""
    num_microbatches: int = 0
    per_token: bool = False
    """The model's ``calculate_per_token_loss``."""
    passthrough: bool = False
    """The loss tuples went to Megatron unchanged (``off``, per-token ``token_mean``)."""
    pg_collection: Any = None
    model_config: Any = None
    batches: list = field(default_factory=list)
    """The loss stage's micro-batches as read (empty elsewhere)."""
    masks: list[torch.Tensor] = field(default_factory=list)
    segments: list[tuple[torch.Tensor | None, int | None]] = field(default_factory=list)
    """Per micro-batch: each token's packed-sequence index and their number (None: rows)."""
    counts: StepCounts | None = None
    """The step's global counts (plugin modes, loss stage)."""
    microbatch: int = -1
    """The micro-batch handed to Megatron last."""
    contributions: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's ``sum(w * l)``."""
    reports: list[Any] = field(default_factory=list)
    """The loss functions' reports (``off``: the list Megatron's schedule returned)."""
    problem: StepRefused | None = None
    """Why this rank refuses the step, found before the schedule or inside it."""
    mtp: MTPStep | None = None
    """The MTP layers' weights and recorded losses (plugin modes, loss stage)."""


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
                "LossFixSchedule takes a LossFixConfig or a mode name such as 'token_mean', "
                f"got {type(config).__name__} {config!r:.60}; build one with "
                "LossFixConfig(reduction=...) (from flags: schedule_from_args(args))"
            )
        if forward_backward_func is not None and not callable(forward_backward_func):
            raise TypeError(
                "forward_backward_func must be Megatron's schedule function (callable) or None, "
                f"got {type(forward_backward_func).__name__}"
            )
        megatron_compat.warn_if_untested()
        self.config = config
        self._inner = forward_backward_func
        self._pg_collection = pg_collection
        self._last_step: StepState | None = None
        self.self_check = SelfCheck(config) if config.self_check else None
        """The first-step re-split check (``config.self_check``), with what it measured."""
        self._structure: dict[tuple, str | None] = {}  # the structural guard's verdict per model

    @property
    def last_step(self) -> StepState | None:
        """This rank's record of the last step (None before the first, after a refused one)."""
        return self._last_step

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
        self._last_step = None  # a refused step leaves no metrics behind
        if self.config.reduction != "off":
            return self._plugin_step(call)
        if self._inner is None:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            self._inner = get_forward_backward_func()
        result = self._inner(**call)  # the caller's own objects, the result unchanged
        pg_collection = call.get("pg_collection")
        self._last_step = StepState(
            reduction="off",
            groups=None,
            num_microbatches=call["num_microbatches"],
            passthrough=True,
            pg_collection=self._pg_collection if pg_collection is None else pg_collection,
            reports=list(result) if isinstance(result, (list, tuple)) else [],
        )
        return result

    def _plugin_step(self, call: dict) -> Any:
        """Read, agree (with the counts), weight, run Megatron's schedule, agree again."""
        cfg, model, m = self.config, call["model"], call["num_microbatches"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            # The same argument on every rank: every rank raises here, before any collective.
            raise ValueError(f"num_microbatches must be a positive int, got {m!r}")
        chunks = model if isinstance(model, list) else [model]
        model_config, error = _model_settings(cfg, chunks[0])
        mtp_layers = int(getattr(model_config, "mtp_num_layers", None) or 0)
        if call.get("pg_collection") is None and self._pg_collection is not None:
            call["pg_collection"] = self._pg_collection
        groups = megatron_compat.resolve_groups(call.get("pg_collection"))
        per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
        state = StepState(
            reduction=cfg.reduction,
            groups=groups,
            num_microbatches=m,
            per_token=per_token,
            passthrough=per_token and cfg.reduction == "token_mean",
            model_config=model_config,
        )
        given = call["data_iterator"]
        iterators = list(given) if isinstance(given, list) else [given]
        if error is not None:
            message = f"preparing the step raised {type(error).__name__}: {error}"
            state.problem = local_problem(OTHER, message, error)
        elif groups.is_last_stage:
            self._read(state, iterators[-1], mtp_layers)
        unreduced = self._structure_problem(chunks, state)
        if unreduced is not None:
            state.problem = unreduced  # the fix to name first: no step can be right without it
        mtp_masks = [reduction.shifted_masks(state.masks, j) for j in range(1, mtp_layers + 1)]
        mtp_counts = _agree(cfg, state, mtp_masks, mtp_layers)
        self._last_step = state
        if groups.is_last_stage:
            iterators[-1] = self._weighted(state, mtp_masks, mtp_counts)
            call["forward_step_func"] = self._wrap(call["forward_step_func"], iterators[-1], state)
        call["data_iterator"] = iterators if isinstance(given, list) else iterators[0]
        result = (self._inner or megatron_compat.schedule_for(model, groups.pp))(**call)
        try:
            _agree_after(state)
        except StepRefused:
            self._last_step = None
            raise
        return result

    def _read(self, state: StepState, source: Any, mtp_layers: int) -> None:
        """The loss stage's micro-batches, float masks and packed-sequence segments; what
        goes wrong becomes ``state.problem``."""
        key = self.config.loss_mask_key
        try:
            state.batches = _read_batches(source, state.num_microbatches)
            for k, batch in enumerate(state.batches):
                if not isinstance(batch, Mapping) or key not in batch:
                    keys = f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else ""
                    raise local_problem(
                        NOT_DICT,
                        f"micro-batch {k} must be a dict holding the loss mask under {key!r} "
                        f"(LossFixConfig.loss_mask_key); got {type(batch).__name__}{keys}",
                    )
            try:
                masks = reduction.float_masks([b[key] for b in state.batches])
                state.segments = [
                    _segments(self.config, b, masks[k], k) for k, b in enumerate(state.batches)
                ]
            except ValueError as exc:
                raise local_problem(MALFORMED, str(exc)) from None
            state.masks = masks
            if mtp_layers and any(seg is not None for seg, _ in state.segments):
                raise local_problem(
                    MTP_PROBLEM,
                    "packed micro-batches (cu_seqlens) with multi-token prediction: the "
                    "plugin normalizes MTP layers over whole rows only",
                )
        except StepRefused as exc:
            state.problem = exc
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
            message = f"preparing the step raised {type(exc).__name__}: {exc}"
            state.problem = local_problem(OTHER, message, exc)

    def _structure_problem(self, chunks: list, state: StepState) -> StepRefused | None:
        """The structural guard (``unreduced_gradients``), cached per model, config and size."""
        key = (*map(id, chunks), id(state.model_config), state.groups.dp_cp_size)
        if key not in self._structure:
            try:
                message = megatron_compat.unreduced_gradients(
                    chunks, state.model_config, state.groups
                )
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                message = f"checking the model's DP wrapping raised {type(exc).__name__}: {exc}"
            self._structure[key] = message
        message = self._structure[key]
        return None if message is None else local_problem(UNREDUCED, message)

    def _weighted(self, state: StepState, mtp_masks: list, mtp_counts: list) -> Iterator[dict]:
        """The loss stage's micro-batches with their weights (and ``state.mtp``)."""
        cfg = self.config
        weights = state.masks  # per-token token_mean: Megatron's division by N is exact
        if not state.passthrough:
            weights = reduction.weights_from_counts(
                state.masks,
                state.counts,
                cfg.reduction,
                norm_constant=cfg.norm_constant,
                segment_ids=[s for s, _ in state.segments],
            )
        if mtp_counts:
            factor = megatron_compat.undo_mtp_averaging(
                state.per_token, state.counts.num_tokens, state.num_microbatches, state.groups
            )
            scaling = state.model_config.mtp_loss_scaling_factor
            microbatch = lambda: state.microbatch  # noqa: E731 - read when the hooks run
            state.mtp = mtp_step(
                cfg, mtp_masks, mtp_counts, factor, state.groups, scaling, microbatch
            )

        def batches() -> Iterator[dict]:  # a generator: the code above runs now, not lazily
            for k, batch in enumerate(state.batches):
                state.microbatch = k
                if cfg.check_finite:
                    _check_finite(batch.items(), f"micro-batch {k}: {{!r}} holds NaN or Inf")
                yield {**batch, cfg.weights_key: weights[k]}

        return batches()

    def _wrap(self, forward_step_func: Callable, step_iter: Iterator, state: StepState) -> Callable:
        """``forward_step_func`` whose loss function, on the loss chunk, is checked, recorded
        and rescaled; on an error the problem is recorded and Megatron gets a zero loss."""
        scale = None
        if not state.passthrough:
            scale = megatron_compat.undo_averaging(
                state.per_token, state.counts.num_tokens, state.num_microbatches, state.groups
            )

        def forward_step(data_iterator: Any, model: Any, *args: Any) -> tuple:
            if data_iterator is not step_iter:  # another chunk: Megatron never calls its loss
                return forward_step_func(data_iterator, model, *args)
            with active(state.mtp):  # the model computes its MTP losses in this call
                output, loss_func = forward_step_func(data_iterator, model, *args)
            k = state.microbatch
            if state.mtp is not None and state.mtp.problem and state.problem is None:
                state.problem = local_problem(MTP_PROBLEM, state.mtp.problem)

            def loss(output_tensor: Any, *a: Any, **kw: Any) -> tuple:
                if state.problem is not None:
                    return _zero_loss(output_tensor, state.per_token)
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
                    state.problem = local_problem(LOSS_FUNC, message, exc)
                    return _zero_loss(output_tensor, state.per_token)

            return output, loss

        return forward_step

    def _convert(self, outputs: Any, k: int, scale: Any, state: StepState) -> tuple:
        """Check and record one micro-batch's loss tuple; what Megatron should receive."""
        if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
            is_tuple = isinstance(outputs, (tuple, list))
            got = f"a tuple of length {len(outputs)}" if is_tuple else type(outputs).__name__
            raise ValueError(
                f"loss_func must return (loss, num_tokens, report) or (loss, report); got {got}"
            )
        loss, report = outputs[0], outputs[-1]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise ValueError(
                f"loss_func must return a one-element loss tensor first, got "
                f"{type(loss).__name__}{shape} (micro-batch {k})"
            )
        if len(outputs) == 2 and state.per_token:
            raise ValueError(
                "calculate_per_token_loss=True needs loss_func to return (loss, num_tokens, "
                "report), the loss tokens of the micro-batch on this rank; got (loss, report). "
                "Return a 3-tuple (megatron_lossfix.weighted_loss does), or set "
                "calculate_per_token_loss=False."
            )
        if self.config.check_finite:  # a host sync per micro-batch: opt-in
            if not bool(torch.isfinite(loss).all()):
                raise FloatingPointError(
                    f"loss of micro-batch {k} is not finite ({loss.item()}); check_finite is on"
                )
            # Extremes (ratio_min/_max) may legitimately be +-inf on a zero-token micro-batch.
            entries = report.items() if isinstance(report, Mapping) else ()
            _check_finite(entries, f"report entry {{!r}} of micro-batch {k} is NaN", torch.isnan)
        state.contributions.append(loss.detach().reshape(()))
        state.reports.append(report)
        if state.passthrough:
            return outputs  # Megatron's own semantics, untouched
        return (loss * scale, outputs[1], report) if state.per_token else (loss * scale, report)

    def step_metrics(self) -> dict[str, float]:
        """The last step's global metrics, on every rank (collectives over DP x CP and PP).

        ``loss`` is L (docs/design.md §2), ``num_tokens`` N, ``num_sequences`` S,
        ``mtp_loss_<j>`` each MTP layer's; 0-dim report entries named ``*_sum``/``*_count``,
        ``*_max``, ``*_min`` are summed, maxed, minimized over DP x CP. With ``off`` only the
        reports Megatron returned are reduced, by the same rules.
        """
        return reduce_step_metrics(self._last_step)


def _model_settings(config: LossFixConfig, chunk: Any) -> tuple[Any, Exception | None]:
    """The model's config, or the error reading it raised; settings that are the same on every
    rank and that the plugin cannot serve are refused here, before any collective."""
    try:
        from megatron.core.utils import get_model_config

        model_config = get_model_config(chunk)
    except Exception as exc:  # noqa: BLE001 - the agreement tells every rank
        return None, exc
    if getattr(model_config, "hybrid_context_parallel", False):
        # Megatron 0.19's hybrid CP calls forward_step once per sub-sample.
        raise StepRefused(
            f"{REFUSAL_PREFIX}hybrid context parallelism (hybrid_context_parallel=True) runs "
            "forward_step once per sub-sample, which the plugin's modes do not cover; use "
            "--loss-reduction off with calculate_per_token_loss=True there (Megatron's own "
            "per-token mode is the exact token mean)"
        )
    mtp_layers = getattr(model_config, "mtp_num_layers", None)
    if mtp_layers and config.data_is_cp_sharded:
        # MTP layers read the masks of later positions, which CP shards do not hold.
        raise StepRefused(
            f"{REFUSAL_PREFIX}multi-token prediction (mtp_num_layers={mtp_layers}) needs whole "
            "sequences from the data iterator (data_is_cp_sharded=False): slice them for "
            "context parallelism in forward_step"
        )
    return model_config, None


def _read_batches(source: Any, num_microbatches: int) -> list:
    if source is None:
        message = "the last pipeline stage needs a data iterator: it holds the loss (got None)"
        raise local_problem(NO_ITERATOR, message)
    batches = []
    for k in range(num_microbatches):
        try:
            batches.append(next(source))
        except StopIteration:
            raise local_problem(
                RAN_OUT,
                f"the data iterator ran out after {k} micro-batches but "
                f"num_microbatches={num_microbatches}",
            ) from None
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            hint = "; pass an iterator (iter(...)), not an iterable"
            message = (
                f"reading micro-batch {k} from the data iterator raised {type(exc).__name__}: "
                f"{exc}{'' if hasattr(source, '__next__') else hint}"
            )
            raise local_problem(UNREADABLE, message, exc) from exc
    return batches


def _segments(config: LossFixConfig, batch: Mapping, mask: torch.Tensor, k: int) -> tuple:
    """A packed micro-batch's sequence index per token and their number; (None, None): rows."""
    key = config.cu_seqlens_key
    cu_seqlens = batch.get(key)
    if cu_seqlens is None:
        return None, None
    if config.data_is_cp_sharded:
        raise ValueError(
            "packed sequences need whole sequences from the data iterator: slice them for "
            "context parallelism in forward_step (data_is_cp_sharded=False)"
        )
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError(
            f"micro-batch {k}: {key!r} must be a 1-D tensor of cumulative sequence lengths "
            "starting at 0"
        )
    if mask.shape[0] != 1:
        raise ValueError(
            f"micro-batch {k} is packed ({key!r} given) but its mask is {tuple(mask.shape)}; "
            "packed micro-batches are [1, total_tokens]"
        )
    return reduction.segment_ids(cu_seqlens.to(device=mask.device), mask.shape[1])


def _check_finite(entries: Any, message: str, bad: Callable = lambda t: ~torch.isfinite(t)) -> None:
    """Raise ``FloatingPointError`` for the first floating tensor among ``(key, value)``
    ``entries`` holding a value ``bad`` flags; ``message`` names the key."""
    for key, value in entries:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and bool(bad(value).any()):
            raise FloatingPointError(message.format(key) + " (check_finite is on)")


def _zero_loss(output_tensor: Any, per_token: bool) -> tuple:
    """A zero loss with the output's graph, in Megatron's form: the schedule ends normally
    (backward sends zero gradients upstream) and the step is refused after it."""
    if isinstance(output_tensor, torch.Tensor) and output_tensor.is_floating_point():
        zero = (output_tensor * 0).sum().float()
    else:
        zero = torch.zeros((), device=default_device())
    if per_token:
        return zero, torch.zeros((), dtype=torch.int, device=zero.device), {}
    return zero, {}


# ---------------------------------------------------------------------- the two agreements
def default_device() -> torch.device:
    """The agreement's device: NCCL reduces CUDA tensors only, and every stage must bring the
    same kind of tensor to the pipeline all-reduce."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def reduce_over(vec: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``vec`` summed over ``group`` in place (nothing is sent for a group of one)."""
    if reduction.group_size(group) > 1:
        dist.all_reduce(vec, group=group)
    return vec


def fingerprint(mode: str, per_token: bool) -> float:
    """A small integer that differs between any two (mode, per-token) settings."""
    return float(1 + 2 * reduction.MODES.index(mode) + int(per_token))


def agreement_vector(
    problem: StepRefused | None, rank: int, device: torch.device, mtp_layers: int = 0
) -> torch.Tensor:
    """A zero agreement vector carrying this rank's problem, if any."""
    vec = torch.zeros(VECTOR_LEN + 2 * mtp_layers, dtype=torch.float64, device=device)
    if problem is not None:
        vec[SLOT_PROBLEMS], vec[SLOT_RANK_SUM] = 1.0, rank + 1.0
        vec[SLOT_KIND0 + problem.kind] = 1.0
    return vec


def verdict(
    values: list[float],
    groups: Any,
    mode: str,
    per_token: bool,
    problem: StepRefused | None,
    bad: torch.Tensor | None,
) -> None:
    """Raise on this rank if any rank of the step refused it (``values``: the reduced vector)."""
    stages_differ = values[SLOT_FP] ** 2 != groups.pp_size * values[SLOT_FP2]
    if stages_differ or values[SLOT_KIND0 + DISAGREE] > 0:
        where = "pipeline stages" if stages_differ else "data- or context-parallel ranks"
        raise StepRefused(
            f"{REFUSAL_PREFIX}{where} disagree on the loss reduction or calculate_per_token_loss "
            f"(this rank: {mode!r}, per-token={per_token}); give every rank the same "
            "--loss-reduction"
        )
    if values[SLOT_PROBLEMS] <= 0:
        return
    if problem is not None:
        raise StepRefused(f"{REFUSAL_PREFIX}{problem}") from problem.__cause__
    if bad is not None and bool(bad.any()):
        raise StepRefused(REFUSAL_PREFIX + reduction.bad_mask_message(int(bad.nonzero()[0, 0])))
    kinds = [KINDS[i] for i in range(len(KINDS)) if values[SLOT_KIND0 + i] > 0]
    count = int(values[SLOT_PROBLEMS])
    who = f"global rank {int(values[SLOT_RANK_SUM]) - 1}" if count == 1 else f"{count} ranks"
    raise ProblemOnAnotherRank(
        f"{REFUSAL_PREFIX}{'; '.join(kinds)} (reported by {who}; see its error for the details); "
        "every rank of the step stops"
    )


def _agree(
    config: LossFixConfig, state: StepState, mtp_masks: list, mtp_layers: int
) -> list[StepCounts]:
    """Count the step's tokens and agree, on every rank of the step, that it can run.

    The loss stage sums ``[N, S, fp, fp**2, problems...]`` over DP x CP (CP ranks hold the same
    sequences: N and S are divided by the CP size), then every stage the verdict over the
    pipeline group; the fingerprints are all equal exactly when ``sum(fp)**2 == n *
    sum(fp**2)``. One device sync, after the last collective. Fills ``state.counts`` on the
    loss stage; returns each MTP layer's counts (they ride in the same all-reduce).
    """
    groups, problem = state.groups, state.problem
    fp = fingerprint(config.reduction, state.per_token)
    vec = agreement_vector(problem, _rank(), default_device(), mtp_layers)
    vec[SLOT_FP], vec[SLOT_FP2] = fp, fp * fp
    # CP shards need one more all-reduce (n_s over CP), of a size only healthy ranks know: they
    # are counted after the verdict.
    sharded_cp = config.data_is_cp_sharded and groups.cp_size > 1
    bad, local = None, []
    seg, num = [s for s, _ in state.segments], [n for _, n in state.segments]
    if groups.is_last_stage:
        if problem is None and config.validate:
            bad = reduction.bad_mask_values(state.masks)
            flagged = bad.any().to(device=vec.device, dtype=torch.float64)
            vec[SLOT_PROBLEMS] += flagged
            vec[SLOT_RANK_SUM] += flagged * (_rank() + 1)
            vec[SLOT_KIND0 + MASK_VALUES] += flagged
        if problem is None and not sharded_cp:
            for j, masks in enumerate([state.masks, *mtp_masks]):
                counts = reduction.count_tokens(
                    masks, global_counts=False, segment_ids=seg, num_segments=num
                )
                at = SLOT_N if j == 0 else VECTOR_LEN + 2 * (j - 1)
                vec[at], vec[at + 1] = counts.num_tokens, counts.num_sequences
                local.append((counts, at))
        vec = reduce_over(vec, groups.dp_cp)
        # Disagreement inside DP x CP becomes a problem every stage hears of; the fingerprint
        # slots are reset for the pipeline's own comparison.
        disagree = (vec[SLOT_FP] * vec[SLOT_FP] != groups.dp_cp_size * vec[SLOT_FP2]).double()
        vec[SLOT_KIND0 + DISAGREE] += disagree
        vec[SLOT_PROBLEMS] += disagree
        vec[SLOT_FP], vec[SLOT_FP2] = fp, fp * fp
    vec = reduce_over(vec, groups.pp)
    verdict(vec.tolist(), groups, config.reduction, state.per_token, problem, bad)
    if not groups.is_last_stage:
        return []
    if sharded_cp:
        state.counts = reduction.count_tokens(
            state.masks, dp_group=groups.dp, cp_group=groups.cp, segment_ids=seg, num_segments=num
        )
        return []
    device, cp = state.masks[0].device, float(groups.cp_size)
    counts = [
        dataclasses.replace(
            c,
            num_tokens=(vec[at] / cp).to(device),
            num_sequences=(vec[at + 1] / cp).to(device),
            dp_size=groups.dp_size,
        )
        for c, at in local
    ]
    state.counts = counts[0]
    return counts[1:]


def _agree_after(state: StepState) -> None:
    """Refuse the step on every rank if the loss stage hit an error inside the schedule: one
    small all-reduce over DP x CP (loss stage) and the pipeline group; none on a single rank."""
    groups, problem = state.groups, state.problem
    if problem is None and groups.dp_cp_size <= 1 and groups.pp_size <= 1:
        return
    vec = agreement_vector(problem, _rank(), default_device())
    if groups.is_last_stage:
        vec = reduce_over(vec, groups.dp_cp)
    values = reduce_over(vec, groups.pp).tolist()
    if values[SLOT_PROBLEMS] > 0:
        verdict(values, groups, state.reduction, state.per_token, problem, None)


# ---------------------------------------------------------------------- metrics
def scalar_stats(reports: list[Any]) -> dict[str, list[torch.Tensor]]:
    """The reports' 0-dim entries named ``*_sum``, ``*_count``, ``*_max``, ``*_min``, by name."""
    stats: dict[str, list[torch.Tensor]] = {}
    for report in reports:
        for key, value in report.items() if isinstance(report, Mapping) else ():
            if key.endswith(("_sum", "_count", "_max", "_min")) and (
                isinstance(value, torch.Tensor) and value.numel() == 1
            ):
                stats.setdefault(key, []).append(value.detach().reshape(()).double())
    return stats


def reduce_step_metrics(state: StepState | None) -> dict[str, float]:
    """Global metrics of the last step, returned on every rank of the pipeline group."""
    if state is None:
        raise ValueError("no step has run yet: call the schedule before asking for its metrics")
    if state.groups is None:  # ``off`` resolved nothing during the step
        state.groups = megatron_compat.resolve_groups(state.pg_collection)
    groups = state.groups
    metrics = _local_metrics(state) if groups.is_last_stage else None
    if reduction.group_size(groups.pp) > 1:
        box = [metrics]
        last = dist.get_global_rank(groups.pp, dist.get_world_size(groups.pp) - 1)
        dist.broadcast_object_list(box, src=last, group=groups.pp)
        metrics = box[0]
    return metrics


def _local_metrics(state: StepState) -> dict[str, float]:
    """The loss stage's metrics: one SUM all-reduce over DP x CP, one MAX for the extremes."""
    groups, stats = state.groups, scalar_stats(state.reports)
    sums = sorted(k for k in stats if k.endswith(("_sum", "_count")))
    extremes = sorted(k for k in stats if k.endswith(("_max", "_min")))
    if state.masks:
        device = state.masks[0].device
    else:  # ``off``: the reports' device
        device = next((v[0].device for v in stats.values()), torch.device("cpu"))

    def total(values: list[torch.Tensor]) -> torch.Tensor:
        if not values:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(values).double().sum().to(device)

    mtp = state.mtp.contributions if state.mtp is not None else []
    sum_vec = torch.stack(
        [total(state.contributions), *(total(stats[k]) for k in sums), *map(total, mtp)]
    )
    # The maxima of x and of -x: one MAX all-reduce gives the minima too.
    sign = {k: 1.0 if k.endswith("_max") else -1.0 for k in extremes}
    maxima = [(torch.stack(stats[k]) * sign[k]).max() for k in extremes]
    max_vec = torch.stack(maxima) if maxima else None
    if dist.is_initialized() and groups.dp_cp is not None:
        dist.all_reduce(sum_vec, group=groups.dp_cp)
        if max_vec is not None:
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX, group=groups.dp_cp)
    out: dict[str, Any] = {k: sum_vec[1 + i] for i, k in enumerate(sums)}
    out.update({f"mtp_loss_{j + 1}": sum_vec[1 + len(sums) + j] for j in range(len(mtp))})
    out.update({k: max_vec[i] * sign[k] for i, k in enumerate(extremes)})
    if state.counts is not None:  # a plugin mode
        out["num_tokens"] = state.counts.num_tokens
        out["num_sequences"] = state.counts.num_sequences
        out["loss"] = sum_vec[0]
        if state.passthrough and state.per_token:
            # Megatron's per-token mode divides the summed loss by the global token count.
            out["loss"] = sum_vec[0] / state.counts.num_tokens.clamp(min=1)
    return {k: float(v) for k, v in out.items()}
