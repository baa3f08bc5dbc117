"""The plugin's step: Megatron's ``forward_backward_func``, normalizing exactly (docs/design.md §3).

A :class:`Step` is called with the keyword arguments of the function
``get_forward_backward_func()`` returns. With ``off`` it calls the wrapped function with the
caller's own arguments and returns its result unchanged. With a mode, one step:

1. **read**: the loss stage (last pipeline stage) reads the step's micro-batches, their loss
   masks and packed-sequence segments (:func:`_read`);
2. **agree**: every rank agrees that the step can run, the step's counts riding in the same
   all-reduce (:func:`_agree`, :mod:`megatron_lossfix.agreement`);
3. **weigh**: each micro-batch gets its weights, ``batch[config.weights_key]``, and each MTP
   layer its own (:func:`_weigh`, :mod:`megatron_lossfix.mtp`);
4. **wrap** and **scale**: Megatron's schedule runs; each loss tuple is checked and multiplied
   by what undoes Megatron's averaging, so the gradient is that of ``sum(w * l)``
   (:func:`_wrap`, :func:`_scale`);
5. **after the schedule**: if a loss function failed inside it (the loss stage ran on with zero
   losses), a second agreement refuses the step on every rank (:func:`_after_schedule`); the
   same all-reduce carries the counts of the masks the loss decided (:mod:`megatron_lossfix.kept`),
   by which a ``mask_in_loss`` step scales its gradients once.

With ``mask_in_loss`` and a model whose gradient has terms outside the loss (or
``counting_pass``), a forward-only counting pass (:mod:`megatron_lossfix.counting_pass`) runs
between 3 and 4 and the counts agree before the real pass instead.

Each step that goes through leaves its :class:`StepRecord` in :attr:`Step.last_step`: what the
step's metrics reduce (:mod:`megatron_lossfix.metrics`) and the self-check keeps
(:mod:`megatron_lossfix.selfcheck`). Nothing in the micro-batch loop synchronizes with the host.
Tensor-parallel peers are not part of the agreement: they read the same data and fail alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import megatron_lossfix.group_ids as group_ids
import megatron_lossfix.megatron_compat as megatron_compat
import megatron_lossfix.reduction as reduction
import megatron_lossfix.wrappers as wrappers
from megatron_lossfix.agreement import (
    REFUSAL_PREFIX,
    Agreement,
    Problem,
    StepRefused,
    StepSettings,
    agree,
    default_device,
)
from megatron_lossfix.counting_pass import counting_pass
from megatron_lossfix.group_ids import GroupIds
from megatron_lossfix.groups import StepGroups
from megatron_lossfix.kept import NUM_COUNTS as KEPT_COUNTS
from megatron_lossfix.kept import KeptCounts, KeptStep, Phase, deferred_scale, phase_for
from megatron_lossfix.modes import megatron_normalizes, mode_of
from megatron_lossfix.mtp import MTPStep, active, mtp_step
from megatron_lossfix.reduction import LossFixConfig, StepCounts

__all__ = ["Step", "StepData", "StepRecord"]


@dataclass(slots=True)
class StepRecord:
    """This rank's record of one step, filled in as the step runs (tensors stay on device).

    :attr:`Step.last_step` holds the record of the last step that went through: the step's
    metrics reduce it, and the self-check puts the normal run's record back after its re-runs.
    """

    config: LossFixConfig
    """The schedule's configuration."""
    num_microbatches: int
    pg_collection: Any
    """The process groups the step was given (the call's, else the schedule's; None: Megatron's
    ``parallel_state``)."""
    groups: StepGroups | None = None
    """The step's groups; None with ``off``, which resolves nothing (the metrics do, on
    demand, from :attr:`pg_collection`)."""
    model_config: Any = None
    """The model's config (None with ``off``)."""
    counts: StepCounts | None = None
    """The step's global counts (plugin modes, loss stage)."""
    mtp: MTPStep | None = None
    """The MTP layers' weights and recorded losses (plugin modes, loss stage)."""
    microbatch: int = -1
    """The micro-batch handed to Megatron last."""
    contributions: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's ``sum(w * l)``."""
    reports: list[Any] = field(default_factory=list)
    """The loss functions' reports (``off``: the list Megatron's schedule returned)."""
    problem: StepRefused | None = None
    """Why this rank refuses the step, found before the schedule or inside it."""
    phase: Phase | None = None
    """What ``kept_weights`` serves in this step (every rank; None with ``off``)."""
    kept: KeptStep | None = None
    """The masks the loss decided (loss stage, plugin modes)."""
    kept_counts: KeptCounts | None = None
    """Their agreed counts (every rank; None where no loss said what it kept)."""
    grouped: bool = False
    """Whether the weights are over group ids (``group_mean``; the sequence modes with
    trajectory ids), as agreed by every rank of the step."""
    loss_scale: float = 1.0
    """What each recorded contribution is multiplied by to give L: the global factor a
    ``DEFERRED`` step applied to its gradients after the schedule (1 otherwise)."""

    @property
    def per_token(self) -> bool:
        """The model's ``calculate_per_token_loss``."""
        return bool(getattr(self.model_config, "calculate_per_token_loss", False))

    @property
    def passthrough(self) -> bool:
        """Whether the loss tuples go to Megatron unchanged: ``off``, and ``token_mean`` on
        Megatron's per-token path, whose division by the all-reduced N already is the mode."""
        normalized = megatron_normalizes(mode_of(self.config.reduction), self.per_token)
        return normalized and not self.config.mask_in_loss  # stock has no mask_in_loss


@dataclass(frozen=True, slots=True)
class StepData:
    """The loss stage's micro-batches as read before Megatron's schedule (empty elsewhere)."""

    batches: list = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    """Float32 loss masks, one per micro-batch."""
    segments: list[tuple[torch.Tensor | None, int | None]] = field(default_factory=list)
    """Per micro-batch: each token's packed-sequence index and their number (None: rows)."""
    group_ids: GroupIds | None = None
    """Each sequence's group (``group_mean``) or trajectory (the sequence modes), where the
    mode weights by them and the micro-batches carry them; their range is not checked yet."""

    @property
    def segment_ids(self) -> list[torch.Tensor | None]:
        return [ids for ids, _ in self.segments]

    @property
    def num_segments(self) -> list[int | None]:
        return [num for _, num in self.segments]

    def counts(self, masks: list[torch.Tensor], **groups: Any) -> StepCounts:
        """``masks`` (these micro-batches' or their shift) counted with their segments."""
        return reduction.count_tokens(
            masks, segment_ids=self.segment_ids, num_segments=self.num_segments, **groups
        )


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
        """Read, agree (with the counts), weigh, wrap, run Megatron's schedule, agree again."""
        cfg, model, m = self.config, call["model"], call["num_microbatches"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            # The same argument on every rank: every rank raises here, before any collective.
            raise ValueError(f"num_microbatches must be a positive int, got {m!r}")
        chunks = model if isinstance(model, list) else [model]
        record.model_config, error = _model_settings(cfg, chunks[0])
        mtp_layers = int(getattr(record.model_config, "mtp_num_layers", None) or 0)
        if record.pg_collection is not None:
            call["pg_collection"] = record.pg_collection  # the schedule's when the call gave none
        record.groups = megatron_compat.resolve_groups(record.pg_collection)
        given = call["data_iterator"]
        iterators = list(given) if isinstance(given, list) else [given]
        data = StepData()
        if error is not None:
            message = f"preparing the step raised {type(error).__name__}: {error}"
            record.problem = Problem.OTHER.refusal(message, error)
        elif record.groups.is_last_stage:
            data = _read(record, iterators[-1], mtp_layers)
        unreduced = _structure_problem(chunks, record)
        if unreduced is not None:
            record.problem = unreduced  # the fix to name first: no step can be right without it
        mtp_masks = [reduction.shifted_masks(data.masks, j) for j in range(1, mtp_layers + 1)]
        mtp_counts = _agree(record, data, mtp_masks)
        forward_only = bool(call.get("forward_only"))
        record.phase = _kept_phase(cfg, record.model_config, forward_only, record.grouped)
        schedule = self.inner or megatron_compat.schedule_for(model, record.groups.pp)
        forward_step_func = call["forward_step_func"]
        batches = None
        if record.groups.is_last_stage:
            record.kept = _kept_step(record, data)
            batches = _weigh(record, data, mtp_masks, mtp_counts)
            iterators[-1] = batches()
            call["forward_step_func"] = _wrap(forward_step_func, iterators[-1], record)
        if record.phase is Phase.COUNT:
            counting = None if batches is None else batches()
            counting_step = _wrap(forward_step_func, counting, record, counting=True)
            loss_iterators = None if counting is None else (counting, iterators[-1])
            iterators = counting_pass(schedule, call, counting_step, iterators, loss_iterators)
            record.microbatch = -1
            _agree_kept(record, counted=True)
        call["data_iterator"] = iterators if isinstance(given, list) else iterators[0]
        result = schedule(**call)
        _after_schedule(record, chunks, bool(call.get("forward_only")))
        return result


# ---------------------------------------------------------------------- read
def _read(record: StepRecord, source: Any, mtp_layers: int) -> StepData:
    """The loss stage's micro-batches, float masks and packed-sequence segments; what
    goes wrong becomes ``record.problem`` (and the data is empty)."""
    key = record.config.loss_mask_key
    try:
        batches = _read_batches(source, record.num_microbatches)
        for k, batch in enumerate(batches):
            if not isinstance(batch, Mapping) or key not in batch:
                keys = f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else ""
                raise Problem.NOT_DICT.refusal(
                    f"micro-batch {k} must be a dict holding the loss mask under {key!r} "
                    f"(LossFixConfig.loss_mask_key); got {type(batch).__name__}{keys}"
                )
        try:
            masks = reduction.float_masks([b[key] for b in batches])
            segments = [_segments(record.config, b, masks[k], k) for k, b in enumerate(batches)]
        except ValueError as exc:
            raise Problem.MALFORMED.refusal(str(exc)) from None
        if mtp_layers and any(ids is not None for ids, _ in segments):
            raise Problem.MTP.refusal(
                "packed micro-batches (cu_seqlens) with multi-token prediction: the "
                "plugin normalizes MTP layers over whole rows only"
            )
        try:
            groups = _group_ids(record.config, batches, masks, segments)
        except ValueError as exc:
            raise Problem.GROUP_IDS.refusal(str(exc)) from None
        return StepData(batches, masks, segments, groups)
    except StepRefused as exc:
        record.problem = exc
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
        message = f"preparing the step raised {type(exc).__name__}: {exc}"
        record.problem = Problem.OTHER.refusal(message, exc)
    return StepData()


def _group_ids(
    config: LossFixConfig, batches: list, masks: list[torch.Tensor], segments: list
) -> GroupIds | None:
    """The ids the mode weights by, from the micro-batches (structure checked, no device sync):
    one per row, or per ``cu_seqlens`` sequence of a packed micro-batch (whose tokens after the
    last boundary then count for no group). None where the mode needs none, or a sequence mode
    finds no trajectory ids; ``ValueError`` for what the ids cannot mean."""
    kind = group_ids.ids_for_mode(config.reduction)
    if kind is None:
        return None
    if kind == "group":
        ids_key, count_key = config.group_ids_key, config.num_groups_key
    else:
        ids_key, count_key = config.trajectory_ids_key, config.num_trajectories_key
    missing = [k for k, b in enumerate(batches) if ids_key not in b]
    if len(missing) == len(batches):
        if kind == "group":
            raise ValueError(group_ids.missing_group_ids_message(ids_key, count_key))
        return None
    if missing:
        raise ValueError(f"micro-batch {missing[0]} has no {ids_key!r}, other micro-batches do")
    counts = [group_ids.id_count(b.get(count_key), f"{count_key!r}") for b in batches]
    if len(set(counts)) > 1:
        k = counts.index(next(c for c in counts if c != counts[0]))
        raise ValueError(
            f"{count_key!r} is the step's id range, the same in every micro-batch: "
            f"micro-batch 0 has {counts[0]}, micro-batch {k} {counts[k]}"
        )
    rows = [
        m.shape[0] if num is None else num - 1 for m, (_, num) in zip(masks, segments, strict=True)
    ]
    ids = [b[ids_key] for b in batches]
    count = group_ids.check_ids(ids, counts[0], rows, repr(ids_key), repr(count_key))
    ids = [i.to(device=m.device, dtype=torch.long) for i, m in zip(ids, masks, strict=True)]
    # A packed row's tokens after its last boundary form one more segment (padding): group 0
    # stands in, and the agreement refuses the step if that segment holds a loss token.
    ids = [
        i if seg is None else torch.cat([i, i.new_zeros(1)])
        for i, (seg, _) in zip(ids, segments, strict=True)
    ]
    return GroupIds(ids=ids, count=count, name=repr(ids_key))


# ---------------------------------------------------------------------- agree
def _agree(
    record: StepRecord, data: StepData, mtp_masks: list[list[torch.Tensor]]
) -> list[StepCounts]:
    """Count the step's tokens and agree, on every rank of the step, that it can run.

    The counts ``[N, S]`` of the masks, then of each MTP layer's shifted masks, ride in
    the agreement, summed over DP x CP (CP ranks hold the same whole sequences: the sums
    are divided by the CP size). CP-sharded masks need their per-sequence counts summed
    over CP first, an all-reduce of a size only the ranks that could read their data know:
    they are counted after the verdict. Fills ``record.counts`` on the loss stage; returns
    each MTP layer's counts.
    """
    cfg, groups, problem = record.config, record.groups, record.problem
    settings = StepSettings(cfg.reduction, record.per_token)
    mask_sets = [data.masks, *mtp_masks]
    # The last two counts are the ids' range and its square, for modes that weight by group
    # ids: every rank must bring the same (or none, a sequence mode without trajectory ids).
    # Every mode sends them (zeros where unused), so that ranks disagreeing on the mode still
    # all-reduce records of one size and hear of it in the verdict.
    by_ids = group_ids.ids_for_mode(cfg.reduction) is not None
    num_counts = 2 * len(mask_sets) + 2
    mine = Agreement.of_rank(settings, problem, num_counts=num_counts)
    sharded_cp = cfg.data_is_cp_sharded and groups.cp_size > 1
    checks: dict[str, torch.Tensor] = {}
    local: list[StepCounts] = []
    if groups.is_last_stage and problem is None:
        if cfg.validate:
            checks["masks"] = reduction.bad_mask_values(data.masks)
            mine.report(Problem.MASK_VALUES, checks["masks"].any())
        if not sharded_cp:
            local = [data.counts(masks, global_counts=False) for masks in mask_sets]
            totals = [n for c in local for n in (c.num_tokens, c.num_sequences)]
            mine.counts[: 2 * len(mask_sets)].copy_(torch.stack(totals))
        if data.group_ids is not None:
            checks.update(_check_ids(data, local))
            mine.report(Problem.GROUP_IDS, checks["ids"].any() | checks["tails"].any())
            count = float(data.group_ids.count)
            mine.counts[-2:] = torch.tensor([count, count * count], dtype=torch.float64)

    def late() -> StepRefused | None:  # asked only when the step is refused
        return _late_problem(checks, data)

    agreed = agree(mine, groups)
    sums = agreed.verdict(groups.pp_size, problem, settings, late=late)
    if by_ids:
        _agree_on_id_range(sums[-2:], groups, data.group_ids)
        record.grouped = sums[-2] > 0
    if not groups.is_last_stage:
        return []
    ids = data.group_ids
    if sharded_cp:
        record.counts = data.counts(data.masks, dp_group=groups.dp, cp_group=groups.cp, groups=ids)
        return []
    totals = agreed.counts.to(data.masks[0].device) / float(groups.cp_size)
    per_group = _group_tokens(local, ids, groups)
    counts = [
        dataclasses.replace(
            c,
            num_tokens=totals[2 * j],
            num_sequences=totals[2 * j + 1],
            dp_size=groups.dp_size,
            group_tokens=None if ids is None else per_group[j],
            group_ids=None if ids is None else ids.ids,
        )
        for j, c in enumerate(local)
    ]
    record.counts = counts[0]
    return counts[1:]


def _check_ids(data: StepData, local: list[StepCounts]) -> dict[str, torch.Tensor]:
    """On the device, per micro-batch: ids out of range, and packed rows with loss tokens after
    their last ``cu_seqlens`` boundary (which no id covers)."""
    ids = data.group_ids
    tails = [
        local[0].seq_tokens[k][-1] > 0 if local and seg is not None else torch.tensor(False)
        for k, (seg, _) in enumerate(data.segments)
    ]
    device = ids.ids[0].device
    return {"ids": group_ids.bad_id_values(ids), "tails": torch.stack(tails).to(device)}


def _late_problem(checks: dict[str, torch.Tensor], data: StepData) -> StepRefused | None:
    """This rank's problem found on the device, named (read only when the step is refused)."""
    if "masks" in checks and bool(checks["masks"].any()):
        first = int(checks["masks"].nonzero()[0, 0])
        return Problem.MASK_VALUES.refusal(reduction.bad_mask_message(first))
    if "ids" in checks and bool(checks["ids"].any()):
        first = int(checks["ids"].nonzero()[0, 0])
        return Problem.GROUP_IDS.refusal(group_ids.bad_id_message(data.group_ids, first))
    if "tails" in checks and bool(checks["tails"].any()):
        first = int(checks["tails"].nonzero()[0, 0])
        return Problem.GROUP_IDS.refusal(
            f"micro-batch {first} is packed and has loss tokens after its last cu_seqlens "
            f"boundary, which no {data.group_ids.name} covers"
        )
    return None


def _agree_on_id_range(sums: list[float], groups: StepGroups, ids: GroupIds | None) -> None:
    """Refuse the step on every rank (all read the same sums) when the loss stage's DP x CP
    ranks brought different id ranges: the per-group counts are a vector of that size."""
    total, squares = sums
    if total * total != groups.dp_cp_size * squares:
        mine = "none" if ids is None else f"{ids.name} in [0, {ids.count})"
        raise StepRefused(
            f"{REFUSAL_PREFIX}data- or context-parallel ranks disagree on the group ids' range "
            f"(num_groups or num_trajectories; this rank: {mine}); give every micro-batch of "
            "the step the same range, and every rank its ids",
            Problem.GROUP_IDS,
        )


def _group_tokens(
    local: list[StepCounts], ids: GroupIds | None, groups: StepGroups
) -> list[torch.Tensor | None]:
    """Each mask set's loss tokens per group, global: one all-reduce over DP x CP of one
    vector (the groups' range per mask set), after the verdict checked the ids."""
    if ids is None:
        return [None] * len(local)
    per_group = torch.cat([group_ids.group_tokens(c.seq_tokens, ids) for c in local])
    if groups.dp_cp_size > 1:
        dist.all_reduce(per_group, group=groups.dp_cp)
    # CP ranks hold the same whole sequences.
    return list(torch.split(per_group / float(groups.cp_size), ids.count))


# ---------------------------------------------------------------------- weigh
def _weigh(
    record: StepRecord,
    data: StepData,
    mtp_masks: list[list[torch.Tensor]],
    mtp_counts: list[StepCounts],
) -> Callable[[], Iterator[dict]]:
    """The loss stage's micro-batches with their weights (and ``record.mtp``), as a function
    that starts a pass over them (the counting pass and the real one each start one)."""
    cfg = record.config
    weights = data.masks  # per-token token_mean: Megatron's division by N is exact
    if not record.passthrough:
        weights = reduction.weights_from_counts(
            data.masks,
            record.counts,
            cfg.reduction,
            norm_constant=cfg.norm_constant,
            segment_ids=data.segment_ids,
        )
    if mtp_counts:
        factor = _undo_averaging(record, mtp=True)
        scaling = record.model_config.mtp_loss_scaling_factor
        microbatch = lambda: record.microbatch  # noqa: E731 - read when the hooks run
        record.mtp = mtp_step(
            cfg, mtp_masks, mtp_counts, factor, record.groups, scaling, microbatch
        )

    def batches() -> Iterator[dict]:  # a generator: the code above runs now, not lazily
        for k, batch in enumerate(data.batches):
            record.microbatch = k
            if cfg.check_finite:
                _check_finite(batch.items(), f"micro-batch {k}: {{!r}} holds NaN or Inf")
            yield {**batch, cfg.weights_key: weights[k]}

    return batches


def _kept_phase(
    config: LossFixConfig, model_config: Any, forward_only: bool, grouped: bool
) -> Phase:
    """The step's :class:`~megatron_lossfix.kept.Phase`, the same on every rank: it depends on
    the config, the model, the call and the agreed presence of group ids only. A
    ``mask_in_loss`` step counts in a pass of its own where asked to, where a gradient scale
    after the schedule would also rescale terms outside the loss, or where the weights are over
    groups (no one scale is right); a forward-only call (evaluation) without groups has no
    gradient, and its loss waits for the counts."""
    side_paths = bool(megatron_compat.gradient_side_paths(model_config)) and not forward_only
    counting = config.counting_pass and not forward_only
    return phase_for(config.reduction, config.mask_in_loss, counting, side_paths, grouped)


def _kept_step(record: StepRecord, data: StepData) -> KeptStep:
    """The loss stage's :class:`~megatron_lossfix.kept.KeptStep` for this step."""
    groups = record.groups
    rows = [
        int(mask.shape[0]) if num is None else int(num)
        for mask, num in zip(data.masks, data.num_segments, strict=True)
    ]
    packed = any(ids is not None for ids in data.segment_ids)
    return KeptStep(
        mode=record.config.reduction,
        phase=record.phase,
        rows=rows,
        device=data.masks[0].device if data.masks else default_device(),
        dp_size=groups.dp_size,
        cp_group=groups.cp if groups.cp_size > 1 else None,
        norm_constant=record.config.norm_constant,
        segment_ids=data.segment_ids if packed else None,
        group_ids=data.group_ids if record.grouped else None,
        dp_cp_group=groups.dp_cp,
    )


def _undo_averaging(record: StepRecord, *, mtp: bool = False) -> torch.Tensor | float:
    """The factor that undoes Megatron's averaging of this step's main or MTP loss. A
    ``DEFERRED`` step on Megatron's per-token path hands the kept tokens as the count by
    which Megatron divides: its losses go through unscaled."""
    if record.phase is Phase.DEFERRED and record.per_token and not mtp:
        return 1.0
    return megatron_compat.undo_averaging(
        record.per_token,
        record.counts.num_tokens,
        record.num_microbatches,
        record.groups,
        mtp=mtp,
    )


# ---------------------------------------------------------------------- wrap and scale
def _wrap(
    forward_step_func: Callable, step_iter: Iterator, record: StepRecord, *, counting: bool = False
) -> Callable:
    """``forward_step_func`` whose loss function, on the loss chunk, is checked, recorded
    and rescaled; on an error the problem is recorded and Megatron gets a zero loss.
    ``counting``: the counting pass's, whose loss only tells the step what it keeps."""
    if step_iter is None:  # not the loss stage
        return forward_step_func
    scale = None if record.passthrough else _undo_averaging(record)
    kept = record.kept

    def forward_step(data_iterator: Any, model: Any, *args: Any) -> tuple:
        if data_iterator is not step_iter:  # another chunk: Megatron never calls its loss
            return forward_step_func(data_iterator, model, *args)
        with active(None if counting else record.mtp):  # the model computes MTP losses here
            output, loss_func = forward_step_func(data_iterator, model, *args)
        k = record.microbatch
        if record.mtp is not None and record.mtp.problem and record.problem is None:
            record.problem = Problem.MTP.refusal(record.mtp.problem)

        def loss(output_tensor: Any, *a: Any, **kw: Any) -> tuple:
            if record.problem is not None:
                return _zero_loss(output_tensor, record.per_token, kept, k)
            try:
                if k < 0:
                    raise ValueError(
                        "forward_step_func returned without reading its micro-batch from "
                        "the data iterator on the loss stage"
                    )
                with kept.active(k):
                    outputs = loss_func(output_tensor, *a, **kw)
                if kw.get("non_loss_data"):
                    return outputs
                if kept.phase is not Phase.ZERO and not kept.called[k]:
                    raise ValueError(
                        "mask_in_loss is on, but loss_func did not say which tokens it kept: "
                        "weigh the per-token losses with megatron_lossfix.kept_weights(weights, "
                        "keep) (weighted_loss(..., keep=) and rl_objective do)"
                    )
                if counting:
                    return _zero_loss(output_tensor, record.per_token, kept, k)
                kept.finish(k)
                return _scale(outputs, k, scale, record)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it after the step
                message = f"{type(exc).__name__}: {exc}"
                if f"micro-batch {k}" not in message:
                    message = f"micro-batch {k}: {message}"
                record.problem = Problem.LOSS_FUNC.refusal(message, exc)
                return _zero_loss(output_tensor, record.per_token, kept, k)

        return output, loss

    return forward_step


def _scale(outputs: Any, k: int, scale: Any, record: StepRecord) -> tuple:
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
    if len(outputs) == 2 and record.per_token:
        raise ValueError(
            "calculate_per_token_loss=True needs loss_func to return (loss, num_tokens, "
            "report), the loss tokens of the micro-batch on this rank; got (loss, report). "
            "Return a 3-tuple (megatron_lossfix.weighted_loss does), or set "
            "calculate_per_token_loss=False."
        )
    if record.config.check_finite:  # a host sync per micro-batch: opt-in
        if not bool(torch.isfinite(loss).all()):
            raise FloatingPointError(
                f"loss of micro-batch {k} is not finite ({loss.item()}); check_finite is on"
            )
        # Extremes (ratio_min/_max) may legitimately be +-inf on a zero-token micro-batch.
        entries = report.items() if isinstance(report, Mapping) else ()
        _check_finite(entries, f"report entry {{!r}} of micro-batch {k} is NaN", torch.isnan)
    record.contributions.append(loss.detach().reshape(()))
    record.reports.append(report)
    if record.passthrough:
        return outputs  # Megatron's own semantics, untouched
    if record.per_token:
        num_tokens = outputs[1]
        if record.config.mask_in_loss:  # the step decides what Megatron divides by
            num_tokens = record.kept.num_tokens(k, num_tokens)
        return loss * scale, num_tokens, report
    return loss * scale, report


# ---------------------------------------------------------------------- after the schedule
def _after_schedule(record: StepRecord, chunks: list, forward_only: bool) -> None:
    """Refuse the step on every rank if the loss stage hit an error inside the schedule or
    a malformed kept mask; learn the kept counts and, in a ``DEFERRED`` step, scale the
    gradients by the mode's global factor (not in a forward-only call: it made none): one
    small agreement over DP x CP (loss stage) and the pipeline group; none on a single rank
    without an error or a kept mask."""
    groups, kept = record.groups, record.kept
    used = kept is not None and any(kept.called)
    if record.problem is None and not used and groups.dp_cp_size <= 1 and groups.pp_size <= 1:
        return
    counts = _agree_kept(record, counted=False)
    if record.phase is Phase.DEFERRED and counts is not None:
        grad_scale, record.loss_scale = deferred_scale(
            record.config.reduction, record.per_token, counts
        )
        if grad_scale != 1.0 and not forward_only:
            _scale_gradients(record, chunks, grad_scale)


def _scale_gradients(record: StepRecord, chunks: list, factor: float) -> None:
    """The deferred scale, through the wrappers' ``scale_gradients``; until every rank has seen
    it change the gradient, each checks a sample and the worst verdict is every rank's."""
    check = wrappers.unseen(chunks)
    verdict = wrappers.scale_gradients(chunks, factor)
    if not check:
        return
    tp = megatron_compat.model_parallel_groups(record.pg_collection).tp
    groups = [record.groups.dp_cp, record.groups.pp, tp]
    problem = wrappers.agree_scale_seen(chunks, verdict, groups)
    if problem is not None:
        raise StepRefused(f"{REFUSAL_PREFIX}{problem}", Problem.WRAPPER)


def _agree_kept(record: StepRecord, *, counted: bool) -> KeptCounts | None:
    """The agreement after a pass over the micro-batches: this rank's problem, its kept
    masks' flags and counts (loss stage) summed over DP x CP and the pipeline group; raises
    on every rank of a refused step. Sets and returns ``record.kept_counts`` (None when no
    loss said what it kept). ``counted``: after the counting pass, which also hands the real
    pass its weights."""
    groups, kept, problem = record.groups, record.kept, record.problem
    mine = Agreement.of_rank(None, problem, num_counts=KEPT_COUNTS)
    if kept is not None:
        # Sequences split over CP ranks are counted whole where the normalization needs S.
        kept.whole_counts(communicate=record.config.mask_in_loss)
        counts, flags = kept.local(mine.counts.device)
        mine.counts.copy_(counts)
        mine.report(Problem.KEPT_MASK, (flags.amax() > 0).double())

    def late() -> StepRefused | None:  # asked only when the step is refused
        if kept is None or not any(f is not None and bool(f.amax() > 0) for f in kept.flags):
            return None
        return Problem.KEPT_MASK.refusal(kept.flag_message())

    agreed = agree(mine, groups)
    calls, tokens, seqs = agreed.verdict(groups.pp_size, problem, late=late)
    if calls <= 0:
        return None
    whole = seqs >= 0
    record.kept_counts = KeptCounts(
        calls=calls, num_tokens=tokens, num_sequences=seqs / groups.cp_size if whole else None
    )
    if counted and kept is not None:
        num_tokens = agreed.counts[1].to(kept.device)
        num_sequences = (agreed.counts[2] / groups.cp_size).to(kept.device)
        step_counts = kept.counts_of_pass(num_tokens, num_sequences)
        kept.counted(step_counts, record.config.reduction, record.config.norm_constant)
    return record.kept_counts


def _model_settings(config: LossFixConfig, chunk: Any) -> tuple[Any, Exception | None]:
    """The model's config, or the error reading it raised; settings that are the same on every
    rank and that the plugin cannot serve are refused here, before any collective."""
    model_config, error = megatron_compat.model_config_of(chunk)
    if error is not None:  # the agreement tells every rank
        return None, error
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


def _structure_problem(chunks: list, record: StepRecord) -> StepRefused | None:
    """The structural guards (``megatron_compat.unreduced_gradients``, then
    ``wrappers.wrapper_problem``), asked at every step: a few type checks and attribute reads,
    so no verdict is kept that could go stale."""
    kind = Problem.UNREDUCED
    try:
        message = megatron_compat.unreduced_gradients(chunks, record.model_config, record.groups)
        if message is None:
            kind, message = Problem.WRAPPER, wrappers.wrapper_problem(chunks)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        message = f"checking the model's DP wrapping raised {type(exc).__name__}: {exc}"
    return None if message is None else kind.refusal(message)


def _read_batches(source: Any, num_microbatches: int) -> list:
    if source is None:
        message = "the last pipeline stage needs a data iterator: it holds the loss (got None)"
        raise Problem.NO_ITERATOR.refusal(message)
    batches = []
    for k in range(num_microbatches):
        try:
            batches.append(next(source))
        except StopIteration:
            raise Problem.RAN_OUT.refusal(
                f"the data iterator ran out after {k} micro-batches but "
                f"num_microbatches={num_microbatches}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            # An iterable where an iterator belongs (a list, a range) fails at next(), here or
            # inside a wrapper such as the self-check's recorder.
            not_iterator = not hasattr(source, "__next__") or "is not an iterator" in str(exc)
            hint = "; pass an iterator (iter(...)), not an iterable" if not_iterator else ""
            message = (
                f"reading micro-batch {k} from the data iterator raised {type(exc).__name__}: "
                f"{exc}{hint}"
            )
            raise Problem.UNREADABLE.refusal(message, exc) from exc
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


def _zero_loss(
    output_tensor: Any, per_token: bool, kept: KeptStep | None = None, k: int = -1
) -> tuple:
    """A zero loss with the output's graph, in Megatron's form: the schedule ends normally
    (backward sends zero gradients upstream) and the step is refused after it. The kept
    masks' CP sum of micro-batch ``k`` still happens (its peers wait for it)."""
    if kept is not None and k >= 0:
        kept.finish(k)
    if isinstance(output_tensor, torch.Tensor) and output_tensor.is_floating_point():
        zero = (output_tensor * 0).sum().float()
    else:
        zero = torch.zeros((), device=default_device())
    if per_token:
        return zero, torch.zeros((), dtype=torch.int, device=zero.device), {}
    return zero, {}
