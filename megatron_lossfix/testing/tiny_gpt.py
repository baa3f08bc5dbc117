"""A tiny Megatron-Core GPT under any parallel layout, with layout-independent weights and grads.

For gradient-oracle tests (docs/design.md §8), called inside `DistPool` workers (or any process
group): `init_layout` sets up Megatron's parallel state, `build_tiny_gpt` builds the real GPTModel
chunks wrapped in Megatron DDP, `set_deterministic_params` gives every layout the same global
weights, and `gather_full_grads` (`gather_full_params`) reassembles the full, unsharded gradient
(parameters) on global rank 0.

Canonical parameter names are layout-independent: DDP's `module.` prefixes are stripped, layer
indices are global (`decoder.layers.{i}` with i = layer_number - 1 across pipeline stages and
virtual chunks), expert indices are global (`local_experts.{j}` with j counted over all EP ranks),
and a tied output layer on the last pipeline stage is named after the word embedding it mirrors.
A full tensor is the concatenation of the TP shards along `partition_dim`: the QKV and gelu fc1
layouts are Megatron's checkpoint layouts, so a 1-rank model and any sharded one agree.
(Gated MLPs such as swiglu interleave per-shard halves and are not supported.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.cpu_compat import is_cpu_mode


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout. `dp=None` is derived from the world size by `init_layout`.

    `vpp` is the number of virtual pipeline stages (model chunks) per PP rank, or None.
    Expert parallelism (`ep`) splits the experts over the TP×CP×DP ranks of a pipeline stage
    (Megatron's expert grid); it does not enter the world size.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int | None = None
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        if self.dp is None:
            raise ValueError("world_size needs dp; set it or call init_layout first")
        return self.tp * self.pp * self.cp * self.dp


def _world_timeout_minutes() -> float:
    """The default group's timeout, so that Megatron's subgroups fail as fast as it does."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds() / 60
    except (AttributeError, RuntimeError):
        return 30.0  # Megatron's own default


def init_layout(layout: Layout, seed: int = 1234) -> Layout:
    """(Re)initialize Megatron's parallel state for `layout` on the current world.

    Also seeds Megatron's RNG tracker (in CPU mode that reseeds torch's CPU generator, which
    stands in for the CUDA one). Megatron's subgroups get the default group's timeout. Returns
    the layout with `dp` filled in.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    model_parallel = layout.tp * layout.pp * layout.cp
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp={model_parallel}")
    dp = world // model_parallel
    if layout.dp is not None and layout.dp != dp:
        raise ValueError(f"{layout} needs {layout.world_size} ranks, the world has {world}")
    layout = dataclasses.replace(layout, dp=dp)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        distributed_timeout_minutes=_world_timeout_minutes(),
    )
    model_parallel_cuda_manual_seed(seed)
    return layout


def _layer_spec(num_experts: int | None, no_attention: bool, transformer_impl: str) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    if transformer_impl == "transformer_engine":
        if no_attention:
            raise ValueError("no_attention is for CPU runs without Transformer Engine")
        # Needs CUDA and Transformer Engine; its attention supports context parallelism.
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False
        )
    if transformer_impl != "local":
        raise ValueError(
            f"transformer_impl must be 'local' or 'transformer_engine', got {transformer_impl!r}"
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if no_attention:
        # The attention block becomes x -> x (no norm, no attention, no residual add): tokens
        # never mix, so sharding the sequence over CP ranks is exact without TE's CP attention.
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.spec_utils import ModuleSpec

        sub = dataclasses.replace(
            spec.submodules,
            input_layernorm=IdentityOp,
            # MTP layers read the attention's mask type from the spec's params.
            self_attention=ModuleSpec(
                module=IdentityOp, params={"attn_mask_type": AttnMaskType.causal}
            ),
            self_attn_bda=IdentityFuncOp,
        )
        spec = dataclasses.replace(spec, submodules=sub)
    return spec


def build_tiny_gpt(
    layout: Layout,
    *,
    num_layers: int = 4,
    hidden: int = 32,
    heads: int = 4,
    vocab: int = 264,
    seq_len: int = 16,
    ffn_hidden: int | None = None,
    num_experts: int | None = None,
    moe_router_topk: int = 2,
    moe_aux_loss_coeff: float = 0.0,
    mtp_num_layers: int | None = None,
    position_embedding_type: str = "learned_absolute",
    no_attention: bool = False,
    tie_embeddings: bool = False,
    calculate_per_token_loss: bool = False,
    overlap_grad_reduce: bool = False,
    use_distributed_optimizer: bool = False,
    bucket_size: int | None = None,
    lora_rank: int | None = None,
    transformer_impl: str = "local",
    bf16: bool = False,
    **config_kwargs: Any,
) -> tuple[list, Any]:
    """Build the GPTModel chunks of this rank, wrapped in Megatron DDP, plus their config.

    Call `init_layout(layout)` first. fp32, dropout 0, gelu MLP, learned absolute positions, local
    (non-TE) layer spec; one chunk per virtual pipeline stage. The returned config also carries
    `vocab_size` and `seq_length`. `config_kwargs` go to
    TransformerConfig. The config gets `finalize_model_grads_func` (and, when overlapping the
    grad reduce, `no_sync_func` / `grad_sync_func`) set the way Megatron-LM's training loop does.
    With `lora_rank`, each chunk gets a frozen base and LoRA adapters of that rank
    (`megatron_lossfix.lora.apply_lora`) before the DDP wrap. `transformer_impl` picks the local
    layer spec or Transformer Engine's (CUDA only). On a GPU run the chunks move to the current
    CUDA device; under `cpu_compat` they stay on the CPU. `bf16` builds the model the way
    Megatron-LM's `--bf16` does: bf16 weights inside `Float16Module`, gradients accumulated and
    reduced in fp32 (`main_grad`).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn_hidden or 4 * hidden,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        # Needs Apex/TE LayerNorm; so on CPU there is no MoE with TP > 1 (Megatron requires SP).
        sequence_parallel=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gated_linear_unit=False,
        # Fused kernels need CUDA or torch.jit; the plain paths compute the same thing.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    if bf16:
        kwargs.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    if layout.vpp:
        # Megatron-LM's interleaved defaults. Batched p2p posts send_prev and send_next in one
        # batch; with PP=2 both go to the same peer and pair up crossed (activations received as
        # gradients, silently: Megatron-LM #750, #1450). Not CPU-specific.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if mtp_num_layers:
        kwargs.update(mtp_num_layers=mtp_num_layers)
    if num_experts:
        kwargs.update(
            num_moe_experts=num_experts,
            moe_router_topk=moe_router_topk,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_ffn_hidden_size=kwargs["ffn_hidden_size"],
            # gloo's all_to_all takes no split sizes, which the alltoall dispatcher needs.
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            # Megatron's SequentialMLP adds the expert bias in place into a custom Function's
            # output and autograd refuses (on any device); MoE models run without linear biases.
            add_bias_linear=False,
        )
    config = TransformerConfig(**{**kwargs, **config_kwargs})
    spec = _layer_spec(num_experts, no_attention, transformer_impl)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        # Megatron-LM's default under --bf16 (--accumulate-allreduce-grads-in-fp32).
        grad_reduce_in_fp32=bf16,
    )
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        mtp_spec = None
        if mtp_num_layers:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            # None on the ranks that hold no MTP layer (all but the last stage).
            mtp_spec = get_gpt_mtp_block_spec(
                config, spec, use_transformer_engine=transformer_impl != "local", vp_stage=vp
            )
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=seq_len,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=tie_embeddings,
            position_embedding_type=position_embedding_type,
            vp_stage=vp,
            mtp_block_spec=mtp_spec,
        )
        if lora_rank:
            from megatron_lossfix.lora import apply_lora

            # Before DDP, which allocates grad buffers only for trainable parameters.
            apply_lora(model, rank=lora_rank)
        if torch.cuda.is_available() and not is_cpu_mode():
            model.cuda(torch.cuda.current_device())
        if bf16:
            model = Float16Module(config, model)
        # As Megatron-LM: only the first chunk's buffer is split into buckets.
        chunks.append(
            DistributedDataParallel(config, ddp_config, model, disable_bucketing=vp_stage > 0)
        )

    config.finalize_model_grads_func = finalize_model_grads
    # TransformerConfig has no field for these; callers building batches need them.
    config.vocab_size, config.seq_length = vocab, seq_len
    if overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in chunks]
        grad_sync = [chunk.start_grad_sync for chunk in chunks]
        config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(chunks) == 1 else grad_sync
    return chunks, config


# -- canonical names ------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"(\.experts\.local_experts\.)(\d+)\.")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _canonical_params(chunk: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Parameter, dict]]:
    """(canonical name, param, shard info) for every parameter of one model chunk.

    Shard info: `dim` (partition dim or None), `rank`/`size` of the TP (or expert-TP) shard.
    """
    from megatron.core import parallel_state

    model = _unwrap(chunk)
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
        info: dict[str, Any] = {"dim": None, "rank": 0, "size": 1}
        if getattr(param, "tensor_model_parallel", False):
            if expert or not getattr(param, "allreduce", True):
                rank = parallel_state.get_expert_tensor_parallel_rank()
                size = parallel_state.get_expert_tensor_parallel_world_size()
            else:
                rank = parallel_state.get_tensor_model_parallel_rank()
                size = parallel_state.get_tensor_model_parallel_world_size()
            info = {"dim": param.partition_dim, "rank": rank, "size": size}
        yield name, param, info


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
def set_deterministic_params(model_chunks: list, seed: int) -> None:
    """Set every parameter from (seed, canonical name, full shape), then keep this rank's shard.

    Every layout then holds the same global weights as a 1-rank model. Call it before building an
    optimizer (which may copy the parameters into its own main params).
    """
    for chunk in model_chunks:
        for name, param, info in _canonical_params(chunk):
            shape = list(param.shape)
            dim = info["dim"]
            if dim is not None:
                shape[dim] *= info["size"]
            full = _full_value(seed, name, shape)
            if dim is not None:
                full = full.chunk(info["size"], dim=dim)[info["rank"]]
            param.copy_(full)


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
        for name, param, info in _canonical_params(chunk):
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is None:
                grad = torch.zeros_like(param)
            local.append((name, info, grad.detach().clone()))
    return _gather_on_rank0(local, rtol)


@torch.no_grad()
def gather_full_params(model_chunks: list, rtol: float = 1e-6) -> dict[str, torch.Tensor] | None:
    """Full, unsharded parameters by canonical name, on global rank 0 (see `gather_full_grads`)."""
    local = [
        (name, info, param.detach().clone())
        for chunk in model_chunks
        for name, param, info in _canonical_params(chunk)
    ]
    return _gather_on_rank0(local, rtol)


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
