"""The harness's tiny Megatron-Core GPT, under any parallel layout, and its full gradients.

For gradient-oracle tests (docs/design.md §8), called inside `DistPool` workers (or any process
group). The model is built the way the examples build theirs (`megatron_lossfix.audit.training`: a
TransformerConfig and a layer spec, a model provider, Megatron DDP); this module only describes
the tiny model (:class:`TinyGPT`) and adds what tests need beyond training:
`gather_full_grads` (`gather_full_params`) reassembles the full, unsharded gradient (parameters)
on global rank 0 under the layout-independent names of `seeded_params.canonical_params`.

A full tensor is the concatenation of the TP shards along `partition_dim`: the QKV and gelu fc1
layouts are Megatron's checkpoint layouts, so a 1-rank model and any sharded one agree.
(Gated MLPs such as swiglu interleave per-shard halves and are not supported.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.audit.seeded_params import canonical_params, set_deterministic_params
from megatron_lossfix.audit.training import (
    Layout,
    build_model,
    gpt_layer_spec,
    gpt_model_provider,
    init_layout,
    transformer_config,
)
from megatron_lossfix.harness.cpu_megatron import is_cpu_mode

__all__ = [
    "Layout",
    "TinyGPT",
    "build_tiny_gpt",
    "case_tiny_gpt",
    "gather_full_grads",
    "gather_full_params",
    "init_layout",
    "one_rank_tiny_gpt",
    "set_deterministic_params",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class TinyGPT:
    """The tiny GPT of the tests: fp32, dropout 0, gelu MLP, local layer spec by default."""

    num_layers: int = 4
    """Transformer layers over all pipeline stages."""
    hidden: int = 32
    """Hidden size."""
    heads: int = 4
    """Attention heads."""
    vocab: int = 264
    """Vocabulary size (divisible by TP)."""
    seq_len: int = 16
    """Maximum sequence length (learned absolute positions)."""
    ffn_hidden: int | None = None
    """MLP hidden size; None: 4 x hidden."""
    num_experts: int | None = None
    """MoE experts per layer; None: a dense MLP."""
    moe_router_topk: int = 2
    """Experts per token (MoE only)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss weight (MoE only)."""
    mtp_num_layers: int | None = None
    """Multi-token prediction layers."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` or ``rope``."""
    no_attention: bool = False
    """Attention replaced by identity, so that CP is exact without Transformer Engine."""
    tie_embeddings: bool = False
    """Share the word embedding with the output layer."""
    calculate_per_token_loss: bool = False
    """Megatron's ``calculate_per_token_loss``."""
    overlap_grad_reduce: bool = False
    """DDP's overlapped gradient reduce (sets the config's sync functions)."""
    use_distributed_optimizer: bool = False
    """DDP buffers laid out for Megatron's distributed optimizer."""
    bucket_size: int | None = None
    """DDP bucket size in elements; None: Megatron's default."""
    average_in_collective: bool = False
    """DDP's ``average_in_collective`` (Megatron-LM's ``--ddp-average-in-collective``)."""
    megatron_fsdp: str | None = None
    """Megatron-FSDP (``--use-megatron-fsdp``) with this ``data_parallel_sharding_strategy``
    instead of Megatron DDP; None: Megatron DDP."""
    model_hook: Callable[[torch.nn.Module], None] | None = None
    """Called on each bare chunk before the DDP wrap (e.g. to add adapters); picklable, since the
    pool's ranks receive it."""
    transformer_impl: str = "local"
    """``local`` or ``transformer_engine`` (CUDA only)."""
    bf16: bool = False
    """Megatron-LM's ``--bf16``: bf16 weights in Float16Module, fp32 main gradients."""
    config_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further TransformerConfig fields, applied last."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "vocab", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyGPT.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(
                "transformer_impl must be 'local' or 'transformer_engine', got "
                f"{self.transformer_impl!r}"
            )

    def transformer_config(self, layout: Layout) -> Any:
        """The TransformerConfig for ``layout``; it also carries ``vocab_size``, ``seq_length``."""
        fields: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            ffn_hidden_size=self.ffn_hidden,
            calculate_per_token_loss=self.calculate_per_token_loss,
        )
        if self.bf16:
            fields.update(bf16=True)
        if self.mtp_num_layers:
            fields.update(mtp_num_layers=self.mtp_num_layers)
        if self.num_experts:
            fields.update(
                num_moe_experts=self.num_experts,
                moe_router_topk=self.moe_router_topk,
                moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            )
        config = transformer_config(layout, **{**fields, **self.config_overrides})
        # TransformerConfig has no field for these; callers building batches need them.
        config.vocab_size, config.seq_length = self.vocab, self.seq_len
        return config

    def build(self, layout: Layout) -> tuple[list, Any]:
        """This rank's DDP-wrapped chunks (one per virtual pipeline stage) and their config."""
        from megatron.core.distributed import DistributedDataParallelConfig

        config = self.transformer_config(layout)
        spec = gpt_layer_spec(
            self.transformer_impl, num_experts=self.num_experts, no_attention=self.no_attention
        )
        provider = gpt_model_provider(
            config,
            spec,
            vocab_size=self.vocab,
            max_sequence_length=self.seq_len,
            use_transformer_engine=self.transformer_impl != "local",
            share_embeddings_and_output_weights=self.tie_embeddings,
            position_embedding_type=self.position_embedding_type,
        )
        fsdp: dict[str, Any] = {}
        if self.megatron_fsdp is not None:
            fsdp = dict(
                use_megatron_fsdp=True,
                data_parallel_sharding_strategy=self.megatron_fsdp,
                # The fused pre-scaled sum is NCCL's (PREMUL_SUM); unfused it scales, then sums.
                gradient_reduce_div_fusion=not is_cpu_mode(),
            )
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=self.overlap_grad_reduce,
            use_distributed_optimizer=self.use_distributed_optimizer,
            bucket_size=self.bucket_size,
            average_in_collective=self.average_in_collective,
            # Megatron-LM's default under --bf16 (--accumulate-allreduce-grads-in-fp32).
            grad_reduce_in_fp32=self.bf16,
            **fsdp,
        )
        wrapper = None
        if self.megatron_fsdp is not None:
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

            wrapper = FullyShardedDataParallel
        chunks = build_model(
            provider, config, ddp_config, model_hook=self.model_hook, wrapper=wrapper
        )
        return chunks, config


_TINY_GPT_FIELDS = frozenset(f.name for f in dataclasses.fields(TinyGPT)) - {"config_overrides"}


def build_tiny_gpt(layout: Layout, **kwargs: Any) -> tuple[list, Any]:
    """Build this rank's tiny GPT chunks, wrapped in Megatron DDP, plus their config.

    Call `init_layout(layout)` first. ``kwargs`` are :class:`TinyGPT` fields; any other keyword
    is a TransformerConfig field (``config_overrides``).
    """
    overrides = {k: v for k, v in kwargs.items() if k not in _TINY_GPT_FIELDS}
    fields = {k: v for k, v in kwargs.items() if k in _TINY_GPT_FIELDS}
    return TinyGPT(**fields, config_overrides=overrides).build(layout)


def case_tiny_gpt(layout: Layout, case: Any, **overrides: Any) -> tuple[list, Any]:
    """This rank's tiny GPT of an oracle ``case`` (its sequence length and model settings, with
    ``overrides``) under ``layout``, initialized already (:func:`init_layout`)."""
    kwargs = {**case.model_kwargs, **overrides}
    return build_tiny_gpt(layout, seq_len=case.seq_length, **kwargs)


def one_rank_tiny_gpt(case: Any, **overrides: Any) -> tuple[torch.nn.Module, Any]:
    """The one-rank tiny GPT of an oracle ``case`` that a reference gradient is taken on: one
    rank (every parallel size 1), the case's deterministic parameters, no gradient yet.
    Returns the model (one chunk, Megatron DDP) and its config; ``gather_full_grads([model])``
    reads its gradient."""
    (model,), config = case_tiny_gpt(init_layout(Layout()), case, **overrides)
    set_deterministic_params([model], case.seed)
    model.zero_grad_buffer()
    return model, config


# -- gradient gathering ---------------------------------------------------------------------------


def _unshard_distributed_optimizer_grads(chunk: torch.nn.Module) -> None:
    """With the distributed optimizer each DP rank holds only its reduce-scattered shard of every
    bucket; all-gather the shards back (in place) so that `main_grad` is the full gradient."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    groups = list(getattr(chunk, "bucket_groups", [])) + list(
        getattr(chunk, "expert_parallel_bucket_groups", [])
    )
    for bucket_group in groups:
        group = bucket_group.intra_distributed_optimizer_instance_group
        size, rank = group.size(), group.rank()
        for bucket in bucket_group.buckets:
            views = shard_buffer(bucket.grad_data, size)
            dist.all_gather(views, views[rank].clone(), group=group)


@torch.no_grad()
def gather_full_grads(model_chunks: list, rtol: float = 1e-5) -> dict[str, torch.Tensor] | None:
    """Full, unsharded gradient (`main_grad`, else `.grad`) by canonical name, on global rank 0.

    Collective over the world group: every rank must call it. Unshards TP/expert-TP along
    `partition_dim`, EP by global expert index, collects all PP stages and virtual chunks, and
    checks that all replicas of a shard (DP, CP, tied copies) agree within `rtol`.
    Returns None on ranks other than 0.
    """
    local = []
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer:
            _unshard_distributed_optimizer_grads(chunk)
        for name, param, info in canonical_params(chunk):
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is None:
                grad = torch.zeros_like(param)
            local.append((name, info, _whole(grad).detach().clone()))
    return _gather_on_rank0(local, rtol)


@torch.no_grad()
def gather_full_params(model_chunks: list, rtol: float = 1e-6) -> dict[str, torch.Tensor] | None:
    """Full, unsharded parameters by canonical name, on global rank 0 (see `gather_full_grads`)."""
    local = [
        (name, info, _whole(param).detach().clone())
        for chunk in model_chunks
        for name, param, info in canonical_params(chunk)
    ]
    return _gather_on_rank0(local, rtol)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A Megatron-FSDP DTensor (sharded unevenly or not) as the whole tensor (collective over its
    data-parallel group); any other tensor as it is."""
    if not hasattr(tensor, "to_local"):
        return tensor
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        gather_and_compute_chunk_metadata,
    )

    mesh = tensor.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(f"a {mesh.ndim}-dimensional Megatron-FSDP mesh")
    # Gathered as objects: gloo's all_gather needs equal shards, Megatron-FSDP's are uneven.
    offsets = gather_and_compute_chunk_metadata(tensor).offsets
    local = tensor.to_local().detach()
    group = mesh.get_group()
    pieces: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, (offsets, local.cpu()), group=group)
    whole = torch.zeros(tuple(tensor.shape), dtype=local.dtype)
    for start, piece in pieces:
        whole[tuple(slice(o, o + n) for o, n in zip(start, piece.shape, strict=True))] = piece
    return whole.to(local.device)


def _gather_on_rank0(local: list, rtol: float) -> dict[str, torch.Tensor] | None:
    """Reassemble (name, shard info, tensor) entries of all ranks into full tensors on rank 0."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank != 0:
        return None

    shards: dict[str, dict[int, torch.Tensor]] = {}
    sharding: dict[str, tuple[int | None, int]] = {}
    for src, entries in enumerate(gathered):
        for name, info, tensor in entries:
            dim, size, shard = info["dim"], info["size"], info["rank"]
            if sharding.setdefault(name, (dim, size)) != (dim, size):
                raise AssertionError(f"{name}: inconsistent sharding {(dim, size)} on rank {src}")
            seen = shards.setdefault(name, {})
            if shard not in seen:
                seen[shard] = tensor
                continue
            scale = max(seen[shard].norm(), tensor.norm())
            if (tensor - seen[shard]).norm() > rtol * scale:
                err = (tensor - seen[shard]).norm() / scale
                raise AssertionError(
                    f"{name}: replicas disagree (rank {src}, shard {shard}, rel {err:.2e})"
                )
    full = {}
    for name, seen in shards.items():
        dim, size = sharding[name]
        if sorted(seen) != list(range(size)):
            raise AssertionError(f"{name}: missing shards, have {sorted(seen)} of {size}")
        full[name] = seen[0] if dim is None else torch.cat([seen[r] for r in range(size)], dim)
    return dict(sorted(full.items()))
