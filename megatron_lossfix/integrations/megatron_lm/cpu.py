"""Run Megatron-LM's training loop (``pretrain()`` in ``megatron/training``) without CUDA.

What Megatron-LM's training package needs beyond the Megatron-Core CPU mode
(:mod:`megatron_lossfix.harness.cpu_megatron`), for ``pretrain_gpt.py`` and for the training step of
``train_rl.py`` (its rollout generation needs the GPU inference engine and stays out of reach).
Our Megatron-LM patches call :func:`enable_cpu_megatron_lm` before ``pretrain()``; on a machine
with CUDA it does nothing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from megatron_lossfix.harness.cpu_megatron import enable_cpu_megatron, with_one_device

__all__ = ["enable_cpu_megatron_lm"]

_CPU_LM_ENABLED = False


def enable_cpu_megatron_lm() -> bool:
    """Run Megatron-LM's ``pretrain()`` without CUDA; a no-op (returns False) when CUDA exists.

    Beyond :func:`~megatron_lossfix.harness.cpu_megatron.enable_cpu_megatron` (device literals,
    streams, RNG) Megatron-LM's training package needs: ``initialize_megatron`` asserts CUDA unless
    ``allow_no_cuda``; ``_initialize_distributed`` and ``_set_random_seed`` build the
    model-parallel groups and seed the RNG tracker only when ``torch.cuda.device_count() > 0``;
    ``fused_kernels.load`` builds CUDA kernels with nvcc; the JIT warm-up compiles CUDA fusion
    kernels (on CPU it only costs seconds per rank, and draws from the generator that CPU
    initialization uses next).
    Call it before ``pretrain()``; idempotent.
    """
    global _CPU_LM_ENABLED
    if not enable_cpu_megatron():
        return False
    if _CPU_LM_ENABLED:
        return True
    import importlib

    from megatron.training import initialize, training

    def wrap(module: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
        # Names differ across Megatron-LM versions: bridge the ones this checkout has.
        if hasattr(module, name):
            setattr(module, name, wrapper(getattr(module, name)))

    wrap(training, "initialize_megatron", lambda f: functools.partial(f, allow_no_cuda=True))
    # Both functions skip model-parallel setup (process groups, the RNG tracker's seeds) when
    # torch.cuda.device_count() is 0; inside them, our one stand-in "device" is the CPU.
    wrap(initialize, "_initialize_distributed", with_one_device)
    wrap(initialize, "_set_random_seed", with_one_device)
    # The JIT warm-up compiles CUDA fusion kernels ahead of the first step: nothing to warm up on
    # CPU (a function the step uses compiles when first called). It would also draw random inputs
    # shaped by --micro-batch-size from the "CUDA" generator, the CPU one here, which CPU
    # initialization draws the weights from next.
    wrap(initialize, "_warmup_jit_function", lambda f: lambda *args, **kwargs: None)
    # Argument validation asks for the GPU architecture (queries CUDA): none, on CPU.
    for module_name in ("megatron.training.arguments", "megatron.training.utils"):
        wrap(importlib.import_module(module_name), "get_device_arch_version", lambda f: lambda: 0)
    # The legacy fused softmax kernels are CUDA sources built with nvcc; unused on CPU.
    try:
        from megatron.legacy import fused_kernels
    except ImportError:  # gone in newer Megatron-LM
        fused_kernels = None
    wrap(fused_kernels, "load", lambda f: lambda args: None)
    _enable_rl_training_step()
    _CPU_LM_ENABLED = True
    return True


def _enable_rl_training_step() -> None:
    """What the training step of Megatron-LM's ``train_rl.py`` needs beyond ``pretrain_gpt.py``.

    - Its forward pass always hands attention ``qkv_format='thd'`` packed-sequence parameters
      (one segment per row without sequence packing, one per packed sequence with it), which
      Megatron's local ``DotProductAttention`` rejects: on CPU it attends within each
      ``cu_seqlens`` segment, causally, exactly what Transformer Engine computes there.
    - ``rl_utils.get_logprobs`` passes ``fp32_output=`` to the model, which only
      ``Float16Module`` takes (and consumes); an fp32 model on CPU has no ``Float16Module``, and
      its output already is fp32, so ``GPTModel.forward`` drops the keyword.
    - The RL code marks NVTX ranges (``get_nvtx_range``), which a CPU-only torch build lacks:
      there they do nothing.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if getattr(DotProductAttention.forward, "_lossfix_thd", False):
        return
    # Megatron-LM's RL code marks NVTX ranges; a CPU-only torch build has none (they raise).
    from torch.cuda import nvtx

    try:
        nvtx.range_push("megatron_lossfix")
        nvtx.range_pop()
    except RuntimeError:
        nvtx.range_push = lambda msg: 0
        nvtx.range_pop = lambda: 0
    DotProductAttention.forward = _attend_per_segment(DotProductAttention.forward)
    GPTModel.forward = _without_fp32_output(GPTModel.forward)


def _attend_per_segment(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``DotProductAttention.forward`` that also takes ``thd`` packed-sequence parameters."""

    @functools.wraps(forward)
    def attend(self: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any,
               packed_seq_params: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            return forward(self, query, key, value, attention_mask, *args,
                           packed_seq_params=packed_seq_params, **kwargs)  # fmt: skip
        if query.dim() != 3:  # [t, heads, dim]: attention.py squeezes the dummy batch dimension
            raise ValueError(
                "megatron_lossfix (CPU): packed (thd) attention needs micro-batches of one row "
                f"(--micro-batch-size 1), got query {tuple(query.shape)}"
            )
        cu_q = packed_seq_params.cu_seqlens_q_padded
        cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        cu_kv = packed_seq_params.cu_seqlens_kv if cu_kv is None else cu_kv
        if not torch.equal(cu_q, cu_kv):
            raise ValueError("megatron_lossfix (CPU): packed attention needs cu_seqlens_q == _kv")
        bounds = [int(b) for b in cu_q.tolist()]
        total = query.shape[0]
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(
                f"megatron_lossfix (CPU): cu_seqlens {bounds} do not cover the {total} tokens"
            )
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end <= start:
                continue
            length = end - start
            causal = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
            out = forward(
                self,
                query[start:end].unsqueeze(1),
                key[start:end].unsqueeze(1),
                value[start:end].unsqueeze(1),
                causal.view(1, 1, length, length),
                *args,
                packed_seq_params=None,
                **kwargs,
            )
            outputs.append(out.squeeze(1))
        return torch.cat(outputs, dim=0)

    attend._lossfix_thd = True
    return attend


def _without_fp32_output(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``GPTModel.forward`` that ignores ``fp32_output=`` (see :func:`_enable_rl_training_step`)."""
    if "fp32_output" in inspect.signature(forward).parameters:
        return forward

    @functools.wraps(forward)
    def model_forward(self: Any, *args: Any, fp32_output: bool = True, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return model_forward
