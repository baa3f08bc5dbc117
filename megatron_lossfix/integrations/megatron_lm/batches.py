"""The loss stage's batches under Megatron-LM's plumbing, for
:class:`~megatron_lossfix.integrations.megatron_lm.training.MegatronLMLossFix`.

Megatron-LM gives the data iterator to tensor-parallel rank 0 of each stage only, and its
loader yields CPU tensors: :class:`MasksToDevice` moves each batch's loss mask to the device and
broadcasts it to the other TP ranks, which read it through :class:`ReceivedMasks`.
:class:`Recording` remembers the micro-batch ``forward_step`` read (which holds the weights the
plugin attached), since ``pretrain_gpt``'s ``get_batch`` drops the keys it does not know.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MasksToDevice", "ReceivedMasks", "Recording"]


def _current_device() -> torch.device:
    # Megatron-LM's data loader yields CPU tensors; collectives (NCCL) need them on the GPU.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MasksToDevice:
    """The loss stage's data iterator, with each batch's loss mask moved to the device (and, when
    tensor parallelism is on, broadcast to the other TP ranks, which have no data iterator)."""

    def __init__(self, source: Iterator, mask_key: str, tp_group: Any) -> None:
        self._source = source
        self._mask_key = mask_key
        self._tp_group = tp_group

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._source)
        if not isinstance(batch, Mapping) or self._mask_key not in batch:
            return batch  # LossFixSchedule names what is missing
        mask = batch[self._mask_key].to(_current_device(), non_blocking=True)
        if self._tp_group is not None:
            src = dist.get_global_rank(self._tp_group, 0)
            shape = torch.tensor(mask.shape, dtype=torch.int64, device=mask.device)
            dist.broadcast(torch.tensor([mask.dim()], device=mask.device), src, self._tp_group)
            dist.broadcast(shape, src, self._tp_group)
            mask = mask.float().contiguous()
            dist.broadcast(mask, src, self._tp_group)
        return {**batch, self._mask_key: mask}


class ReceivedMasks:
    """On tensor-parallel ranks other than 0 of the loss stage (Megatron-LM gives them no data
    iterator): yields ``{mask_key: mask}`` received from TP rank 0, one per micro-batch."""

    def __init__(self, mask_key: str, tp_group: Any) -> None:
        self._mask_key = mask_key
        self._tp_group = tp_group

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> dict:
        device = _current_device()
        src = dist.get_global_rank(self._tp_group, 0)
        ndim = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(ndim, src, self._tp_group)
        shape = torch.zeros(int(ndim), dtype=torch.int64, device=device)
        dist.broadcast(shape, src, self._tp_group)
        mask = torch.empty(*shape.tolist(), dtype=torch.float32, device=device)
        dist.broadcast(mask, src, self._tp_group)
        return {self._mask_key: mask}


class Recording:
    """Passes ``next()`` through and remembers the last item (the micro-batch forward_step
    read, holding the weights the plugin attached). With ``item_key``, a dict item holding
    that key is passed on as its value (the script's own item, which the plugin's micro-batch
    dict carries: ``rl``)."""

    def __init__(self, source: Iterator, item_key: str | None = None) -> None:
        self._source = source
        self._item_key = item_key
        self.last: Any = None

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        self.last = next(self._source)
        if self._item_key is not None and isinstance(self.last, Mapping):
            return self.last.get(self._item_key, self.last)
        return self.last
