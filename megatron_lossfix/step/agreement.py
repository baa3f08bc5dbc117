"""The step's agreement: what a rank reports, how the ranks of a step agree, what each raises.

A plugin step is refused on every rank at once or on none, so that no rank is left blocked in a
collective its peers never reach (docs/design.md §3). Each rank fills an :class:`Agreement`: its
problem (one :class:`Problem` kind), the fingerprint of its settings, and the step's counts;
:func:`agree` sums the records, as one float64 tensor, over the loss stage's DP x CP group and
then over the pipeline group; :meth:`Agreement.verdict` reads the sum once on the host and
raises :class:`StepRefused` on every rank of a refused step: on the rank whose data caused it
with its own message, on its peers (:class:`ProblemOnAnotherRank`) with who reported what.

A step agrees twice: before Megatron's schedule (the counts and every check the step can make
from its inputs) and after it (errors met inside it). Counts ride in the record as a float64
vector whose layout the step defines; a new count is one more entry, and a new kind of problem
one more :class:`Problem` member.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.process_groups import StepGroups, group_size, same_on_every_rank
from megatron_lossfix.runtime.weights import MODES

REFUSAL_PREFIX = "megatron_lossfix refused this step: "


class StepRefused(ValueError):
    """Raised on every rank of a step the plugin refused: on the rank whose data caused it the
    message says what is wrong, on its peers which rank reported what kind of problem."""

    def __init__(self, message: str, kind: Problem | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        """What this rank reports to the agreement (None: refused before any collective)."""


class ProblemOnAnotherRank(StepRefused):
    """Raised on the ranks whose own data was fine when another rank of the step refused."""


class Problem(enum.Enum):
    """The kinds of problem a rank can report; each is counted in the agreement, and a peer's
    error names the kinds reported (the member's value)."""

    NO_ITERATOR = "the loss stage has no data iterator"
    UNREADABLE = "the loss stage's data iterator could not be read"
    RAN_OUT = "the loss stage's data iterator ran out before num_microbatches"
    NOT_DICT = "a micro-batch is not a dict holding the loss mask"
    MALFORMED = "a loss mask is malformed"
    MASK_VALUES = "a loss mask holds values other than 0 and 1"
    OTHER = "an error while preparing the step"
    DISAGREE = "ranks disagree on the loss reduction or calculate_per_token_loss"
    LOSS_FUNC = "the loss function failed or returned what the plugin cannot use"
    MTP = "the multi-token prediction loss could not be normalized"
    UNREDUCED = "the model's gradients are not reduced across data-parallel ranks"
    WRAPPER = "the model's data-parallel wrapper is not one the plugin has proven"
    KEPT_MASK = "a mask decided in the loss (kept_weights) is malformed"
    GROUP_IDS = "a micro-batch's group or trajectory ids are missing, malformed or out of range"

    def refusal(self, message: str, cause: BaseException | None = None) -> StepRefused:
        """This rank's reason to refuse the step, of this kind, which the agreement tells every
        rank; ``cause`` is chained to the error this rank raises."""
        problem = StepRefused(message, self)
        problem.__cause__ = cause
        return problem


_KINDS = tuple(Problem)
_HEADER = 4  # fingerprint, fingerprint_sq, problems, rank_sum: then the kinds, then the counts


@dataclass(frozen=True, slots=True)
class StepSettings:
    """What every rank of a step must share: the loss reduction and the model's
    ``calculate_per_token_loss``."""

    reduction: str
    per_token: bool

    @property
    def fingerprint(self) -> float:
        """A small integer that differs between any two settings."""
        return float(1 + 2 * MODES.index(self.reduction) + int(self.per_token))

    def __str__(self) -> str:
        return f"{self.reduction!r}, per-token={self.per_token}"


def default_device() -> torch.device:
    """The agreement's device: NCCL reduces CUDA tensors only, and every stage must bring the
    same kind of tensor to the pipeline all-reduce."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass(eq=False, slots=True)
class Agreement:
    """One rank's report, or the sum of the reports of a step's ranks (float64 on the device:
    counts are exact below 2**53). It turns into one tensor (:meth:`to_tensor`), the thing the
    all-reduces sum, and back (:meth:`from_tensor`)."""

    fingerprint: torch.Tensor
    """The settings' fingerprints, summed: they are all equal exactly when
    ``fingerprint**2 == ranks * fingerprint_sq`` (0 when no settings are compared)."""
    fingerprint_sq: torch.Tensor
    """Their squares, summed."""
    problems: torch.Tensor
    """Ranks that reported a problem."""
    rank_sum: torch.Tensor
    """Their global ranks + 1, summed (the rank itself when one reported)."""
    kinds: torch.Tensor
    """``[len(Problem)]``: how often each kind was reported, in :class:`Problem` order."""
    counts: torch.Tensor
    """The step's counts, summed; their layout is the step's."""
    vec: torch.Tensor | None = field(default=None, repr=False)
    """The one vector the fields above are views of (:meth:`from_tensor`), else None."""

    @classmethod
    def of_rank(
        cls,
        settings: StepSettings | None,
        problem: StepRefused | None = None,
        *,
        num_counts: int = 0,
        rank: int | None = None,
        device: torch.device | None = None,
    ) -> Agreement:
        """This rank's report: its settings (None: compared elsewhere), its problem, and
        ``num_counts`` zero counts for the step to fill (the same number on every rank).
        ``rank``: the global rank (default this process's)."""
        device = default_device() if device is None else device
        vec = torch.zeros(_HEADER + len(_KINDS) + num_counts, dtype=torch.float64, device=device)
        record = cls.from_tensor(vec)
        if settings is not None:
            record.fingerprint += settings.fingerprint
            record.fingerprint_sq += settings.fingerprint**2
        if problem is not None:
            record.report(problem.kind or Problem.OTHER, rank=rank)
        return record

    def report(
        self, kind: Problem, flagged: torch.Tensor | float = 1.0, *, rank: int | None = None
    ) -> None:
        """Count a problem of ``kind`` reported by global rank ``rank`` (default: this
        process's). ``flagged``: 1, or a 0/1 tensor on the device, so that a check needs no
        host sync before the all-reduce."""
        flagged = self._count(kind, flagged)
        self.rank_sum += flagged * ((_this_rank() if rank is None else rank) + 1.0)

    def _count(self, kind: Problem, flagged: torch.Tensor | float) -> torch.Tensor | float:
        if isinstance(flagged, torch.Tensor):
            flagged = flagged.to(device=self.kinds.device, dtype=torch.float64)
        self.kinds[_KINDS.index(kind)] += flagged
        self.problems += flagged
        return flagged

    def settings_differ(self, ranks: int) -> torch.Tensor:
        """Whether the ``ranks`` summed here brought different settings (a 0-dim bool)."""
        return ~same_on_every_rank(self.fingerprint, self.fingerprint_sq, ranks)

    def for_pipeline(self, mine: Agreement, ranks: int) -> Agreement:
        """This sum over the loss stage's ``ranks`` DP x CP ranks as it goes to the pipeline
        round: settings that differ inside it become a :attr:`Problem.DISAGREE` every stage
        hears of, and the fingerprint is ``mine``'s again, so that the pipeline sum compares
        the stages' settings."""
        self._count(Problem.DISAGREE, self.settings_differ(ranks))  # no one rank's
        self.fingerprint.copy_(mine.fingerprint)
        self.fingerprint_sq.copy_(mine.fingerprint_sq)
        return self

    def to_tensor(self) -> torch.Tensor:
        """One float64 vector: the header, the kinds, then the counts (a new tensor)."""
        return torch.cat([self._header(), self.kinds, self.counts])

    def _as_vector(self) -> torch.Tensor:
        """:meth:`to_tensor`, without a copy where the fields are views of one vector."""
        return self.vec if self.vec is not None else self.to_tensor()

    def _header(self) -> torch.Tensor:
        return torch.stack([self.fingerprint, self.fingerprint_sq, self.problems, self.rank_sum])

    @classmethod
    def from_tensor(cls, vec: torch.Tensor) -> Agreement:
        """The record :meth:`to_tensor` made (of views into ``vec``)."""
        fingerprint, fingerprint_sq, problems, rank_sum = vec[:_HEADER].unbind()
        kinds, counts = vec[_HEADER:].split([len(_KINDS), len(vec) - _HEADER - len(_KINDS)])
        return cls(fingerprint, fingerprint_sq, problems, rank_sum, kinds, counts, vec)

    def verdict(
        self,
        pp_size: int,
        mine: StepRefused | None,
        settings: StepSettings | None = None,
        late: Callable[[], StepRefused | None] | None = None,
    ) -> list[float]:
        """Raise on this rank if the step is refused; this record is the sum over the step.
        Returns the counts, read in the same host read.

        ``pp_size``: the pipeline stages whose fingerprints were summed; ``mine``: this rank's
        problem; ``settings``: this rank's, for the message; ``late``: this rank's problem
        found on the device (without a sync before the all-reduce), asked only when the step
        is refused. One host read of the record; returns the counts it read (the device's stay
        in :attr:`counts`).
        """
        values = self._as_vector().tolist()
        fp, fp_sq, problems, rank_sum = values[:_HEADER]
        kinds, counts = values[_HEADER : _HEADER + len(_KINDS)], values[_HEADER + len(_KINDS) :]
        stages_differ = not same_on_every_rank(fp, fp_sq, pp_size)
        if stages_differ or kinds[_KINDS.index(Problem.DISAGREE)] > 0:
            where = "pipeline stages" if stages_differ else "data- or context-parallel ranks"
            raise StepRefused(
                f"{REFUSAL_PREFIX}{where} disagree on the loss reduction or "
                f"calculate_per_token_loss (this rank: {settings}); give every rank the same "
                "--loss-reduction"
            )
        if problems <= 0:
            return counts
        mine = mine if mine is not None or late is None else late()
        if mine is not None:
            raise StepRefused(f"{REFUSAL_PREFIX}{mine}", mine.kind) from mine.__cause__
        reported = [kind.value for kind, n in zip(_KINDS, kinds, strict=True) if n > 0]
        count = int(problems)
        who = f"global rank {int(rank_sum) - 1}" if count == 1 else f"{count} ranks"
        raise ProblemOnAnotherRank(
            f"{REFUSAL_PREFIX}{'; '.join(reported)} (reported by {who}; see its error for the "
            "details); every rank of the step stops"
        )


def _sum_over(vec: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``vec`` summed over ``group`` in place (nothing is sent for a group of one)."""
    if group_size(group) > 1:
        dist.all_reduce(vec, group=group)
    return vec


def agree(mine: Agreement, groups: StepGroups) -> Agreement:
    """The reports of a step's ranks, summed: over DP x CP on the loss stage, then over the
    pipeline group on every stage (one all-reduce each; none over a group of one). Nothing
    here reads the device; :meth:`Agreement.verdict` does, once."""
    vec = mine._as_vector().clone()  # summed in place: ``mine`` stays this rank's
    if groups.is_last_stage and groups.dp_cp_size > 1:  # one rank: the sum is its report
        stage = Agreement.from_tensor(_sum_over(vec, groups.dp_cp))
        vec = stage.for_pipeline(mine, groups.dp_cp_size)._as_vector()
    return Agreement.from_tensor(_sum_over(vec, groups.pp))
