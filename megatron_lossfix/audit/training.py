"""One training step the Megatron-Core way: layout, model provider, DDP model, schedule, optimizer.

The examples, the benchmark, the gradient oracle and the collective-count test all train the same
way; this module is that way, written once:

* :class:`Layout` and :func:`init_layout`: a parallel layout and Megatron's parallel state for it;
* :func:`transformer_config` and :func:`gpt_layer_spec`: a ``TransformerConfig`` from Megatron's
  own field names plus the settings every layout and device here needs (fp32 or bf16, no
  dropout, no fused kernels that need CUDA), and the GPT layer spec;
* :func:`gpt_model_provider`: a Megatron-LM style ``model_provider(pre_process, post_process,
  vp_stage=None)``; :func:`build_model` calls it per virtual pipeline stage and wraps the chunks
  in Megatron DDP;
* :func:`set_deterministic_params` (from :mod:`megatron_lossfix.audit.seeded_params`): the same
  global weights under every layout, seeded by parameter name, so that runs of different
  layouts can be compared step by step;
* :func:`train_step`: zero the gradients, run a ``forward_backward_func`` (the plugin's
  schedule or Megatron's), step the optimizer.

Nothing here is specific to tests. Process groups come from Megatron's parallel state, which
:func:`init_layout` sets up; the step itself synchronizes with the host only after the schedule.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.audit.seeded_params import set_deterministic_params
from megatron_lossfix.harness.cpu_megatron import is_cpu_mode

__all__ = [
    "Layout",
    "StepResult",
    "build_model",
    "gpt_layer_spec",
    "gpt_model_provider",
    "init_layout",
    "set_deterministic_params",
    "train_step",
    "transformer_config",
]


# -- layout ---------------------------------------------------------------------------------------


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


# -- model ----------------------------------------------------------------------------------------


def transformer_config(layout: Layout, **fields: Any) -> Any:
    """A ``TransformerConfig`` with Megatron's own ``fields`` (``num_layers``, ``hidden_size``,
    ``num_attention_heads``, ``bf16``, ``num_moe_experts``, ...) for ``layout``.

    What it adds, each overridable by ``fields``: the layout's parallel sizes; fp32 (or, with
    ``bf16=True``, Megatron-LM's ``--bf16`` dtypes); no dropout; a gelu MLP; the plain paths
    instead of fused kernels that need CUDA; Megatron-LM's interleaved p2p settings with a
    virtual pipeline; and, with experts, the allgather dispatcher without linear biases.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if fields.get("bf16") else torch.float32
    base: dict[str, Any] = dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        # Needs Apex/TE LayerNorm; so on CPU there is no MoE with TP > 1 (Megatron requires SP).
        sequence_parallel=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gated_linear_unit=False,
        # Fused kernels need CUDA or torch.jit; the plain paths compute the same thing.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    base["ffn_hidden_size"] = fields.get("ffn_hidden_size") or 4 * fields["hidden_size"]
    if layout.vpp:
        # Megatron-LM's interleaved defaults. Batched p2p posts send_prev and send_next in one
        # batch; with PP=2 both go to the same peer and pair up crossed (activations received as
        # gradients, silently: Megatron-LM #750, #1450). Not CPU-specific.
        base.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if fields.get("num_moe_experts"):
        base.update(
            moe_ffn_hidden_size=base["ffn_hidden_size"],
            # gloo's all_to_all takes no split sizes, which the alltoall dispatcher needs.
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            # Megatron's SequentialMLP adds the expert bias in place into a custom Function's
            # output and autograd refuses (on any device); MoE models run without linear biases.
            add_bias_linear=False,
        )
    # A None field keeps the value above (e.g. ffn_hidden_size=None: 4 x hidden_size).
    fields = {k: v for k, v in fields.items() if v is not None or k not in base}
    return TransformerConfig(**{**base, **fields})


def gpt_layer_spec(
    transformer_impl: str = "local", *, num_experts: int | None = None, no_attention: bool = False
) -> Any:
    """Megatron's GPT layer spec: the local modules or Transformer Engine's (CUDA only).

    ``no_attention`` (local only) makes the attention block x -> x (no norm, no attention, no
    residual add): tokens never mix, so sharding the sequence over CP ranks is exact without
    TE's CP attention.
    """
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
    if not no_attention:
        return spec
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
    return dataclasses.replace(spec, submodules=sub)


def gpt_model_provider(
    config: Any,
    layer_spec: Any,
    *,
    vocab_size: int,
    max_sequence_length: int,
    use_transformer_engine: bool = False,
    **gpt_kwargs: Any,
) -> Callable[..., torch.nn.Module]:
    """A Megatron-LM style ``model_provider(pre_process, post_process, vp_stage=None)``.

    It builds ``GPTModel(config, layer_spec, ...)``, with the MTP block spec when
    ``config.mtp_num_layers`` is set (None on the ranks that hold no MTP layer;
    ``use_transformer_engine`` says which modules the layer spec uses); ``gpt_kwargs``
    go to GPTModel (``position_embedding_type``, ``share_embeddings_and_output_weights``, ...).
    """

    def model_provider(
        pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None
    ) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel

        mtp_spec = None
        if getattr(config, "mtp_num_layers", None):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp_spec = get_gpt_mtp_block_spec(
                config, layer_spec, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage
            )
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            mtp_block_spec=mtp_spec,
            **gpt_kwargs,
        )

    return model_provider


def build_model(
    model_provider: Callable[..., torch.nn.Module],
    config: Any,
    ddp_config: Any,
    *,
    model_hook: Callable[[torch.nn.Module], None] | None = None,
    wrapper: Callable[..., torch.nn.Module] | None = None,
) -> list:
    """This rank's model chunks, one per virtual pipeline stage, wrapped in Megatron DDP (or
    ``wrapper``, such as Megatron-FSDP's ``FullyShardedDataParallel``, with the same arguments).

    ``model_provider`` is called with this rank's ``pre_process``/``post_process``/``vp_stage``;
    ``model_hook`` sees each bare chunk before the wrap (e.g. LoRA adapters, which must exist
    before DDP allocates grad buffers for the trainable parameters). On a GPU run the chunks
    move to the current CUDA device (under ``cpu_compat`` they stay on the CPU); with
    ``config.bf16`` each goes into ``Float16Module`` as Megatron-LM's ``--bf16`` does. Sets
    ``config.finalize_model_grads_func`` and, with ``overlap_grad_reduce``, the sync functions
    the way Megatron-LM's training loop does.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        vp = vp_stage if vpp else None
        model = model_provider(
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
        )
        if model_hook is not None:
            model_hook(model)
        if torch.cuda.is_available() and not is_cpu_mode():
            model.cuda(torch.cuda.current_device())
        if config.bf16:
            model = Float16Module(config, model)
        # As Megatron-LM: only the first chunk's buffer is split into buckets.
        chunks.append(
            (wrapper or DistributedDataParallel)(
                config, ddp_config, model, disable_bucketing=vp_stage > 0
            )
        )
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in chunks]
        grad_sync = [chunk.start_grad_sync for chunk in chunks]
        config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(chunks) == 1 else grad_sync
    return chunks


# -- one step -------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class StepResult:
    """What one training step returns."""

    reports: list
    """What the ``forward_backward_func`` returned (per micro-batch reports on the loss stage)."""
    grad_norm: float | None = None
    """The optimizer's gradient norm before clipping, over all shards (None without a step)."""
    forward_backward_s: float | None = None
    """Seconds in the schedule call, device work included (only when asked for)."""


def train_step(
    schedule: Callable[..., Any],
    forward_step: Callable,
    chunks: Sequence[torch.nn.Module],
    microbatches: Sequence[dict],
    optimizer: Any = None,
    *,
    seq_length: int,
    micro_batch_size: int,
    timed: bool = False,
) -> StepResult:
    """One training step over this rank's micro-batches: zero the gradients, run ``schedule``
    (a ``forward_backward_func``: the plugin's or Megatron's), every model chunk (virtual
    pipeline stage) reading all micro-batches, then ``optimizer.step()``.

    Without an ``optimizer`` the step stops after the backward pass (and Megatron's
    ``finalize_model_grads``), for a caller that reads the gradients first. ``timed`` measures
    the schedule call, synchronizing the device before and after it (never inside it).
    """
    for chunk in chunks:
        chunk.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()
    iterators = [iter(microbatches) for _ in chunks]
    start = _synced_clock() if timed else 0.0
    reports = schedule(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=list(chunks) if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    result = StepResult(reports=reports)
    if timed:
        result.forward_backward_s = _synced_clock() - start
    if optimizer is not None:
        # Megatron's optimizer returns the norm as a Python float already (it syncs to clip).
        _, grad_norm, _ = optimizer.step()
        result.grad_norm = None if grad_norm is None else float(grad_norm)
    return result


def _synced_clock() -> float:
    if torch.cuda.is_available() and not is_cpu_mode():
        torch.cuda.synchronize()
    return time.perf_counter()
