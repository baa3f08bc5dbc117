"""The loss stage's micro-batches in a plugin step: read before the schedule, then weighted.

The schedule (:mod:`megatron_lossfix.schedule`) reads every micro-batch of the step on the last
pipeline stage before Megatron's schedule starts (:func:`prepare_step`), so that the counts can
be agreed on in one all-reduce (:mod:`megatron_lossfix.agreement`). After the agreement the
weights are built (:func:`step_weights`, :func:`mtp_step` for multi-token prediction) and the
pre-read batches are handed to Megatron again, each with its weights, by a
:class:`StepIterator`. What goes wrong while reading is raised as a ``LocalProblem`` that every
rank of the step hears of.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lossfix.agreement import (
    MALFORMED,
    MTP_PROBLEM,
    NO_ITERATOR,
    NOT_DICT,
    OTHER,
    RAN_OUT,
    UNREADABLE,
    LocalProblem,
    StepRefused,
    refuse_sharded_mtp,
)
from megatron_lossfix.config import LossFixConfig
from megatron_lossfix.megatron_compat import StepGroups, slice_batch_for_cp, undo_mtp_averaging
from megatron_lossfix.mtp import MTPStep, install_hooks
from megatron_lossfix.reduction import (
    StepCounts,
    float_masks,
    segment_ids,
    shifted_masks,
    weights_from_counts,
)

__all__ = [
    "MTPLayout",
    "PreparedStep",
    "StepIterator",
    "check_finite_inputs",
    "mtp_step",
    "prepare_step",
    "read_step",
    "segments_of",
    "step_weights",
]

Segments = tuple[torch.Tensor | None, int | None]


class StepIterator:
    """Yields one step's pre-read micro-batches with weights attached; remembers which came
    last."""

    def __init__(self, batches: list, attach: Callable[[Any, int], dict]):
        self._batches = batches
        self._attach = attach
        self.index = -1
        """The index of the micro-batch handed out last (-1: none yet)."""

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.index + 1 >= len(self._batches):
            raise StopIteration
        self.index += 1
        return self._attach(self._batches[self.index], self.index)


@dataclass(kw_only=True, slots=True)
class PreparedStep:
    """What a plugin step found out before any collective, on this rank."""

    per_token: bool = False
    """The model's ``calculate_per_token_loss`` (False where it could not be read)."""
    mtp_layers: int = 0
    """The model's ``mtp_num_layers`` (0: no multi-token prediction)."""
    model_config: Any = None
    """The model's config, as Megatron's ``get_model_config`` returns it."""
    batches: list = field(default_factory=list)
    """The loss stage's micro-batches as the iterator returned them (empty elsewhere)."""
    masks: list[torch.Tensor] = field(default_factory=list)
    """Their loss masks as float tensors."""
    segments: list[Segments] = field(default_factory=list)
    """Per micro-batch, each token's packed-sequence index and the count (None: not packed)."""
    problem: LocalProblem | None = None
    """Why this rank refuses the step (every rank hears of it in the agreement), or None."""

    def __post_init__(self) -> None:
        if self.mtp_layers < 0:
            raise ValueError(f"mtp_layers must be >= 0, got {self.mtp_layers}")

    @property
    def mtp_masks(self) -> list[list[torch.Tensor]]:
        """Each MTP layer's shifted masks (layer j reads the mask j positions on)."""
        if not self.masks:
            return []
        return [shifted_masks(self.masks, j) for j in range(1, self.mtp_layers + 1)]


def prepare_step(
    config: LossFixConfig,
    chunk: Any,
    groups: StepGroups,
    iterators: list,
    num_microbatches: int,
) -> PreparedStep:
    """Read the model's settings and, on the loss stage, the step's micro-batches (from the
    loss chunk's iterator, the last of ``iterators``).

    Nothing raises here but ``StepRefused`` for a setting every rank shares: any other problem
    is returned in ``problem``, for the agreement to tell every rank."""
    prepared = PreparedStep()
    try:
        from megatron.core.utils import get_model_config

        # A plain ModelParallelConfig has no such field: Megatron's default behaviour.
        prepared.model_config = get_model_config(chunk)
        cfg_of_model = prepared.model_config
        prepared.per_token = bool(getattr(cfg_of_model, "calculate_per_token_loss", False))
        prepared.mtp_layers = int(getattr(cfg_of_model, "mtp_num_layers", None) or 0)
        refuse_sharded_mtp(prepared.mtp_layers, config)
        if groups.is_last_stage:
            batches, masks, segments = read_step(config, iterators[-1], num_microbatches)
            prepared.batches, prepared.masks, prepared.segments = batches, masks, segments
            if prepared.mtp_layers and any(seg is not None for seg, _ in segments):
                raise LocalProblem(
                    MTP_PROBLEM,
                    "packed micro-batches (cu_seqlens) with multi-token prediction: the "
                    "plugin normalizes MTP layers over whole rows only",
                )
    except StepRefused:
        raise
    except LocalProblem as exc:
        prepared.problem = exc
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
        problem = LocalProblem(OTHER, f"preparing the step raised {type(exc).__name__}: {exc}")
        problem.__cause__ = exc
        prepared.problem = problem
    return prepared


def _read_batches(source: Any, num_microbatches: int) -> list:
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
    return batches


def read_step(
    config: LossFixConfig, source: Any, num_microbatches: int
) -> tuple[list, list[torch.Tensor], list[Segments]]:
    """The loss stage's micro-batches, their float masks and packed-sequence segments.

    Raises ``LocalProblem`` naming what is wrong; the caller shares it with every rank."""
    batches = _read_batches(source, num_microbatches)
    raw_masks = []
    for k, batch in enumerate(batches):
        try:
            raw_masks.append(_mask_of(config, batch, k))
        except ValueError as exc:
            raise LocalProblem(NOT_DICT, str(exc)) from None
    try:
        masks = float_masks(raw_masks)
        segments = [segments_of(config, b, masks[k], k) for k, b in enumerate(batches)]
    except ValueError as exc:
        raise LocalProblem(MALFORMED, str(exc)) from None
    return batches, masks, segments


def _mask_of(config: LossFixConfig, batch: Any, k: int) -> torch.Tensor:
    key = config.loss_mask_key
    if not isinstance(batch, Mapping) or key not in batch:
        raise ValueError(
            f"micro-batch {k} must be a dict holding the loss mask under {key!r} "
            f"(LossFixConfig.loss_mask_key); got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
        )
    return batch[key]


def segments_of(config: LossFixConfig, batch: Mapping, mask: torch.Tensor, k: int) -> Segments:
    """Packed (THD) micro-batch: each token's sequence index from ``cu_seqlens``, and the
    number of segments; ``(None, None)`` for a batch of whole rows."""
    key = config.cu_seqlens_key
    cu_seqlens = batch.get(key)
    if cu_seqlens is None:
        return None, None
    if config.data_is_cp_sharded:
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
            f"micro-batch {k}: {key!r} must be a 1-D tensor of cumulative sequence lengths "
            "starting at 0"
        )
    if mask.shape[0] != 1:
        raise ValueError(
            f"micro-batch {k} is packed ({key!r} given) but its mask is {tuple(mask.shape)}; "
            "packed micro-batches are [1, total_tokens]"
        )
    return segment_ids(cu_seqlens.to(device=mask.device), mask.shape[1])


def check_finite_inputs(batch: Mapping, k: int) -> None:
    """Raise ``FloatingPointError`` naming the first floating tensor holding NaN or Inf."""
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


def step_weights(
    config: LossFixConfig,
    prepared: PreparedStep,
    counts: StepCounts,
    passthrough: bool,
) -> StepIterator:
    """The pre-read micro-batches, each handed out with its weights under
    ``config.weights_key``."""
    masks = prepared.masks
    if passthrough:
        weights = masks  # Megatron's deferred division by N is the exact token mean
    else:
        weights = weights_from_counts(
            masks,
            counts,
            config.reduction,
            norm_constant=config.norm_constant,
            segment_ids=[seg for seg, _ in prepared.segments],
        )

    def attach(batch: Mapping, k: int) -> dict:
        if config.check_finite:
            check_finite_inputs(batch, k)
        return {**batch, config.weights_key: weights[k]}

    return StepIterator(prepared.batches, attach)


@dataclass(kw_only=True, slots=True)
class MTPLayout:
    """What scales a step's MTP weights: the step's sizes and its path through Megatron."""

    per_token: bool
    """``calculate_per_token_loss``: Megatron divides every gradient by the global count."""
    num_tokens: torch.Tensor
    """The step's global loss-token count N (the per-token path's divisor)."""
    num_microbatches: int
    """This rank's micro-batch count M."""
    groups: StepGroups
    """The step's process groups (D and cp, and the CP group to slice by)."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")

    def factor(self) -> torch.Tensor | float:
        """What undoes Megatron's averaging of the MTP loss."""
        return undo_mtp_averaging(
            self.per_token, self.num_tokens, self.num_microbatches, self.groups
        )


def mtp_step(
    config: LossFixConfig,
    mtp_masks: list[list[torch.Tensor]],
    mtp_counts: list[StepCounts],
    layout: MTPLayout,
    model_config: Any,
    step_iter: StepIterator,
) -> MTPStep:
    """Each MTP layer's weights: the mode over the layer's shifted masks with their global
    counts, times what undoes Megatron's averaging of the MTP loss, sliced for CP."""
    install_hooks()
    factor = layout.factor()
    groups = layout.groups
    weights = []
    for masks, counts in zip(mtp_masks, mtp_counts, strict=True):
        layer = weights_from_counts(
            masks, counts, config.reduction, norm_constant=config.norm_constant
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
