"""The model under the self-check (docs/design.md §9): its chunks and trainable parameters, and
their gradients around the check's runs: whether any was held at the step's entry
(:meth:`CheckedModel.at_entry`), zeroed before each run as a step starts
(:meth:`CheckedModel.zero_grads`), gathered and read into a sketch after it
(:meth:`CheckedModel.sketch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.process_groups import ModelParallelGroups
from megatron_lossfix.step.megatron_compat import model_config_of
from megatron_lossfix.step.selfcheck.gradient_sketch import (
    Sketch,
    block_elements,
    gradient,
    sketch_gradients,
)

__all__ = ["CheckedModel", "model_chunks"]


def model_chunks(model: Any) -> tuple[list, Any]:
    """The step's model as a list of chunks (one, or the virtual pipeline's), and the first
    chunk's Megatron config (None: not a Megatron model)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return chunks, model_config_of(chunks[0])[0]


@dataclass(frozen=True, slots=True)
class CheckedModel:
    """A model the check runs: its chunks, their Megatron config (None: not a Megatron model),
    its trainable parameters (each once) and their device; at the step's entry, which of them
    held no gradient (None), and whether any held a nonzero one (the runs start from zero, as
    a step after ``zero_grad_buffer`` does)."""

    chunks: list
    config: Any
    params: list
    device: torch.device
    unset: list[bool]
    held: bool

    @classmethod
    def at_entry(cls, chunks: list, config: Any) -> CheckedModel:
        """The model as the step finds it."""
        params = list(dict.fromkeys(p for c in chunks for p in c.parameters() if p.requires_grad))
        device = params[0].device if params else torch.device("cpu")
        unset = [gradient(p) is None for p in params]
        held = torch.zeros((), dtype=torch.bool, device=device)
        size = block_elements(device)
        for param in params:
            grad = gradient(param)
            for block in () if grad is None else grad.detach().reshape(-1).split(size):
                held |= block.any()
        return cls(chunks, config, params, device, unset, bool(held))

    @property
    def per_token(self) -> bool:
        """Whether the loss takes Megatron's per-token path (``calculate_per_token_loss``),
        which divides the gradient by the token counts the loss functions return."""
        return bool(getattr(self.config, "calculate_per_token_loss", False))

    def zero_grads(self) -> None:
        """The gradients as before the step: zero (DDP's ``zero_grad_buffer`` also resets its
        per-step bucket state), None where there was none."""
        for chunk in self.chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=False)
        for param, none in zip(self.params, self.unset, strict=True):
            if none and getattr(param, "main_grad", None) is None:
                param.grad = None

    def sketch(self, shards: ModelParallelGroups) -> Sketch:
        """The sketch of the gradient now held, the distributed optimizer's shards gathered
        first."""
        _unshard(self.chunks)
        return sketch_gradients(self.params, shards)


def _unshard(chunks: list) -> None:
    """Gather the distributed optimizer's shards into full ``main_grad``s (its own unchanged)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
            continue
        kinds = ("bucket_groups", "expert_parallel_bucket_groups")
        for bucket_group in (g for kind in kinds for g in getattr(chunk, kind, [])):
            group = bucket_group.intra_distributed_optimizer_instance_group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            for bucket in bucket_group.buckets:
                views = shard_buffer(bucket.grad_data, size)
                dist.all_gather(views, views[rank].clone(), group=group)
