"""The step's agreement: why a rank refuses a step, and how every rank of the step hears of it.

A plugin step is refused on every rank of the step, never on one alone (which would leave its
peers blocked in Megatron's point-to-point or gradient communication). Each rank puts what it
found into one small float64 vector (:func:`agreement_vector`: the step's counts, a fingerprint
of the settings, and one slot per kind of problem); the schedule all-reduces it over the loss
stage's data x context-parallel group and the pipeline group, and :func:`verdict` raises
:class:`StepRefused` on every rank when any rank reported a problem. The settings that are the
same on every rank are refused here before any collective (:func:`refuse_hybrid_cp`,
:func:`refuse_sharded_mtp`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lossfix.config import LossFixConfig
from megatron_lossfix.megatron_compat import StepGroups
from megatron_lossfix.reduction import bad_mask_message

__all__ = [
    "KINDS",
    "VECTOR_LEN",
    "LocalProblem",
    "ProblemOnAnotherRank",
    "StepRefused",
    "agreement_vector",
    "default_device",
    "refuse_hybrid_cp",
    "refuse_sharded_mtp",
    "verdict",
]


class StepRefused(ValueError):
    """Raised on every rank of a step the plugin refused (see the message for why).

    On the rank whose data caused it the message says exactly what is wrong; on its peers (the
    other data- and context-parallel ranks and the other pipeline stages) it names that rank and
    the kind of problem."""


class ProblemOnAnotherRank(StepRefused):
    """Raised on the ranks whose own data was fine when another rank of the step refused."""


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------- the step's agreement
# What a rank can report, one slot each in the agreement vector (several ranks may report).
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
)
(
    NO_ITERATOR, UNREADABLE, RAN_OUT, NOT_DICT, MALFORMED, MASK_VALUES, OTHER, DISAGREE,
    LOSS_FUNC, MTP_PROBLEM,
) = range(len(KINDS))  # fmt: skip
# Agreement vector: [N, S, fingerprint, fingerprint**2, ranks with a problem, sum of their
# (global rank + 1), one count per kind], then N and S of each MTP layer's shifted masks.
# float64: exact for counts below 2**53.
SLOT_N, SLOT_S, SLOT_FP, SLOT_FP2, SLOT_PROBLEMS, SLOT_RANK_SUM, SLOT_KIND0 = range(7)
VECTOR_LEN = SLOT_KIND0 + len(KINDS)
REFUSAL_PREFIX = "megatron_lossfix refused this step: "


def refuse_hybrid_cp(chunk: Any) -> None:
    """Megatron 0.19's hybrid context parallelism calls forward_step once per sub-sample, so
    neither the pre-pass (one batch per micro-batch) nor the x num_microbatches compensation
    holds there. The setting is the same on every rank: each raises here, before any
    collective."""
    try:
        from megatron.core.utils import get_model_config

        config = get_model_config(chunk)
    except Exception:  # noqa: BLE001 - no config to read: not hybrid CP
        return
    if getattr(config, "hybrid_context_parallel", False):
        raise StepRefused(
            f"{REFUSAL_PREFIX}hybrid context parallelism (hybrid_context_parallel=True) runs "
            "forward_step once per sub-sample, which the plugin's modes do not cover; use "
            "--loss-reduction off with calculate_per_token_loss=True there (Megatron's own "
            "per-token mode is the exact token mean)"
        )


def refuse_sharded_mtp(mtp_layers: int, config: LossFixConfig) -> None:
    """MTP layers read the loss mask of later positions, which CP shards from the data
    iterator do not hold; the setting is the same on every rank: each raises, before any
    collective."""
    if mtp_layers and config.data_is_cp_sharded:
        raise StepRefused(
            f"{REFUSAL_PREFIX}multi-token prediction (mtp_num_layers={mtp_layers}) needs whole "
            "sequences from the data iterator (data_is_cp_sharded=False): slice them for "
            "context parallelism in forward_step"
        )


def agreement_vector(
    problem: LocalProblem | None, rank: int, device: torch.device, mtp_layers: int = 0
) -> torch.Tensor:
    """A zero agreement vector carrying this rank's problem, if any (plus two slots for the
    counts of each MTP layer)."""
    vec = torch.zeros(VECTOR_LEN + 2 * mtp_layers, dtype=torch.float64, device=device)
    if problem is not None:
        vec[SLOT_PROBLEMS], vec[SLOT_RANK_SUM] = 1.0, rank + 1.0
        vec[SLOT_KIND0 + problem.kind] = 1.0
    return vec


class LocalProblem(Exception):
    """This rank's reason to refuse the step (raised and caught inside the plugin)."""

    def __init__(self, kind: int, message: str):
        super().__init__(message)
        self.kind = kind


def verdict(
    values: list[float],
    groups: StepGroups,
    reduction: str,
    per_token: bool,
    problem: LocalProblem | None,
    bad: torch.Tensor | None,
) -> None:
    """Raise on this rank if any rank of the step refused it (``values``: the reduced
    agreement vector, on the host)."""
    stages_differ = values[SLOT_FP] ** 2 != groups.pp_size * values[SLOT_FP2]
    if stages_differ or values[SLOT_KIND0 + DISAGREE] > 0:
        where = "pipeline stages" if stages_differ else "data- or context-parallel ranks"
        raise StepRefused(
            f"{REFUSAL_PREFIX}{where} disagree on the loss reduction or calculate_per_token_loss "
            f"(this rank: {reduction!r}, per-token={per_token}); give every "
            "rank the same --loss-reduction"
        )
    if values[SLOT_PROBLEMS] <= 0:
        return
    if problem is not None:
        raise StepRefused(f"{REFUSAL_PREFIX}{problem}") from problem.__cause__
    if bad is not None and bool(bad.any()):
        raise StepRefused(REFUSAL_PREFIX + bad_mask_message(int(bad.nonzero()[0, 0])))
    kinds = [KINDS[i] for i in range(len(KINDS)) if values[SLOT_KIND0 + i] > 0]
    count = int(values[SLOT_PROBLEMS])
    who = f"global rank {int(values[SLOT_RANK_SUM]) - 1}" if count == 1 else f"{count} ranks"
    raise ProblemOnAnotherRank(
        f"{REFUSAL_PREFIX}{'; '.join(kinds)} (reported by {who}; see its error for the details); "
        "every rank of the step stops"
    )
