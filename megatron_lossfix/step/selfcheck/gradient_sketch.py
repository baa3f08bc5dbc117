"""One run's gradient in a few numbers, and the relative distance of two runs' (docs/design.md §9).

The self-check compares the gradients of two runs of one step without holding a copy of
either: each is read once, block by block, into a :class:`Sketch` (per parameter its sum and
squared norm, and a few seeded random projections accumulated in fp64), and
:func:`relative_error` compares two sketches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.process_groups import ModelParallelGroups, group_size

__all__ = [
    "BLOCK",
    "HOW_MEASURED",
    "PROJECTIONS",
    "Sketch",
    "block_elements",
    "combined",
    "gradient",
    "relative_error",
    "sketch_gradients",
]

#: Seeded Gaussian projections of each run's gradient that the check compares (docs/design.md §9).
PROJECTIONS = 16
WIDTH = 256  # a gradient is read as rows of this many elements, each row projected at once
ROWS = 256  # rows per block on a CPU: the check's temporaries are a few blocks (512 KiB in fp64)
SEED = 45
HOW_MEASURED = f"estimated from {PROJECTIONS} random projections"
BLOCK = ROWS * WIDTH  # elements read at once on a CPU
#: Elements read at once on an accelerator: a few kernels per block, so blocks are large there
#: (4 Mi elements: 32 MiB of fp64 temporaries); a CPU gains nothing from larger ones.
DEVICE_BLOCK = 16 * 1024 * WIDTH


def block_elements(device: torch.device | str) -> int:
    """How many gradient elements the sketch reads at once on ``device`` (a multiple of
    ``WIDTH``): ``BLOCK`` on a CPU, ``DEVICE_BLOCK`` elsewhere. The sketch does not depend on
    it (up to fp64 rounding; on a CPU, whose random stream is the same cut anywhere)."""
    return BLOCK if torch.device(device).type == "cpu" else DEVICE_BLOCK


@dataclass(slots=True)
class Sketch:
    """One run's gradient in a few numbers (fp64): per parameter its sum and squared L2 norm,
    and per kind (dense, expert) ``PROJECTIONS`` seeded Gaussian projections of the elements
    the relative error counts, a (PROJECTIONS x WIDTH) matrix. No copy of the gradient."""

    sums: torch.Tensor  # (parameters, 2): sum, sum of squares (0, 0: no gradient)
    numel: torch.Tensor  # (parameters,)
    counted: torch.Tensor  # (parameters, 2): 1 in the column of its kind; zeros: not counted
    projections: torch.Tensor  # (2, PROJECTIONS, WIDTH)


def sketch_gradients(params: list, shards: ModelParallelGroups, block: int | None = None) -> Sketch:
    """The sketch of the gradients now held, block by block (temporaries of one block).

    A gradient of n elements is read as rows of ``WIDTH`` (the last one zero-padded); each
    block of rows (``block`` elements; by default :func:`block_elements` of the gradients'
    device) is multiplied by a (PROJECTIONS x rows) standard normal matrix drawn row by row
    (``PROJECTIONS`` numbers per gradient row, so the draws do not depend on the block size)
    from a generator seeded by the parameter's index and the rank in the group its error is
    summed over (the same on DP x CP replicas, which hold the same gradient; independent across
    the ranks whose projections add up), so that both runs draw the same matrices. The matrix
    is drawn in fp32 (a quarter of the time of fp64 draws) and cast; the product and its sums
    are fp64."""
    device = params[0].device if params else torch.device("cpu")
    block = block_elements(device) if block is None else block
    if block < WIDTH or block % WIDTH:
        raise ValueError(f"the sketch's block must be a positive multiple of {WIDTH}, got {block}")
    on = {"device": device}
    sums = torch.zeros(len(params), 2, dtype=torch.float64, device=device)
    counted = torch.zeros(len(params), 2, dtype=torch.float64, device=device)
    numel = torch.tensor([p.numel() for p in params], dtype=torch.float64, device=device)
    projections = torch.zeros(2, PROJECTIONS, WIDTH, dtype=torch.float64, device=device)
    ranks = [0 if group_size(g) <= 1 else dist.get_rank(g) for g in (shards.mp, shards.expert_mp)]
    tp_rank = 0 if shards.tp is None else dist.get_rank(shards.tp)  # TP copies: rank 0's count
    for i, param in enumerate(params):
        grad = gradient(param)
        if grad is None:
            continue
        tp_copy = not getattr(param, "tensor_model_parallel", False) and tp_rank != 0
        kind = None if getattr(param, "shared", False) or tp_copy else 0
        if kind is not None and not getattr(param, "allreduce", True):
            kind = 1  # an expert parameter: its error is summed over the expert groups
        generator = None
        if kind is not None:
            counted[i, kind] = 1.0
            generator = torch.Generator(device=grad.device)
            generator.manual_seed(((SEED * 1_000_003 + ranks[kind]) * 1_000_003 + i) % 2**63)
        for part in grad.detach().reshape(-1).split(block):
            x = part.to(torch.float64)
            sums[i, 0] += x.sum()
            sums[i, 1] += torch.dot(x, x)
            if generator is None:
                continue
            rows = -(-x.numel() // WIDTH)
            if x.numel() < rows * WIDTH:  # only a gradient's last block
                x = torch.nn.functional.pad(x, (0, rows * WIDTH - x.numel()))
            x = x.view(rows, WIDTH)
            r = torch.randn(rows, PROJECTIONS, generator=generator, dtype=torch.float32, **on)
            projections[kind].addmm_(r.to(torch.float64).T, x)
    return Sketch(sums, numel, counted, projections)


def combined(parts: list[tuple[Sketch, float]], like: Sketch) -> Sketch:
    """The sketch of ``sum(factor * gradient)`` over ``parts`` (sketch, factor): the sums and
    projections are linear in the gradient; the squared norms, which are not, are ``like``'s
    (so the comparison with ``like`` rests on the sums and the projections)."""
    sums = like.sums.clone()
    sums[:, 0] = sum(factor * sketch.sums[:, 0] for sketch, factor in parts)
    projections = sum(factor * sketch.projections for sketch, factor in parts)
    return Sketch(sums, like.numel, like.counted, projections)


def gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient the step made: Megatron DDP's ``main_grad``, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def relative_error(
    reference: Sketch, other: Sketch, groups: ModelParallelGroups, device: Any
) -> float:
    """The relative L2 distance of ``other``'s gradient from ``reference``'s, each element once
    (as Megatron's grad norm): the larger of the projections' estimate and the lower bound that
    the per-parameter norms and sums give (docs/design.md §9)."""
    norms = (reference.sums[:, 1].clamp(min=0).sqrt(), other.sums[:, 1].clamp(min=0).sqrt())
    sums = reference.sums[:, 0] - other.sums[:, 0]
    bound = torch.maximum((norms[0] - norms[1]).square(), sums.square() / reference.numel.clamp(1))
    estimate, lower, ref = 0.0, 0.0, 0.0
    for kind, group in enumerate((groups.mp, groups.expert_mp)):
        counted = reference.counted[:, kind]
        totals = torch.stack([(bound * counted).sum(), (reference.sums[:, 1] * counted).sum()])
        diff = (reference.projections[kind] - other.projections[kind]).reshape(-1)
        row = torch.cat([diff, totals])
        if group_size(group) > 1:
            dist.all_reduce(row, group=group)
        estimate += float(row[:-2].square().sum()) / PROJECTIONS
        lower, ref = lower + float(row[-2]), ref + float(row[-1])
    diff = max(estimate, lower)
    return (diff**0.5) / max(ref**0.5, 1e-30) if ref > 0 else float(diff > 0)
