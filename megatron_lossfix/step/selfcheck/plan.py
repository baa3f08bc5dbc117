"""Which re-split the self-check runs, or why none (docs/design.md §9, step 2).

A step whose gradient depends on the split by design is not checked
(:func:`why_not_checkable`). Else every rank of the model agrees, in one all-reduce, on a
re-split of the rows that every pipeline stage can run (:func:`resplit_plan`), on the halves of
each micro-batch's loss tokens where no row can move without growing a micro-batch, or on why
neither runs (:func:`choose_plan`); :func:`how_resplit` says the plan in words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.process_groups import (
    ModelParallelGroups,
    StepGroups,
    group_size,
    max_over,
)
from megatron_lossfix.step.driver import Step
from megatron_lossfix.step.megatron_compat import gradient_side_paths
from megatron_lossfix.step.selfcheck.microbatch_resplit import resplit, resplit_plan
from megatron_lossfix.step.selfcheck.model import CheckedModel

__all__ = ["Choice", "choose_plan", "how_resplit", "plugin_step", "why_not_checkable"]


class Choice(NamedTuple):
    """What the check runs, the same on every rank: the re-split ``plan`` (``(kind, factor,
    num_microbatches, micro_batch_size)``; ``halves`` adds the range of micro-batches whose
    loss tokens it halves) over ``items`` (each data iterator's micro-batches
    as the plan reads them); or no plan, ``skipped`` saying why, and whether the DP x CP
    ``replicas`` are compared all the same."""

    plan: tuple | None
    items: list
    skipped: str | None = None
    replicas: bool = False


def why_not_checkable(reduction: str | None, config: Any, chunks: list = ()) -> str | None:
    """Why the step cannot be checked (the same on every rank), or None: its gradient depends
    on the split by design, or the model holds no parameters to compare."""
    if reduction is not None and mode_of(reduction).split_dependent:
        return (
            f"reduction {reduction!r} depends on the micro-batch split by definition "
            "(Megatron's mean of per-micro-batch means)"
        )
    if not all(isinstance(chunk, torch.nn.Module) for chunk in chunks):
        return "the model is not a torch.nn.Module: no gradient to compare"
    moe = getattr(config, "num_moe_experts", None)
    aux, z = ((getattr(config, f"moe_{k}_loss_coeff", 0) or 0) > 0 for k in ("aux", "z"))
    capacity = getattr(config, "moe_expert_capacity_factor", None) is not None
    names = ("MoE load-balancing loss", "MoE z-loss", "MoE expert capacity (token dropping)")
    features = [name for name, on in zip(names, (aux, z, capacity), strict=True) if moe and on]
    if features:
        return (
            f"the model uses {', '.join(features)}, whose gradient depends on the batch "
            "composition by design (they are nonlinear in it; Megatron keeps them per "
            "micro-batch)"
        )
    return None


def choose_plan(
    config: LossFixConfig,
    explicit: bool,
    step: Any,
    call: dict,
    model: CheckedModel,
    reads: list,
    groups: StepGroups,
    shards: ModelParallelGroups,
) -> Choice:
    """The re-split of ``reads`` that every rank runs, or why none: every rank learns whether
    any rank cannot re-split, or holds gradients from before the step (``model.held``), in one
    all-reduce over every rank of the model. Where no rank can move a row without growing a
    micro-batch, the halves of the loss tokens are run instead; where they cannot check the
    step either, the check asked for (``explicit``) raises ``ValueError`` on every rank."""
    m = call["num_microbatches"]
    plan = _agreed_plan(config.reduction, call, model, reads, groups, shards)
    items, problem = _resplit_reads(reads, plan, m, config.loss_mask_key)
    flags = [problem is not None, plan is not None and problem is None, model.held]
    failed, changed, held_any = max_over(flags, model.device, shards.mp, groups.dp_cp).tolist()
    if held_any:
        held_why = "the gradients were not zero before the step (accumulated over calls)"
        return Choice(None, reads, held_why)
    if not failed and changed:
        return Choice(plan, items)
    # Rows cannot move without growing a micro-batch: halves of the loss tokens.
    why_not = _why_no_halves(config, model.config, plugin_step(step))  # the same everywhere
    if not why_not:
        window = _halves_window(config, call, model, reads, shards, _group(call, model, groups))
        return Choice(("halves", 2, m, None, window), reads)
    problem = problem or "no rank can move a row without growing a micro-batch"
    if explicit:  # every rank: the flags are all-reduced
        drop = "this data cannot be checked: drop --lossfix-self-check"
        raise ValueError(f"megatron_lossfix self-check: {problem}; {why_not}; {drop}")
    only = f"{problem}, and {why_not}; only the replicas were compared"
    return Choice(None, reads, only, replicas=True)


def _agreed_plan(
    reduction: str | None,
    call: dict,
    model: CheckedModel,
    reads: list,
    groups: StepGroups,
    shards: ModelParallelGroups,
) -> tuple | None:
    """The re-split every stage of the pipeline agrees on (:func:`resplit_plan`); none where
    the mode's units (pairs) must stay whole in their micro-batch (the halves cut by unit)."""
    # TP ranks that read data beside ranks that do not: forward_step broadcasts the batch
    # into buffers of the configured shape (get_batch_on_this_tp_rank): shuffle rows only.
    tp_reads = max_over([float(any(reads)), float(not any(reads))], model.device, shards.tp)
    mixed = max_over([float(tp_reads.min() > 0)], model.device, shards.mp, groups.dp_cp)
    m, pp = call["num_microbatches"], group_size(groups.pp)
    group = _group(call, model, groups)
    if reduction is not None and mode_of(reduction).ids.whole_units:
        return None
    return resplit_plan(m, call.get("micro_batch_size"), pp, group, bool(mixed[0] > 0))


def _group(call: dict, model: CheckedModel, groups: StepGroups) -> int | None:
    """The micro-batch group an interleaved schedule's count must fit, or None."""
    pp = group_size(groups.pp)
    group = getattr(model.config, "microbatch_group_size_per_vp_stage", None) or pp
    return group if len(model.chunks) > 1 else None


def _halves_window(
    config: LossFixConfig,
    call: dict,
    model: CheckedModel,
    reads: list,
    shards: ModelParallelGroups,
    group: int | None,
) -> range:
    """The micro-batches the halves cut: as few as the schedule runs on their own (1; an
    interleaved schedule's group), those of them holding the most loss tokens on the loss
    stage, the same on every stage of the model (one all-reduce). The second run goes over
    these only, so the check costs two runs of the step and these, not three runs."""
    m = call["num_microbatches"]
    width = min(m, group or 1)
    got = (reads[-1] if reads else None) or []  # the loss stage's last iterator's reads
    masks = [b.get(config.loss_mask_key) if isinstance(b, Mapping) else None for b in got]
    none = torch.zeros((), device=model.device)
    counts = [
        (mask != 0).sum().to(none) if isinstance(mask, torch.Tensor) else none for mask in masks
    ]
    best = -1.0  # a stage that reads no mask has no say
    if len(counts) == m:
        counts = torch.stack(counts).tolist()  # the first step's check only: one host copy
        sums = [sum(counts[i : i + width]) for i in range(m - width + 1)]
        best = float(max(range(len(sums)), key=sums.__getitem__))
    start = int(max_over([best], model.device, shards.mp)[0])
    return range(max(start, 0), max(start, 0) + width)


def _resplit_reads(
    reads: list, plan: tuple | None, m: int, mask_key: str
) -> tuple[list, str | None]:
    """Each iterator's reads re-split by ``plan``, or why this rank cannot."""
    items = []
    for c, got in enumerate(reads):
        try:
            if got and plan and len(got) != m:
                raise ValueError(f"forward_step read {len(got)} micro-batches, not {m}")
            items.append(resplit(got, plan, mask_key=mask_key) if got and plan else got)
        except (ValueError, RuntimeError) as exc:  # RuntimeError: torch.cat of odd shapes
            return items, f"cannot re-split data iterator {c}: {exc}"
    return items, None


def plugin_step(step: Any) -> Step | None:
    """The plugin's :class:`Step` that ``step`` is or wraps (through ``inner``), or None."""
    for _ in range(8):
        if isinstance(step, Step) or step is None:
            return step
        step = getattr(step, "inner", None)
    return None


def _why_no_halves(config: LossFixConfig, model_config: Any, step: Step | None) -> str | None:
    """Why the runs over halves of the loss tokens cannot check this step (the same on every
    rank), or None: only the loss function's weights are halved, so a gradient term outside
    it, or a loss that decides its own masks (whose kept counts the step normalizes by),
    would count twice."""
    if step is None:
        return "the step is not the plugin's Step, whose weights the halves set"
    if config.mask_in_loss:
        return "the loss decides its masks (mask_in_loss), whose counts halves would change"
    paths = gradient_side_paths(model_config)
    if paths:
        return f"the model adds {', '.join(paths)} outside the loss, which halves would count twice"
    return None


def how_resplit(m: int, plan: tuple | None) -> str:
    """How the re-run split the step, for the pass and failure messages."""
    if plan is None:
        return f"in the same {m} micro-batches here (other ranks re-split)"
    if plan[0] == "shuffle":
        return f"in {plan[2]} micro-batches with their rows dealt differently"
    if plan[0] == "halves":  # the window's size: the same on every rank, unlike its place
        part = "1 micro-batch" if len(plan[4]) == 1 else f"{len(plan[4])} micro-batches"
        return (
            f"as two runs over halves of the loss tokens of {part} of its {plan[2]} (no row "
            "can move without growing a micro-batch), the first with the others whole"
        )
    return f"as {plan[2]} micro-batches instead of {m} (each micro-batch cut in {plan[1]})"
