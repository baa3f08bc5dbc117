"""The self-check's verdict (docs/design.md §9, steps 4 and 5): whether the DP x CP replicas
hold the same gradient (:func:`replica_spread`, :func:`replicas_differ`), how far the re-split
runs' gradient lies from the normal run's (:func:`resplit_error`), and the line that says so:
:class:`SelfCheckError` over the tolerance, else one line that the check passed
(:func:`report`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.process_groups import (
    ModelParallelGroups,
    StepGroups,
    group_size,
    max_over,
)
from megatron_lossfix.step.selfcheck.gradient_sketch import (
    HOW_MEASURED,
    Sketch,
    combined,
    gradient,
    relative_error,
)
from megatron_lossfix.step.selfcheck.model import CheckedModel
from megatron_lossfix.step.selfcheck.plan import how_resplit
from megatron_lossfix.step.selfcheck.runs import Resplit

__all__ = ["SelfCheckError", "replica_spread", "replicas_differ", "report", "resplit_error"]


class SelfCheckError(RuntimeError):
    """The gradient moved under a re-split of the step, or differs across DP x CP replicas."""


def replica_spread(
    model: CheckedModel, sketch: Sketch, groups: StepGroups, shards: ModelParallelGroups
) -> tuple[float, bool, int]:
    """The relative spread of the dense gradients over DP x CP, the largest over every rank of
    the model (the same on every rank); whether it was measured here, and the index of the
    parameter whose spread is largest here (-1: none)."""
    spread, worst = _spread(model.params, sketch, groups)
    largest = float(max_over([spread], model.device, shards.mp, groups.dp_cp)[0])
    return largest, spread == largest, worst


def replicas_differ(
    spread: float,
    tolerance: float,
    mine: bool,
    worst: int,
    model: CheckedModel,
    groups: StepGroups,
) -> SelfCheckError:
    """The failure of step 4; ``mine``: the largest spread was measured here, at parameter
    ``worst``, which the message names."""
    where = "between the replicas of another model-parallel rank"
    if worst >= 0 and mine:
        names = {id(p): n for c in model.chunks for n, p in c.named_parameters()}
        where = f"most in {names.get(id(model.params[worst]), 'a parameter')!r}"
    return SelfCheckError(
        f"megatron_lossfix self-check failed: after the first step the gradient differs "
        f"across the {group_size(groups.dp_cp)} data x context-parallel ranks by "
        f"{spread:.3g} (relative; tolerance {tolerance:g}), {where}; those "
        "ranks must hold the same reduced gradient. The gradients were not reduced "
        "across data-parallel ranks, or were rescaled on some ranks: set "
        "config.finalize_model_grads_func = finalize_model_grads "
        "(megatron.core.distributed), keep the model in DistributedDataParallel, and do "
        "not reduce or rescale gradients elsewhere."
    )


def resplit_error(
    resplit: Resplit,
    sketch: Sketch,
    model: CheckedModel,
    groups: StepGroups,
    shards: ModelParallelGroups,
) -> float:
    """The relative L2 distance of the re-split runs' gradient (the halves' sum) from the
    reference's: ``resplit.reference``, else the normal run's (``sketch``)."""
    reference = sketch if resplit.reference is None else resplit.reference
    resplit_sketch = resplit.sketches[0]
    if len(resplit.sketches) == 2:
        factors = _divisor_factors(resplit.tokens, model.per_token, groups, shards, model.device)
        resplit_sketch = combined(list(zip(resplit.sketches, factors, strict=True)), reference)
    return relative_error(reference, resplit_sketch, shards, model.device)


def report(
    error: float, tolerance: float, reduction: str | None, m: int, plan: tuple | None
) -> None:
    """Raise ``SelfCheckError`` when the re-split moved the gradient, else one line."""
    how = how_resplit(m, plan)
    if not error <= tolerance:
        raise SelfCheckError(
            f"megatron_lossfix self-check failed: re-running the first step's data {how} "
            f"changed the gradient by {error:.3g} (relative L2, {HOW_MEASURED}; tolerance "
            f"{tolerance:g})"
            f" under reduction {reduction!r}. The loss depends on how the step is split, "
            "so it is not the mode's global "
            "normalization. Probably: (1) double scaling: loss_func divides the weighted sum "
            "by its own token count (its loss mask's sum), its number of sequences or the "
            "number of micro-batches (a per-micro-batch mean, or calculate_per_token_loss "
            "plus a manual division), but the plugin's "
            "weights already normalize: return (sum(weights * loss), num_tokens, report) as "
            "megatron_lossfix.weighted_loss does; (2) the loss ignores the plugin's weights "
            "(batch['loss_weights']) and uses the raw loss mask; (3) the model mixes samples "
            "(batch statistics, token dropping). With bf16/fp16 compute rounding alone moves "
            "the gradient by about 1e-3: raise --lossfix-self-check-tolerance. The "
            "gradient in place is the normal run's."
        )
    # Every rank measured the same error (it is all-reduced): one line for the whole run.
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"megatron_lossfix self-check passed: re-running the first step's data {how} "
            f"changed the gradient by {error:.2g} (relative L2, {HOW_MEASURED}; tolerance "
            f"{tolerance:g})",
            flush=True,
        )


def _spread(params: list, sketch: Sketch, groups: StepGroups) -> tuple:
    """Relative spread of dense gradients over DP x CP, and the index of the worst (-1: none)."""
    dense = [
        i for i, p in enumerate(params) if gradient(p) is not None and getattr(p, "allreduce", True)
    ]
    if group_size(groups.dp_cp) <= 1 or not dense:
        return 0.0, -1
    sums = sketch.sums[dense]
    both = max_over(torch.cat([sums, -sums], dim=1), sums.device, groups.dp_cp)  # max gives min too
    numel = sketch.numel[dense]
    square = both[:, 1].clamp(min=1e-300)
    sum_spread = (both[:, 0] + both[:, 2]) / (numel.sqrt() * square.sqrt())
    spread = torch.maximum(sum_spread, (both[:, 1] + both[:, 3]) / square)
    worst = int(spread.argmax())
    return float(spread[worst]), dense[worst]


def _divisor_factors(
    tokens: torch.Tensor,
    per_token: bool,
    groups: StepGroups,
    shards: ModelParallelGroups,
    device: torch.device,
) -> list[float]:
    """What each run over half of the loss tokens is multiplied by to be its part of the normal
    run's gradient: 1, except on Megatron's per-token path, which divided each run's gradient by
    its own token count (``tokens[0]``, summed over DP x CP) instead of the normal run's, after
    the step multiplied each loss by its run's factor (``tokens[1]``)."""
    if not per_token:
        return [1.0, 1.0]
    total = tokens[0].clone()
    if group_size(groups.dp_cp) > 1:
        dist.all_reduce(total, group=groups.dp_cp)
    total = max_over(torch.stack([total, tokens[1]]), device, shards.mp)  # the loss stage's
    per_factor = (total[0] / total[1].clamp(min=1e-300)).tolist()  # on every stage
    halves, normal = per_factor[:2], per_factor[2]
    return [half / normal if normal > 0 else 1.0 for half in halves]
