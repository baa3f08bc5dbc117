"""The process groups a step communicates over, their sizes, and a max over them (plain
``torch.distributed``).

Where the groups come from (the call's ``ProcessGroupCollection`` or Megatron's
``parallel_state``) is Megatron's business: ``megatron_compat.resolve_groups`` and
``megatron_compat.model_parallel_groups`` build these records. ``None`` stands for a
parallelism that is absent (or not initialized) and counts as a group of one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """The number of ranks in ``group``; ``None`` (no such parallelism) counts as 1."""
    return 1 if group is None else dist.get_world_size(group)


def max_over(values: Any, device: Any, *groups: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise max of ``values`` (as an fp64 tensor on ``device``) over each of ``groups``
    in turn: over every rank they span together (``mp`` then ``dp_cp``: every rank)."""
    tensor = torch.as_tensor(values, dtype=torch.float64, device=device)
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def same_on_every_rank(total: Any, squares: Any, ranks: int | float) -> Any:
    """Whether ``ranks`` values whose sum is ``total`` and whose sum of squares is ``squares``
    are all equal: ``total**2 == ranks * squares`` (Cauchy-Schwarz; exact for the small
    integers the agreements sum). Floats give a bool, tensors a 0-dim bool tensor, so that a
    check on the device needs no host sync."""
    return total * total == ranks * squares


@dataclass(frozen=True, slots=True)
class StepGroups:
    """The groups of one step's counts, agreement and metrics (docs/design.md §2)."""

    dp: dist.ProcessGroup | None
    """Data-parallel group without context parallelism (D)."""
    cp: dist.ProcessGroup | None
    """Context-parallel group: per-sequence counts of CP-sharded data."""
    dp_cp: dist.ProcessGroup | None
    """Data x context-parallel group: the step's counts, checks and metrics."""
    pp: dist.ProcessGroup | None
    """Pipeline group: the last (loss) stage, the verdict and metrics for every stage."""

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def dp_cp_size(self) -> int:
        return group_size(self.dp_cp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def is_last_stage(self) -> bool:
        return self.pp is None or dist.get_rank(self.pp) == group_size(self.pp) - 1


@dataclass(frozen=True, slots=True)
class ModelParallelGroups:
    """The groups over which one model's parameters are sharded (the self-check's gradient
    norms; Megatron-LM's tensor-parallel mask broadcast)."""

    tp: dist.ProcessGroup | None
    """Tensor-parallel group."""
    mp: dist.ProcessGroup | None
    """TP x PP: every shard of the dense parameters."""
    expert_mp: dist.ProcessGroup | None
    """Expert TP x EP x PP: every shard of the expert parameters."""
