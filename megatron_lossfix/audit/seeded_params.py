"""The same global weights under every parallel layout, seeded by parameter name.

Each parameter gets a layout-independent name (:func:`canonical_params`: global layer and expert
indices, wrappers stripped, the tied output layer named after the embedding it mirrors) and its
full value from (seed, name, full shape); every rank then keeps its own tensor-parallel shard.
Runs of different layouts -- and a one-rank reference -- then start from identical models, so
their gradients can be compared directly.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["canonical_params", "set_deterministic_params", "unwrap"]

_LAYER_RE = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"(\.experts\.local_experts\.)(\d+)\.")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def canonical_params(chunk: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Parameter, dict]]:
    """(canonical name, param, shard info) for every parameter of one model chunk.

    Canonical names are layout-independent: wrapper prefixes are stripped, layer indices are
    global (``decoder.layers.{i}`` with i = layer_number - 1 across pipeline stages and virtual
    chunks), expert indices are global (``local_experts.{j}`` over all EP ranks), and a tied
    output layer on the last pipeline stage is named after the word embedding it mirrors.
    Shard info: ``dim`` (partition dim or None), ``rank``/``size`` of the TP (or expert-TP)
    shard; a full tensor is the concatenation of the shards along ``dim``.
    """
    from megatron.core import parallel_state

    model = unwrap(chunk)
    layer_numbers = {}
    decoder = getattr(model, "decoder", None)
    for local, layer in enumerate(getattr(decoder, "layers", [])):
        layer_numbers[str(local)] = layer.layer_number - 1
    num_local_experts = None
    if getattr(model.config, "num_moe_experts", None):
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        num_local_experts = model.config.num_moe_experts // ep_size
        ep_rank = parallel_state.get_expert_model_parallel_rank()

    for name, param in model.named_parameters():
        name = _LAYER_RE.sub(lambda m: f"{m[1]}decoder.layers.{layer_numbers[m[2]]}.", name)
        expert = _EXPERT_RE.search(name)
        if expert:
            global_idx = ep_rank * num_local_experts + int(expert[2])
            name = f"{name[: expert.start(2)]}{global_idx}{name[expert.end(2) :]}"
        if name == "output_layer.weight" and getattr(
            model, "share_embeddings_and_output_weights", False
        ):
            name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
        yield name, param, _shard_info(param, bool(expert))


def _shard_info(param: torch.nn.Parameter, expert: bool) -> dict[str, Any]:
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return {"dim": None, "rank": 0, "size": 1}
    if expert or not getattr(param, "allreduce", True):
        rank = parallel_state.get_expert_tensor_parallel_rank()
        size = parallel_state.get_expert_tensor_parallel_world_size()
    else:
        rank = parallel_state.get_tensor_model_parallel_rank()
        size = parallel_state.get_tensor_model_parallel_world_size()
    return {"dim": param.partition_dim, "rank": rank, "size": size}


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _full_value(seed: int, name: str, shape: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    parts = name.split(".")
    if len(parts) > 1 and "norm" in parts[-2] and parts[-1] == "weight":  # norm gains near 1
        return 1.0 + 0.1 * noise
    return 0.02 * noise


@torch.no_grad()
def set_deterministic_params(
    model_chunks: list, seed: int, only: Callable[[str], bool] | None = None
) -> None:
    """Set every parameter from (seed, canonical name, full shape), then keep this rank's shard.

    Every layout then holds the same global weights as a 1-rank model. Call it before building an
    optimizer (which may copy the parameters into its own main params). ``only``: a predicate on
    the canonical name choosing which parameters to set (e.g. adapters added to a loaded model).
    """
    for chunk in model_chunks:
        for name, param, info in canonical_params(chunk):
            if only is not None and not only(name):
                continue
            shape = list(param.shape)
            dim = info["dim"]
            if dim is not None:
                shape[dim] *= info["size"]
            full = _full_value(seed, name, shape)
            if dim is not None:
                full = full.chunk(info["size"], dim=dim)[info["rank"]]
            if hasattr(param, "to_local"):  # Megatron-FSDP's DTensor: global shape, local shard
                param.to_local().copy_(_local_shard(param, full))
            else:
                param.copy_(full)
        # Megatron-FSDP computes with its own copy of the weights, refreshed from these.
        fsdp = getattr(chunk, "module", None)
        if hasattr(fsdp, "install_optimized_model_weights"):
            fsdp.install_optimized_model_weights()


def _local_shard(param: Any, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` for a Megatron-FSDP DTensor (sharded unevenly or not)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        gather_and_compute_chunk_metadata,
    )

    meta = gather_and_compute_chunk_metadata(param)
    index = tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes, strict=True))
    return full[index]
