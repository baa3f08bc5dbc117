"""Masks decided inside the loss: which tokens a loss keeps, and their weights (docs/design.md §10).

Some objectives decide which loss tokens count only once the current forward pass exists: an
importance-ratio band, off-policy sequence masking, a filter on the loss itself. Such a loss
tells the plugin what it kept by weighing its per-token losses with :func:`kept_weights`
(``weighted_loss(..., keep=)`` and ``rl_objective``'s masks do). ``LossFixConfig.mask_in_loss``
picks what a dropped token means:

* ``False`` (default, **zeroed**): the token's loss is zeroed, the token still counts in the
  normalization (the step's weights times the kept mask), as padding does in
  ``token_mean_legacy``;
* ``True`` (**excluded**): dropped tokens leave every count of the mode (N, S, n_s, n_k): the
  step's loss is the mode's normalization of the kept tokens alone, exactly, under any layout.

Under ``mask_in_loss`` the kept counts are known only after the forward passes. A :class:`KeptStep`
(one per step, on the loss stage) serves the loss's calls in one :class:`Phase`:

* ``LOCAL``: the weights need no global count (``sum``; ``token_mean_legacy``, whose n_k is a
  micro-batch's own): the loss gets final weights;
* ``DEFERRED``: the weights hold the mode's local part (``token_mean``: the kept mask;
  ``sequence_mean``: ``keep / n_s``; ``seq_mean_token_sum_norm``: ``keep / C``) and the step
  scales the gradients once after Megatron's schedule by the global part (1/N or 1/S);
* ``COUNT`` then ``REPLAY``: a forward-only counting pass records the kept masks, the step counts
  them like loss masks, and the real pass's loss gets the weights of those masks (always for
  weights over group ids: ``group_mean``'s kept groups and their kept tokens, the sequence modes'
  trajectories, whose counts span micro-batches with a different factor per group);
* ``ZERO``: the zeroed semantics; the kept counts only feed the metrics.

Every phase checks the kept mask on the device (0/1 values, the same for every call of one
micro-batch) and reports it in the step's agreement after the schedule, so a malformed mask
refuses the step on every rank. The mask selects among the loss tokens: what it keeps outside
the loss mask (a filter on every position, ``lambda l: l < 8``) is ignored. Nothing here
synchronizes with the host; the one collective inside the micro-batch loop is the sum of a
sequence's kept tokens over the context-parallel group, for the modes whose weights need it
(``sequence_mean``, ``token_mean_legacy``), once per micro-batch.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.mode_record import Count, KeptPart
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.process_groups import group_size
from megatron_lossfix.runtime.prompt_groups import GroupIds, group_tokens
from megatron_lossfix.runtime.weights import StepCounts, local_pairs, weights_from_counts

__all__ = ["KeptCounts", "KeptStep", "Phase", "kept_weights", "weighted_stats"]

_COUNT_DTYPE = torch.float64
#: The counts a kept step adds to the agreement after the schedule (see :meth:`KeptStep.local`).
NUM_COUNTS = 3


class Phase(enum.Enum):
    """What :func:`kept_weights` returns during a step (module docstring)."""

    ZERO = "zero"
    LOCAL = "local"
    DEFERRED = "deferred"
    COUNT = "count"
    REPLAY = "replay"


def phase_for(
    mode: str, mask_in_loss: bool, counting_pass: bool, side_paths: bool, grouped: bool = False
) -> Phase:
    """The phase a step starts in. ``counting_pass``: asked for (every mode counts first);
    ``side_paths``: the gradient has terms besides the loss, which a scale after the schedule
    would rescale (the modes that wait for a global count count first); ``grouped``: the
    weights are over group ids (``group_mean``, trajectories), a factor per group that spans
    micro-batches, which no scale after the schedule can apply (counted first)."""
    if not mask_in_loss:
        return Phase.ZERO
    factors = mode_of(mode).kept  # None: a mode that counts its kept masks first
    if counting_pass or grouped or factors is None:
        return Phase.COUNT
    if factors.divides_by is None:
        return Phase.LOCAL
    return Phase.COUNT if side_paths else Phase.DEFERRED


@dataclass(frozen=True, slots=True)
class KeptCounts:
    """The step's kept counts, agreed after the schedule (host floats, every rank of the step)."""

    calls: float
    """Micro-batches whose loss said what it kept (0: the loss never called kept_weights)."""
    num_tokens: float
    """N: kept tokens of the step."""
    num_sequences: float | None
    """S: sequences with a kept token (None where not counted: zeroed semantics under CP)."""


_ACTIVE: ContextVar[tuple[KeptStep, int] | None] = ContextVar("megatron_lossfix_kept", default=None)


def kept_weights(weights: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of the tokens a loss keeps: weigh the per-token losses with what this returns.

    ``weights``: the micro-batch's weights from the step (``batch["loss_weights"]``), as the loss
    function sees them (after any context-parallel slicing); ``keep``: the loss's kept mask of
    the same shape (bool or 0/1; None: every loss token). Outside a plugin step, and with
    ``LossFixConfig(mask_in_loss=False)``, this is ``weights * keep``: dropped tokens are
    zeroed and still count. With ``mask_in_loss=True`` they leave the normalization (module
    docstring); the returned weights then hold only part of it until the step is over, so
    report sums weighted by them are named with ``weighted_stats``
    (``megatron_lossfix.runtime.mask_in_loss.weighted_stats``).
    """
    active = _ACTIVE.get()
    if active is None:
        return weights if keep is None else weights * _checked(weights, keep)
    keeper, k = active
    return keeper.weigh(k, weights, keep)


def weighted_stats(*names: str) -> None:
    """Declare report entries (named ``*_sum``) that are sums weighted by :func:`kept_weights`'s
    result: ``step_metrics()`` gives their global value under ``mask_in_loss`` too, where the
    weights receive their global factor only after the step. Outside a plugin step, a no-op."""
    active = _ACTIVE.get()
    if active is not None:
        active[0].weighted_names.update(names)


def _checked(weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``keep`` as float32, after the checks that need no device sync."""
    if not isinstance(weights, torch.Tensor):
        raise ValueError(
            f"kept_weights takes the step's weights tensor, got {type(weights).__name__}"
        )
    if not isinstance(keep, torch.Tensor):
        raise ValueError(f"the kept mask must be a tensor, got {type(keep).__name__}")
    if keep.shape != weights.shape:
        raise ValueError(
            f"the kept mask has shape {tuple(keep.shape)} but the weights have "
            f"{tuple(weights.shape)}; both must be the micro-batch's [batch, seq] as the loss "
            "sees it"
        )
    if keep.is_complex():
        raise ValueError(f"the kept mask has unsupported dtype {keep.dtype}")
    return keep.to(device=weights.device, dtype=torch.float32)


@dataclass(eq=False)
class KeptStep:
    """One step's kept masks on the loss stage: what :func:`kept_weights` returns for each
    micro-batch, and what the step learns from it (device tensors, one slot per micro-batch)."""

    mode: str
    phase: Phase
    rows: list[int]
    """Sequences of each micro-batch (rows, or packed sequences)."""
    device: torch.device
    """The masks' device."""
    dp_size: int
    cp_group: dist.ProcessGroup | None
    norm_constant: float | None = None
    segment_ids: list[torch.Tensor | None] | None = None
    """Packed micro-batches: each token's sequence (None: rows)."""
    weighted_names: set[str] = field(default_factory=set)
    """Report entries declared with :func:`weighted_stats`."""
    replay: list[torch.Tensor] | None = None
    """``REPLAY``: the real pass's weights of each micro-batch (CP shards as the loss sees them)."""
    group_ids: GroupIds | None = None
    """Where the weights are over groups: each sequence's group (``COUNT`` only)."""
    dp_cp_group: dist.ProcessGroup | None = None
    """Where the kept tokens of each group are summed (the step's DP x CP group)."""

    def __post_init__(self) -> None:
        m = len(self.rows)
        self.seq_kept: list[torch.Tensor | None] = [None] * m
        """Per micro-batch, each sequence's kept tokens (this rank's shard until summed)."""
        self.whole: list[bool] = [False] * m
        """Whether ``seq_kept[k]`` was summed over the CP group."""
        self.kept_tokens: list[torch.Tensor | None] = [None] * m
        self.mask_tokens: list[torch.Tensor | None] = [None] * m
        self.flags: list[torch.Tensor | None] = [None] * m
        """``[values not 0/1, differs between calls]`` (0/1 floats)."""
        self.masks: list[torch.Tensor | None] = [None] * m
        """``COUNT``: the kept masks (float32) the counting pass recorded."""
        self._first: dict[int, torch.Tensor] = {}
        self.called: list[bool] = [False] * m
        self.group_counts: torch.Tensor | None = None
        """After a counting pass over groups: the kept tokens of each group, global."""

    @property
    def cp_size(self) -> int:
        return group_size(self.cp_group)

    @property
    def deferred(self) -> bool:
        """Whether the gradients wait for the global kept count (``DEFERRED``)."""
        return self.phase is Phase.DEFERRED

    @contextlib.contextmanager
    def active(self, k: int) -> Iterator[None]:
        """:func:`kept_weights` serves micro-batch ``k`` from this step while the loss runs."""
        token = _ACTIVE.set((self, k))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    # ------------------------------------------------------------------ in the loss
    def weigh(self, k: int, weights: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """:func:`kept_weights` for micro-batch ``k``."""
        mask = weights != 0 if isinstance(weights, torch.Tensor) else None
        if self.phase is Phase.ZERO and keep is None:  # nothing to zero, nothing to count
            return weights
        if self.phase is Phase.REPLAY:  # the counts are the counting pass's
            if mask is None:
                raise ValueError(
                    f"kept_weights takes the step's weights tensor, got {type(weights).__name__}"
                )
            self.called[k] = True
            self.mask_tokens[k] = mask.sum(dtype=torch.int)
            return self._replayed(k, weights)
        try:
            kf = mask.float() if keep is None else _checked(weights, keep)
        except ValueError:
            self.finish(k)  # the CP peers' sum of this micro-batch must still happen
            raise
        seg = None if self.segment_ids is None else self.segment_ids[k]
        if seg is not None and seg.shape != kf.shape:
            self.finish(k)
            raise ValueError(
                f"micro-batch {k} is packed as {tuple(seg.shape)} but the loss's tensors are "
                f"{tuple(kf.shape)}"
            )
        bad_values = ((kf != 0) & (kf != 1)).any()
        kf = ((kf == 1) & mask).float()  # only loss tokens; a flagged step is refused
        first = self._first.setdefault(k, kf)
        differs = (first != kf).any() if first is not kf else torch.zeros_like(bad_values)
        flags = torch.stack([bad_values, differs]).to(_COUNT_DTYPE)
        self.flags[k] = flags if self.flags[k] is None else torch.maximum(self.flags[k], flags)
        self.called[k] = True
        self.kept_tokens[k] = kf.sum(dtype=_COUNT_DTYPE)
        self.mask_tokens[k] = mask.sum(dtype=torch.int)
        if not self.whole[k]:  # a later call of the same micro-batch keeps the summed counts
            self.seq_kept[k] = _sequence_counts(kf, seg, self.rows[k])
            if self._row_sum_in_loss:
                self.finish(k)
        if self.phase is Phase.ZERO:
            return weights * kf
        if self.phase is Phase.COUNT:
            self.masks[k] = kf
            return weights * kf
        return kf * self._local_factor(k, seg)

    @property
    def _row_sum_in_loss(self) -> bool:
        return (
            self.phase in (Phase.LOCAL, Phase.DEFERRED)
            and mode_of(self.mode).kept.whole_sequences
            and self.cp_size > 1
        )

    def finish(self, k: int) -> None:
        """Called by the step after micro-batch ``k``'s loss (or in its place): the one sum of
        its sequences' kept tokens over the CP group where the weights need it, with zeros when
        the loss did not get that far, so that the CP peers never wait."""
        self._first.pop(k, None)
        if not self._row_sum_in_loss or self.whole[k]:
            return
        counts = self.seq_kept[k]
        if counts is None:
            counts = torch.zeros(self.rows[k], dtype=_COUNT_DTYPE, device=self.device)
        dist.all_reduce(counts, group=self.cp_group)
        self.seq_kept[k], self.whole[k] = counts, True

    def _local_factor(self, k: int, seg: torch.Tensor | None) -> torch.Tensor | float:
        """The part of the mode's weight that the micro-batch knows (module docstring); only
        ``LOCAL`` and ``DEFERRED`` steps ask, whose modes have kept factors (:func:`phase_for`)."""
        part = KeptPart(
            seq_kept=self.seq_kept[k],
            segments=seg,
            num_microbatches=len(self.rows),
            dp_size=self.dp_size,
            norm_constant=self.norm_constant,
        )
        return mode_of(self.mode).kept.local(part)

    def _replayed(self, k: int, weights: torch.Tensor) -> torch.Tensor:
        replay = self.replay[k]
        if replay.shape != weights.shape:
            raise ValueError(
                f"micro-batch {k}: the weights have shape {tuple(weights.shape)} in the real "
                f"pass but {tuple(replay.shape)} in the counting pass"
            )
        return replay

    # ------------------------------------------------------------------ after the loss
    def num_tokens(self, k: int, fallback: torch.Tensor) -> torch.Tensor:
        """What Megatron's per-token path should sum for micro-batch ``k``: the kept tokens
        when it divides by the kept count (``DEFERRED``), else the loss mask's tokens."""
        if self.deferred and self.kept_tokens[k] is not None:
            return self.kept_tokens[k].to(torch.int)
        return fallback if self.mask_tokens[k] is None else self.mask_tokens[k]

    def whole_counts(self, communicate: bool = True) -> None:
        """Sum every micro-batch's per-sequence kept counts over the CP group that are not yet
        summed: one all-reduce for the step (none without CP, nor without ``communicate``)."""
        if self.cp_size <= 1:
            self.whole = [True] * len(self.rows)
            return
        if not communicate:
            return
        device = self.device
        missing = [k for k, whole in enumerate(self.whole) if not whole]
        if not missing:
            return
        parts = [
            self.seq_kept[k]
            if self.seq_kept[k] is not None
            else torch.zeros(self.rows[k], dtype=_COUNT_DTYPE, device=device)
            for k in missing
        ]
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.cp_group)
        parts = torch.split(flat, [self.rows[k] for k in missing])
        for k, part in zip(missing, parts, strict=True):
            self.seq_kept[k], self.whole[k] = part, True

    def local(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's counts for the agreement, ``[calls, kept tokens, kept sequences x CP
        size]`` (each CP rank counts a whole sequence: the sum is divided by the CP size), and
        its flags ``[values, differs]``; the sequences are -1 where not whole."""
        zero = torch.zeros((), dtype=_COUNT_DTYPE, device=device)
        tokens = sum((t.to(device) for t in self.kept_tokens if t is not None), zero)
        if all(self.whole):
            kept = [c for c in self.seq_kept if c is not None]
            seqs = sum(((c > 0).sum(dtype=_COUNT_DTYPE).to(device) for c in kept), zero)
        else:
            seqs = zero - 1.0
        calls = zero + float(sum(self.called))
        flags = [f.to(device) for f in self.flags if f is not None]
        flag = torch.zeros(2, dtype=_COUNT_DTYPE, device=device)
        if flags:
            flag = torch.stack(flags).amax(0)
        return torch.stack([calls, tokens, seqs]), flag

    def flag_message(self) -> str:
        """What is wrong with this rank's kept masks (asked only when the step is refused)."""
        for k, flags in enumerate(self.flags):
            if flags is None:
                continue
            values, differs = flags.tolist()
            if values:
                return (
                    f"micro-batch {k}: the kept mask holds values other than 0 and 1 (bool or "
                    "0/1; NaN, fractions and negatives are refused)"
                )
            if differs:
                return (
                    f"micro-batch {k}: kept_weights was called with different kept masks in one "
                    "micro-batch; use one mask per micro-batch"
                )
        return "a kept mask is malformed"

    # ------------------------------------------------------------------ counting pass
    def counted(self, counts: StepCounts, mode: str, norm_constant: float | None) -> None:
        """After the counting pass: the real pass's weights from the recorded kept masks and
        their agreed counts (``counts.seq_tokens`` whole), and the ``REPLAY`` phase."""
        device = counts.num_tokens.device
        masks = [m if m is not None else torch.zeros(0, device=device) for m in self.masks]
        self.replay = weights_from_counts(
            masks, counts, mode, norm_constant=norm_constant, segment_ids=self.segment_ids
        )
        self.group_counts = counts.group_tokens
        self.phase = Phase.REPLAY
        self._first.clear()
        self.called = [False] * len(self.rows)
        self.flags = [None] * len(self.rows)

    def counts_of_pass(self, num_tokens: torch.Tensor, num_sequences: torch.Tensor) -> StepCounts:
        """The counting pass's :class:`StepCounts` (its per-sequence counts whole)."""
        device = num_tokens.device
        seq = [
            c.to(device) if c is not None else torch.zeros(r, dtype=_COUNT_DTYPE, device=device)
            for c, r in zip(self.seq_kept, self.rows, strict=True)
        ]
        per_group = num_pairs = None
        if self.group_ids is not None:
            # One all-reduce of the kept tokens per group (pair ids: of the pairs with a kept
            # token); CP ranks hold whole sequences.
            pairs = self.group_ids.ranges is not None
            ids = self.group_ids.ids
            per_group = local_pairs(seq, ids)[None] if pairs else group_tokens(seq, self.group_ids)
            if group_size(self.dp_cp_group) > 1:
                dist.all_reduce(per_group, group=self.dp_cp_group)
            per_group = per_group / float(self.cp_size)
            if pairs:
                per_group, num_pairs = None, per_group[0]
        return StepCounts(
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            seq_tokens=seq,
            mb_tokens=torch.stack([c.sum() for c in seq]),
            dp_size=self.dp_size,
            group_tokens=per_group,
            group_ids=None if self.group_ids is None else list(self.group_ids.ids),
            num_pairs=num_pairs,
        )


def _sequence_counts(kf: torch.Tensor, seg: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Each sequence's kept tokens in ``kf`` (rows, or the packed sequences ``seg``)."""
    if seg is None:
        return kf.sum(dim=1, dtype=_COUNT_DTYPE)
    counts = torch.zeros(rows, dtype=_COUNT_DTYPE, device=kf.device)
    return counts.index_add_(0, seg.reshape(-1), kf.reshape(-1).double())


def deferred_scale(mode: str, per_token: bool, counts: KeptCounts) -> tuple[float, float]:
    """``(gradient scale, loss scale)`` of a ``DEFERRED`` step once its kept counts are agreed:
    the loss scale is the mode's global factor (1/N, 1/S); Megatron's per-token path has
    already divided the gradients by N (the kept tokens it was handed), which the gradient
    scale undoes. Zero counts give 1 (the gradient is zero then anyway): never NaN."""
    factors = mode_of(mode).kept
    if factors is None or factors.divides_by is None:
        raise ValueError(f"reduction {mode!r} waits for no global count (no DEFERRED step)")
    n = max(counts.num_tokens, 1.0)
    global_counts = {Count.N: n, Count.S: max(counts.num_sequences or 0.0, 1.0)}
    loss = 1.0 / global_counts[factors.divides_by]
    return (loss * n if per_token else loss), loss
