"""Run Megatron-LM's training loop (``pretrain()`` in ``megatron/training``) without CUDA.

What Megatron-LM's training package needs beyond the Megatron-Core CPU mode
(:mod:`megatron_lossfix.cpu_compat`). Our Megatron-LM patch calls
:func:`enable_cpu_megatron_lm` (through :mod:`megatron_lossfix.integrations.megatron_lm`) before
``pretrain()``; on a machine with CUDA it does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_lossfix.cpu_compat import enable_cpu_megatron, with_one_device

__all__ = ["enable_cpu_megatron_lm"]

_CPU_LM_ENABLED = False


def _preserving_cpu_rng(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` run without advancing the CPU random generator."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return func(*args, **kwargs)

    return wrapper


def enable_cpu_megatron_lm() -> bool:
    """Run Megatron-LM's ``pretrain()`` without CUDA; a no-op (returns False) when CUDA exists.

    Beyond :func:`~megatron_lossfix.cpu_compat.enable_cpu_megatron` (device literals, streams,
    RNG) Megatron-LM's training package needs: ``initialize_megatron`` asserts CUDA unless
    ``allow_no_cuda``; ``_initialize_distributed`` and ``_set_random_seed`` build the
    model-parallel groups and seed the RNG tracker only when ``torch.cuda.device_count() > 0``;
    ``fused_kernels.load`` builds CUDA kernels with nvcc; the JIT warm-up consumes the CPU
    generator that CPU initialization uses next.
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
    # The JIT warm-up draws random inputs shaped by --micro-batch-size from the "CUDA" generator,
    # which is the CPU one here, and CPU initialization draws the weights from it next: without
    # this, the initial weights would depend on the micro-batch size.
    wrap(initialize, "_warmup_jit_function", _preserving_cpu_rng)
    # Argument validation asks for the GPU architecture (queries CUDA): none, on CPU.
    for module_name in ("megatron.training.arguments", "megatron.training.utils"):
        wrap(importlib.import_module(module_name), "get_device_arch_version", lambda f: lambda: 0)
    # The legacy fused softmax kernels are CUDA sources built with nvcc; unused on CPU.
    try:
        from megatron.legacy import fused_kernels
    except ImportError:  # gone in newer Megatron-LM
        fused_kernels = None
    wrap(fused_kernels, "load", lambda f: lambda args: None)
    _CPU_LM_ENABLED = True
    return True
