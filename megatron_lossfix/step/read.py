"""The step's first phase, before any collective: the model's settings, the structural guards,
and the loss stage's micro-batches with their masks, packed-sequence segments and group ids.

What goes wrong here is a value, this rank's problem (a :class:`StepRefused` of one
:class:`Problem` kind), which the step's first agreement tells every rank
(:mod:`megatron_lossfix.step.agree`); settings that are the same on every rank and that the
plugin cannot serve are refused at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

import megatron_lossfix.runtime.prompt_groups as prompt_groups
import megatron_lossfix.step.megatron_compat as megatron_compat
import megatron_lossfix.step.wrappers as wrappers
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.process_groups import StepGroups
from megatron_lossfix.runtime.prompt_groups import GroupIds
from megatron_lossfix.runtime.weights import float_masks, segment_ids
from megatron_lossfix.step.agreement import REFUSAL_PREFIX, Problem, StepRefused
from megatron_lossfix.step.record import StepData

__all__ = ["model_settings", "read_step_data", "structure_problem"]


def model_settings(config: LossFixConfig, chunk: Any) -> tuple[Any, Exception | None]:
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


def structure_problem(chunks: list, model_config: Any, groups: StepGroups) -> StepRefused | None:
    """The structural guards (``megatron_compat.unreduced_gradients``, then
    ``wrappers.wrapper_problem``), asked at every step: a few type checks and attribute reads,
    so no verdict is kept that could go stale."""
    kind = Problem.UNREDUCED
    try:
        message = megatron_compat.unreduced_gradients(chunks, model_config, groups)
        if message is None:
            kind, message = Problem.WRAPPER, wrappers.wrapper_problem(chunks)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        message = f"checking the model's DP wrapping raised {type(exc).__name__}: {exc}"
    return None if message is None else kind.refusal(message)


def read_step_data(
    config: LossFixConfig, source: Any, num_microbatches: int, mtp_layers: int
) -> tuple[StepData, StepRefused | None]:
    """The loss stage's micro-batches, float masks and packed-sequence segments, and this
    rank's problem (what went wrong; the data is then empty)."""
    key = config.loss_mask_key
    try:
        batches = _read_batches(source, num_microbatches)
        for k, batch in enumerate(batches):
            if not isinstance(batch, Mapping) or key not in batch:
                keys = f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else ""
                raise Problem.NOT_DICT.refusal(
                    f"micro-batch {k} must be a dict holding the loss mask under {key!r} "
                    f"(LossFixConfig.loss_mask_key); got {type(batch).__name__}{keys}"
                )
        try:
            masks = float_masks([b[key] for b in batches])
            segments = [_segments(config, b, masks[k], k) for k, b in enumerate(batches)]
        except ValueError as exc:
            raise Problem.MALFORMED.refusal(str(exc)) from None
        if mtp_layers and any(ids is not None for ids, _ in segments):
            raise Problem.MTP.refusal(
                "packed micro-batches (cu_seqlens) with multi-token prediction: the "
                "plugin normalizes MTP layers over whole rows only"
            )
        try:
            groups = _group_ids(config, batches, masks, segments)
        except ValueError as exc:
            raise Problem.GROUP_IDS.refusal(str(exc)) from None
        return StepData(batches, masks, segments, groups), None
    except StepRefused as exc:
        return StepData(), exc
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
        message = f"preparing the step raised {type(exc).__name__}: {exc}"
        return StepData(), Problem.OTHER.refusal(message, exc)


def _group_ids(
    config: LossFixConfig, batches: list, masks: list[torch.Tensor], segments: list
) -> GroupIds | None:
    """The ids the mode weights by, from the micro-batches (structure checked, no device sync):
    one per row, or per ``cu_seqlens`` sequence of a packed micro-batch (whose tokens after the
    last boundary then count for no group). None where the mode needs none, or a sequence mode
    finds no trajectory ids; ``ValueError`` for what the ids cannot mean."""
    kind = prompt_groups.ids_for_mode(config.reduction)
    if kind is None:
        return None
    ids_key, count_key = config.ids_keys(kind)
    missing = [k for k, b in enumerate(batches) if ids_key not in b]
    if missing and len(missing) < len(batches):
        raise ValueError(f"micro-batch {missing[0]} has no {ids_key!r}, other micro-batches do")
    ids = counts = None
    if not missing:
        if count_key is not None:
            counts = [prompt_groups.id_count(b.get(count_key), f"{count_key!r}") for b in batches]
        if counts is not None and len(set(counts)) > 1:
            k = counts.index(next(c for c in counts if c != counts[0]))
            raise ValueError(
                f"{count_key!r} is the step's id range, the same in every micro-batch: "
                f"micro-batch 0 has {counts[0]}, micro-batch {k} {counts[k]}"
            )
        ids = [b[ids_key] for b in batches]
    rows = [
        m.shape[0] if num is None else num - 1 for m, (_, num) in zip(masks, segments, strict=True)
    ]
    names = (repr(ids_key), repr(count_key))
    missing_message = prompt_groups.missing_ids_message(ids_key, count_key)
    parsed = prompt_groups.parse_group_ids(
        kind, ids, None if counts is None else counts[0], masks, rows, names, missing_message
    )
    if parsed is None:
        return None
    # A packed row's tokens after its last boundary form one more segment (padding): group 0
    # stands in, and the agreement refuses the step if that segment holds a loss token.
    padded = [
        i if seg is None else torch.cat([i, i.new_zeros(1)])
        for i, (seg, _) in zip(parsed.ids, segments, strict=True)
    ]
    return dataclasses.replace(parsed, ids=padded)


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
    return segment_ids(cu_seqlens.to(device=mask.device), mask.shape[1])
