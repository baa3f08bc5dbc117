"""Losses with Tinker semantics: plain weighted sums of per-token losses, and their weights.

Megatron's pipeline schedule calls ``loss_func(output_tensor)``; bind the micro-batch's weights
first: ``partial(weighted_loss, batch.get("loss_weights", batch["loss_mask"]))`` (under ``off``
no weights come in, and the mask is stock's weight). The weights already hold the step's
normalization, so every function here returns ``sum(w * l)``, never a mean. A loop that does
not use ``LossFixSchedule`` builds the weights itself with :func:`loss_weights`. A loss that
decides after the forward pass which tokens count says so with ``keep=`` (docs/design.md §10).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.mask_in_loss import kept_weights
from megatron_lossfix.runtime.mode_record import Ids
from megatron_lossfix.runtime.modes import mode_of, modes_reading
from megatron_lossfix.runtime.process_groups import group_size, same_on_every_rank
from megatron_lossfix.runtime.prompt_groups import (
    GroupIds,
    bad_id_message,
    bad_id_values,
    ids_for_mode,
    missing_ids_message,
    parse_group_ids,
)
from megatron_lossfix.runtime.weights import (
    REDUCTIONS,
    bad_mask_message,
    bad_mask_values,
    canonical_mode,
    check_mode,
    count_tokens,
    float_masks,
    weights_from_counts,
)

__all__ = ["loss_weights", "weighted_loss", "weighted_sum"]


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(weights * per_token)`` in fp32, where zero-weight tokens add exactly 0.

    Padding positions may hold garbage (NaN, Inf) in ``per_token``; ``where`` keeps it out of
    the value and the gradient, so a zero-token micro-batch contributes 0, never NaN.
    """
    if per_token.shape != weights.shape:
        raise ValueError(
            f"per-token loss has shape {tuple(per_token.shape)} but the weights have "
            f"{tuple(weights.shape)}; both must be [batch, seq] of the same micro-batch"
        )
    product = per_token.float() * weights
    return torch.where(weights != 0, product, torch.zeros_like(product)).sum()


def weighted_loss(
    weights: torch.Tensor,
    output_tensor: torch.Tensor,
    *,
    keep: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron ``loss_func`` for a per-token loss tensor (what ``GPTModel`` returns when given
    ``labels``: vocab-parallel cross entropy, ``[batch, seq]``, TP-correct).

    ``keep``: the tokens the loss keeps, a ``[batch, seq]`` mask or a function of the detached
    per-token loss that returns one (e.g. ``lambda l: l < 8``, decided after the forward pass);
    dropped tokens are zeroed, or leave the normalization under
    ``LossFixConfig(mask_in_loss=True)`` ([`kept_weights`][megatron_lossfix.kept_weights]).

    Returns Megatron's 3-tuple ``(sum(w * l), num_tokens, report)``; ``num_tokens`` counts the
    loss tokens of this micro-batch on this rank (after any context-parallel slicing).
    """
    if callable(keep):
        keep = keep(output_tensor.detach())
    loss = weighted_sum(output_tensor, kept_weights(weights, keep))
    num_tokens = (weights != 0).sum(dtype=torch.int)
    return loss, num_tokens, {}


def loss_weights(
    loss_masks: Sequence[torch.Tensor],
    reduction: str,
    *,
    norm_constant: float | None = None,
    dp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
    group_ids: Sequence[torch.Tensor] | None = None,
    num_groups: int | None = None,
    trajectory_ids: Sequence[torch.Tensor] | None = None,
    num_trajectories: int | None = None,
    pair_ids: Sequence[torch.Tensor] | None = None,
    rank_local: bool = False,
) -> list[torch.Tensor]:
    """Per-token weights ``w`` for this rank's micro-batches: ``sum(w * loss)`` over the whole
    mini-batch is the step's loss under ``reduction`` (one of
    [`REDUCTIONS`][megatron_lossfix.REDUCTIONS], or the alias ``prompt_mean``).

    ``loss_masks``: this rank's ``[batch, seq]`` masks (bool or 0/1), CP shards with
    ``cp_group``; ``dp_group``: data-parallel group without CP (Megatron's
    ``parallel_state.get_data_parallel_group()``). Returns float32 tensors of the masks' shapes;
    with both groups None nothing is communicated and the masks are the whole mini-batch.
    ``rank_local=True``: this rank's masks are its own mini-batch, whatever the world size;
    without it, both groups None while ``torch.distributed`` runs more than one rank is refused
    (the weights would silently be this rank's, not the step's). ``group_mean`` needs
    ``group_ids`` (per micro-batch, one integer id per row, global over the step, in ``[0,
    num_groups)``); the sequence modes take ``trajectory_ids`` and ``num_trajectories`` alike, to
    count a trajectory split into several rows once. ``pair_mean`` needs ``pair_ids`` (per
    micro-batch, one integer per row in ``[0, its rows)``; the rows sharing one are a pair).
    Raises ``ValueError`` for an unknown mode,
    a missing or bad ``norm_constant``, a malformed mask, missing or bad ids (on every rank of
    the groups when the ids are refused), ids a mode would ignore, or that refusal.
    """
    check_mode(reduction, norm_constant, REDUCTIONS)
    reduction = canonical_mode(reduction)
    no_group = dp_group is None and cp_group is None
    if no_group and not rank_local and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"loss_weights without dp_group on {dist.get_world_size()} ranks would weigh this "
            "rank's masks alone: pass dp_group=parallel_state.get_data_parallel_group() (and "
            "cp_group for context-parallel shards), or rank_local=True for rank-local weights"
        )
    masks = float_masks(loss_masks)
    bad = bad_mask_values(masks)
    if bool(bad.any()):
        raise ValueError(bad_mask_message(int(bad.nonzero()[0, 0])))
    given = {
        "group": (group_ids, num_groups, "group_ids", "num_groups"),
        "trajectory": (trajectory_ids, num_trajectories, "trajectory_ids", "num_trajectories"),
        "pair": (pair_ids, None, "pair_ids", None),
    }
    groups = _group_ids(reduction, masks, given)
    if groups is not None:
        _agree_on_ids(groups, dp_group, cp_group)
    # Counts over the whole step where the mode reads any; else each rank's own masks.
    counts = count_tokens(
        masks,
        global_counts=bool(mode_of(reduction).global_counts),
        dp_group=dp_group,
        cp_group=cp_group,
        groups=groups,
    )
    return weights_from_counts(masks, counts, reduction, norm_constant=norm_constant)


def _group_ids(
    reduction: str, masks: list[torch.Tensor], given: dict[str, tuple]
) -> GroupIds | None:
    """The ids ``reduction`` weights by, checked (no device sync); ids it would ignore refused.
    ``given``: per kind of ids, ``(ids, range, name, range's name or None)``."""
    wanted = ids_for_mode(reduction)
    for kind, (ids, count, name, count_name) in given.items():
        if kind != wanted and (ids is not None or count is not None):
            users = ", ".join(modes_reading(Ids(kind)))
            said = name if count_name is None else f"{name}/{count_name}"
            raise ValueError(
                f"{said} apply only to {users}, not {reduction}; drop them or change the reduction"
            )
    if wanted is None:
        return None
    ids, count, name, count_name = given[wanted]
    rows = [m.shape[0] for m in masks]
    missing = missing_ids_message(name, count_name)
    return parse_group_ids(wanted, ids, count, masks, rows, (name, str(count_name)), missing)


def _agree_on_ids(
    groups: GroupIds, dp_group: dist.ProcessGroup | None, cp_group: dist.ProcessGroup | None
) -> None:
    """Refuse bad ids on every rank of the groups: one small all-reduce over each group of
    ``[1, count, count**2, bad]`` (the ranges agree exactly when ``sum(c)**2 == n * sum(c**2)``)
    before the counts' all-reduces, whose size is the range."""
    bad = bad_id_values(groups)
    count = 0.0 if groups.ranges is not None else float(groups.count)  # pair ids: no range
    vec = torch.stack(
        [
            torch.ones((), dtype=torch.float64),
            torch.tensor(count, dtype=torch.float64),
            torch.tensor(count**2, dtype=torch.float64),
        ]
    ).to(bad.device)
    vec = torch.cat([vec, bad.any().double()[None]])
    for group in (cp_group, dp_group):
        if group_size(group) > 1:
            dist.all_reduce(vec, group=group)
    n, total, squares, flagged = vec.tolist()
    if bool(bad.any()):
        raise ValueError(bad_id_message(groups, int(bad.nonzero()[0, 0])))
    if flagged > 0:
        raise ValueError(f"{groups.name} refused on another rank (see its error); every rank stops")
    if not same_on_every_rank(total, squares, n):
        raise ValueError(
            f"the ranks disagree on the id range of {groups.name} (this rank: {groups.count}); "
            "give every rank the same range"
        )
