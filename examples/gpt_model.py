"""The examples' GPT on Megatron-Core: model flags under Megatron-LM's names, this rank's model
chunks in Megatron DDP, and the same starting weights under every parallel layout.

Your own model goes where :func:`build_model` is: a ``TransformerConfig``, a layer spec, one
``GPTModel`` per virtual pipeline stage, each in ``DistributedDataParallel``, and the two hooks
Megatron's schedule calls (``finalize_model_grads_func``, ``no_sync_func``). Layouts Megatron
cannot build, it refuses itself (``initialize_model_parallel``, ``TransformerConfig``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_lossfix.args import non_negative_float, positive_int

__all__ = ["add_model_args", "build_model", "seed_weights", "virtual_stages"]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model and parallelism flags, with Megatron-LM's names and meanings."""
    # fmt: off
    model = parser.add_argument_group("model").add_argument
    model("--num-layers", type=positive_int, default=4, help="transformer layers")
    model("--hidden-size", type=positive_int, default=64, help="hidden size")
    model("--num-attention-heads", type=positive_int, default=4, help="attention heads")
    model("--seq-length", type=positive_int, default=128, help="tokens per sequence")
    model("--num-experts", type=positive_int, default=None, help="MoE experts per layer")
    model("--moe-aux-loss-coeff", type=non_negative_float, default=0.0, help="MoE aux loss weight")
    model("--mtp-num-layers", type=positive_int, default=None, help="multi-token prediction "
          "layers; their losses are normalized like the main loss, over their shifted masks")
    model("--mtp-loss-scaling-factor", type=non_negative_float, default=0.1,
          help="weight of the MTP losses (Megatron divides it by --mtp-num-layers)")
    model("--position-embedding-type", choices=("learned_absolute", "rope"),
          default="learned_absolute", help="position embedding (MTP under PP needs rope)")
    model("--transformer-impl", choices=("local", "transformer_engine"), default="local",
          help="Megatron's local layers, or Transformer Engine's (CUDA; CP-capable attention)")
    model("--no-attention", action="store_true", help="replace self-attention by identity: "
          "only for testing context parallelism on CPU, where Transformer Engine is absent")
    par = parser.add_argument_group("parallelism").add_argument
    par("--tensor-model-parallel-size", type=positive_int, default=1, help="TP size")
    par("--pipeline-model-parallel-size", type=positive_int, default=1, help="PP size")
    par("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None,
        help="layers per virtual stage (interleaved 1F1B schedule)")
    par("--context-parallel-size", type=positive_int, default=1, help="CP size")
    par("--expert-model-parallel-size", type=positive_int, default=1, help="EP size")
    # fmt: on


def virtual_stages(args: argparse.Namespace) -> int | None:
    """Model chunks per pipeline rank (Megatron's virtual pipeline size), or None."""
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if per_virtual is None:
        return None
    return args.num_layers // args.pipeline_model_parallel_size // per_virtual


def _config(args: argparse.Namespace, per_token_loss: bool, bf16: bool) -> Any:
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    extra: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    # The CUDA-graph option's default, "full", warns that it is deprecated; the empty list
    # means the same, the whole layer (no CUDA graph is captured here in any case). It is
    # cuda_graph_modules from megatron-core 0.18, cuda_graph_scope before (deprecated since).
    if "cuda_graph_modules" in fields:
        extra.update(cuda_graph_modules=[])
    elif "cuda_graph_scope" in fields:
        extra.update(cuda_graph_scope=[])
    if virtual_stages(args):
        # Megatron-LM's interleaved settings: batched p2p with PP=2 pairs sends and receives
        # of the same peer crossed (Megatron-LM #750, #1450).
        extra.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if args.num_experts:
        extra.update(
            num_moe_experts=args.num_experts,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            # gloo's all_to_all takes no split sizes, which the alltoall dispatcher needs.
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            # Local experts add their bias in place into a custom Function's output, which
            # autograd refuses: MoE models run without linear biases.
            add_bias_linear=False,
        )
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_stages(args),
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        calculate_per_token_loss=per_token_loss,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        hidden_dropout=0.0,  # no dropout: runs of two layouts compare step by step
        attention_dropout=0.0,
        # The fused kernels need CUDA or torch.jit; the plain paths compute the same thing.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **extra,
    )


def _layer_spec(args: argparse.Namespace) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    experts = dict(num_experts=args.num_experts, moe_grouped_gemm=False)
    if args.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**experts)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(**experts)
    if not args.no_attention:
        return spec
    # Tokens never mix, so a sequence sharded over CP ranks is exact without TE's attention.
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = ModuleSpec(module=IdentityOp, params={"attn_mask_type": AttnMaskType.causal})
    sub = dataclasses.replace(
        spec.submodules,
        input_layernorm=IdentityOp,
        self_attention=attention,
        self_attn_bda=IdentityFuncOp,
    )
    return dataclasses.replace(spec, submodules=sub)


def build_model(
    args: argparse.Namespace, vocab_size: int, *, per_token_loss: bool = False, bf16: bool = False
) -> tuple[list, Any]:
    """This rank's GPT chunks in Megatron DDP (one per virtual pipeline stage) and their config,
    after Megatron's parallel state is initialized. ``bf16``: Megatron-LM's ``--bf16``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.module import Float16Module

    config, spec = _config(args, per_token_loss, bf16), _layer_spec(args)
    te = args.transformer_impl == "transformer_engine"
    # Megatron-LM's default under --bf16 (--accumulate-allreduce-grads-in-fp32).
    ddp_config = DDPConfig(grad_reduce_in_fp32=bf16)
    stages = virtual_stages(args)
    chunks = []
    for vp in range(stages) if stages else [None]:
        mtp = None
        if args.mtp_num_layers:
            mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=te, vp_stage=vp)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=args.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
            mtp_block_spec=mtp,
            position_embedding_type=args.position_embedding_type,
        )
        seed_weights([model], args.seed)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if bf16:
            model = Float16Module(config, model)
        # As Megatron-LM: only the first chunk's gradient buffer is cut into buckets.
        chunks.append(DDP(config, ddp_config, model, disable_bucketing=bool(vp)))
    # Megatron's schedule calls these: the gradient reduction at the end of the step (the
    # plugin refuses a DP/CP step without it), and no reduction between micro-batches.
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
    return chunks, config


@torch.no_grad()
def seed_weights(chunks: list, seed: int, only: Callable[[str], bool] | None = None) -> None:
    """Draw every weight matrix from ``(seed, its checkpoint key)``, then keep this rank's shard.

    Megatron initializes from per-rank RNG states, so a pipeline stage or an expert-parallel
    rank starts from other weights than one rank would. Megatron's checkpoint keys name each
    shard's place in the whole model (global layer and expert offsets, the TP slice), so every
    layout gets the weights one rank has, and runs of two layouts compare step by step. Norms
    and biases keep Megatron's constant initial values. ``only``: a predicate on the key.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    # Megatron-LM's checkpointing passes the data-parallel group; megatron-core 0.16 reads it
    # without a default where an MTP stage ties its copy of the embedding (MTP under PP).
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    for chunk in chunks:
        while hasattr(chunk, "module"):  # DDP, Float16Module
            chunk = chunk.module
        for shard in nested_values(chunk.sharded_state_dict(metadata=metadata)):
            key = getattr(shard, "key", "")
            if not isinstance(shard, ShardedTensor) or not key.endswith(".weight"):
                continue
            if key.endswith("norm.weight") or (only is not None and not only(key)):
                continue
            lead = shard.prepend_axis_num  # stacked layers or experts: one draw per index
            name = f"{seed}:{key}:{shard.global_offset[:lead]}"
            gen = torch.Generator().manual_seed(
                int(hashlib.sha256(name.encode()).hexdigest(), 16) % 2**63
            )
            full = 0.02 * torch.randn(shard.global_shape[lead:], generator=gen)
            where = zip(shard.global_offset[lead:], shard.local_shape, strict=True)
            part = full[tuple(slice(start, start + size) for start, size in where)]
            shard.data.copy_(part.reshape(shard.data.shape))
