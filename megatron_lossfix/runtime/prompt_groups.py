"""Group ids: which prompt group (``group_mean``), trajectory (the sequence modes) or pair
(``pair_mean``) each sequence belongs to, checked and counted (pure torch, docs/design.md §2).

A step's sequences may carry an integer id, global over the step, in ``[0, count)``: one per
row of a micro-batch, or per packed sequence (``cu_seqlens``). The counts then hold each
group's loss tokens, summed over every micro-batch and every DP and CP rank
(``reduction.count_tokens``); a group without a loss token neither contributes nor counts.
Pair ids are each micro-batch's own instead (a pair never spans micro-batches): in ``[0, its
sequences)``, with no range to give. Ids are checked in two parts: their structure on the host
(:func:`check_ids`, no device sync) and their range on the device (:func:`bad_id_values`, read
with the step's agreement), before any count indexes with them.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_lossfix.runtime.mode_record import Ids
from megatron_lossfix.runtime.modes import mode_of, modes_reading, quoted_with_aliases

__all__ = [
    "TRAJECTORY_MODES",
    "GroupIds",
    "bad_id_message",
    "bad_id_values",
    "check_ids",
    "group_tokens",
    "id_count",
    "ids_for_mode",
    "missing_group_ids_message",
    "missing_ids_message",
    "missing_pair_ids_message",
    "parse_group_ids",
]

#: The modes that weight by trajectory when sequences carry trajectory ids (a trajectory split
#: into several rows counts once); without them each row (packed sequence) is a sequence.
TRAJECTORY_MODES: tuple[str, ...] = modes_reading(Ids.TRAJECTORIES)


@dataclass(frozen=True, slots=True)
class GroupIds:
    """The group of each sequence of a rank's micro-batches."""

    ids: list[torch.Tensor]
    """Per micro-batch, the group of each sequence (row, or packed sequence), ``[sequences]``."""
    count: int
    """The ids' range: every id is in ``[0, count)``."""
    name: str = "group_ids"
    """What the ids are called where the user gave them (for messages)."""
    ranges: tuple[int, ...] | None = None
    """Ids local to each micro-batch (pairs): micro-batch ``k``'s ids are in ``[0,
    ranges[k])``, its number of sequences; None: global ids, in ``[0, count)``."""


def ids_for_mode(reduction: str) -> str | None:
    """Which ids ``reduction`` weights by: ``"group"`` or ``"pair"`` (needed),
    ``"trajectory"`` (optional) or None (the record's
    :class:`~megatron_lossfix.runtime.mode_record.Ids`); ``ValueError`` for an unknown name."""
    return mode_of(reduction).ids.value


def id_count(count: object, count_name: str) -> int:
    """The ids' range as an int: an integer (or one-element integer tensor) >= 1."""
    if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_floating_point():
        count = int(count)
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise ValueError(f"{count_name} must be an integer >= 1 (the ids' range), got {count!r}")
    return int(count)


def check_ids(ids: object, count: object, rows: Sequence[int], name: str, count_name: str) -> int:
    """Check the ids' structure without a device sync and return the range as an int.

    ``ids``: one integer tensor per micro-batch with ``rows[k]`` entries; ``count``: see
    :func:`id_count`. Raises ``ValueError`` in one line naming ``name``."""
    if isinstance(ids, torch.Tensor) or not isinstance(ids, Sequence):
        raise ValueError(
            f"{name} must be a list with one integer tensor per micro-batch, got "
            f"{type(ids).__name__}"
        )
    if len(ids) != len(rows):
        raise ValueError(f"{name} has {len(ids)} entries for {len(rows)} micro-batches")
    count = id_count(count, count_name)
    for k, (vec, num) in enumerate(zip(ids, rows, strict=True)):
        if not isinstance(vec, torch.Tensor):
            raise ValueError(f"{name} of micro-batch {k} is a {type(vec).__name__}, not a Tensor")
        if vec.is_floating_point() or vec.is_complex() or vec.dtype == torch.bool:
            raise ValueError(
                f"{name} of micro-batch {k} must hold integers (one id per sequence), got "
                f"dtype {vec.dtype}"
            )
        if tuple(vec.shape) != (num,):
            raise ValueError(
                f"{name} of micro-batch {k} must have one id per sequence, shape ({num},), got "
                f"{tuple(vec.shape)}"
            )
    return count


def parse_group_ids(
    kind: str,
    ids: object,
    count: object,
    masks: Sequence[torch.Tensor],
    rows: Sequence[int],
    names: tuple[str, str],
    missing: str,
) -> GroupIds | None:
    """The ids of ``kind`` (``"group"`` or ``"pair"``, needed; ``"trajectory"``, optional) as
    given by the user, their structure checked without a device sync, each moved to its mask's
    device.

    ``ids``: one integer tensor per micro-batch with ``rows[k]`` entries, or None (not given);
    ``count``: their range (see :func:`id_count`; None with absent ids, and for pair ids, which
    are each micro-batch's own: its rows are their range); ``names``: what the ids and their
    range are called where the user gave them; ``missing``: the message for absent needed ids.
    None where trajectory ids are absent; ``ValueError`` in one line."""
    name, count_name = names
    record = Ids(kind)
    if ids is None:
        if record.needed:
            raise ValueError(missing)
        if count is not None:
            raise ValueError(f"{count_name} needs {name}")
        return None
    if not record.step_wide:
        if count is not None:
            raise ValueError(f"{name} are each micro-batch's own: drop {count_name}")
        check_ids(ids, max(rows, default=1) or 1, rows, name, count_name)
        moved = [i.to(device=m.device, dtype=torch.long) for i, m in zip(ids, masks, strict=True)]
        return GroupIds(ids=moved, count=max(rows, default=1) or 1, name=name, ranges=tuple(rows))
    count = check_ids(ids, count, rows, name, count_name)
    moved = [i.to(device=m.device, dtype=torch.long) for i, m in zip(ids, masks, strict=True)]
    return GroupIds(ids=moved, count=count, name=name)


def bad_id_values(groups: GroupIds) -> torch.Tensor:
    """Per micro-batch, on the device: does an id fall outside ``[0, groups.count)`` (pair ids:
    ``[0, groups.ranges[k])``)? A packed micro-batch's id of its tail (after the last boundary,
    appended by the step) is not checked."""
    bad = []
    for k, ids in enumerate(groups.ids):
        top = groups.count if groups.ranges is None else groups.ranges[k]
        own = ids if groups.ranges is None else ids[:top]
        bad.append(((own < 0) | (own >= top)).any())
    return torch.stack(bad)


def bad_id_message(groups: GroupIds, k: int) -> str:
    if groups.ranges is not None:
        return (
            f"{groups.name} of micro-batch {k} must lie in [0, {groups.ranges[k]}) (its number "
            "of sequences: pair ids are each micro-batch's own); found a negative or larger id"
        )
    return (
        f"{groups.name} of micro-batch {k} must lie in [0, {groups.count}) (the step's id "
        "range); found a negative or out-of-range id"
    )


def missing_ids_message(ids_key: str, count_key: str | None) -> str:
    """The refusal for absent needed ids under ``ids_key`` (pair ids, whose ``count_key`` is
    None, or group ids with their range ``count_key``)."""
    if count_key is None:
        return missing_pair_ids_message(ids_key)
    return missing_group_ids_message(ids_key, count_key)


def missing_pair_ids_message(ids_key: str = "pair_ids") -> str:
    modes = quoted_with_aliases(modes_reading(Ids.PAIRS))
    return (
        f"reduction {modes} needs each sequence's pair: put {ids_key!r} (one integer per "
        "sequence, in [0, the micro-batch's sequences); a pair's sequences share one) into "
        "every micro-batch (loss_weights: pair_ids=)"
    )


def missing_group_ids_message(ids_key: str = "group_ids", count_key: str = "num_groups") -> str:
    modes = quoted_with_aliases(modes_reading(Ids.PROMPT_GROUPS))
    return (
        f"reduction {modes} needs each sequence's group id: put {ids_key!r} "
        f"(one integer per sequence) and the id range {count_key!r} into every micro-batch "
        "(loss_weights: group_ids= and num_groups=)"
    )


def group_tokens(seq_tokens: Sequence[torch.Tensor], groups: GroupIds) -> torch.Tensor:
    """The loss tokens of each group, ``[groups.count]`` float64, from the per-sequence counts
    ``seq_tokens`` (one vector per micro-batch, aligned with ``groups.ids``)."""
    flat = torch.cat(list(seq_tokens))
    ids = torch.cat([i.to(device=flat.device, dtype=torch.long) for i in groups.ids])
    out = torch.zeros(groups.count, dtype=flat.dtype, device=flat.device)
    return out.index_add_(0, ids, flat)
