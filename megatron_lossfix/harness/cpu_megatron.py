"""Run stock Megatron-Core on a machine without a GPU (CPU tensors, gloo process groups).

Megatron-Core hard-codes CUDA in code paths that have nothing to do with the math: device
literals (`torch.zeros([], device="cuda")` in every pipeline schedule,
`device=torch.cuda.current_device()` in p2p communication and the DDP grad buffers), stream and
event bookkeeping, and CUDA RNG states. None of it changes what is computed, so on a CPU-only
machine we bridge it instead of forking Megatron: the test suite and the example scripts then run
the real GPTModel, pipeline schedules, DDP and `finalize_model_grads` (docs/design.md §7).

`enable_cpu_megatron()` is a no-op on a machine with CUDA unless forced. Everything it does is
process-global and irreversible; call it once at start-up, before building models.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: TorchFunctionMode | None = None

#: Megatron-Core warnings that say nothing new after the first time: each module that has a fused
#: kernel or a Transformer Engine / Apex path warns about its fallback once per process, so a
#: 2-rank run prints ~14 of them; and the cuda_graph_scope default warns per model config. One
#: pattern, one group: a group is shown once per run, on global rank 0, as Megatron worded it.
_REPEATED_WARNINGS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("fallback", re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")),
    ("cuda_graph_scope", re.compile(r"full scope is deprecated")),
)
_shown_groups: set[str] = set()
_original_showwarning: Any = None


def is_cpu_mode() -> bool:
    """True once `enable_cpu_megatron` has bridged this process to CPU."""
    return _ENABLED


def _is_cuda_device(device: Any) -> bool:
    # An int device means "index on the current accelerator" to torch; on this path it can only
    # come from our `torch.cuda.current_device()` stand-in. `bool` is an int subclass: not a device.
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every CUDA device argument to CPU and makes `Tensor.cuda()` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The optimizer wrappers and grad clipping accept only 'torch.cuda.*Tensor' names.
            name = func(*args)
            on_cpu = args[0].device.type == "cpu"
            return name.replace("torch.", "torch.cuda.", 1) if on_cpu else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to:
            # `.to(device)` / `.to(device, dtype)` pass the device positionally.
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _Stream:
    """Stand-in for torch.cuda.Stream: CPU work is synchronous, so every wait is already met."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    """Stand-in for torch.cuda.Event (see `_Stream`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _Stream()


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, and must not re-enter here.
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    """CUDA runtime calls Megatron makes for bookkeeping; on a CPU build they raise."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.is_current_stream_capturing = lambda: False
    # Megatron's "CUDA" RNG streams are the ones its dropout draws from: on CPU that is the
    # CPU default generator, so the tracker must save and restore that one.
    cuda.get_rng_state = cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda state, device="cuda": (
        torch.set_rng_state(state)
    )
    cuda.manual_seed = cuda.random.manual_seed = _cpu_manual_seed


def _run_backward_in_mode(mode: TorchFunctionMode) -> None:
    """Keep the device mode active inside the autograd engine.

    `torch.autograd.backward` itself dispatches through the mode, and a mode is popped while its
    handler runs, so the whole backward pass (Megatron's custom-Function backwards allocate with
    `device=torch.cuda.current_device()`) would otherwise run without it.
    """
    run = torch.autograd._engine_run_backward

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        if mode in torch.overrides._get_current_function_mode_stack():
            return run(*args, **kwargs)
        with mode:
            return run(*args, **kwargs)

    torch.autograd._engine_run_backward = run_backward


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mpu_random
    from megatron.core.transformer.moe import moe_utils

    # These two reach into torch.cuda.default_generators / lazy CUDA init directly; the rest of
    # the tracker (add, fork, model_parallel_cuda_manual_seed) goes through them or through the
    # torch.cuda RNG functions patched above.
    mpu_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mpu_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )
    # With the CUDA and CPU generators now the same, the tracker's "CPU RNG state changed within
    # GPU RNG context" warning fires on every forked draw and means nothing.
    logging.getLogger(mpu_random.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )
    # Without Transformer Engine this name is referenced (router gemm) but never bound.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _show_repeated_once(message, category, filename, lineno, file=None, line=None) -> None:
    text = str(message)
    group = next((name for name, pattern in _REPEATED_WARNINGS if pattern.search(text)), None)
    if group is None:
        _original_showwarning(message, category, filename, lineno, file, line)
        return
    if group in _shown_groups:
        return
    _shown_groups.add(group)
    if _is_rank0():
        note = " (shown once per run; megatron_lossfix hides the repeats)"
        _original_showwarning(text + note, category, filename, lineno, file, line)


def quiet_repeated_megatron_warnings() -> None:
    """Show Megatron-Core's repeated fallback warnings once per run instead of once per module
    and rank: "Transformer Engine and Apex are not installed ...", "Apex is not installed ..."
    and the ``cuda_graph_scope`` default's deprecation. The first of each kind is shown on
    global rank 0 (``RANK`` before ``torch.distributed`` starts), worded as Megatron wrote it;
    every other warning is shown as before. Idempotent; call it before importing Megatron to
    catch the import-time ones. ``-W error`` and other warning filters still apply first.
    """
    global _original_showwarning
    if _original_showwarning is not None:
        return
    _original_showwarning = warnings.showwarning
    warnings.showwarning = _show_repeated_once


def enable_cpu_megatron(force: bool = False) -> bool:
    """Bridge Megatron-Core's CUDA-only code paths to CPU for this process.

    Active only when CUDA is unavailable, or when `force` is True. Idempotent. Returns True when
    the process runs in CPU mode after the call, False on a GPU run (where nothing is changed).
    """
    global _ENABLED, _MODE
    if _ENABLED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    # Transformer Engine and Apex need CUDA: on CPU their fallback warnings are certain and
    # repeat per module and rank.
    quiet_repeated_megatron_warnings()
    _patch_torch_cuda()
    _patch_megatron()
    # Installed for the rest of the process, never exited: schedules and buffers allocate on
    # "cuda" at any time, including from autograd hooks.
    _MODE = _CudaToCpuMode()
    _run_backward_in_mode(_MODE)
    _MODE.__enter__()
    _ENABLED = True
    return True


def with_one_device(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` run while ``torch.cuda.device_count()`` reports one device.

    Megatron-LM's and Megatron Bridge's initialization build the model-parallel groups and seed
    the RNG tracker only when that count is positive; on CPU our one stand-in device is the CPU.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            return func(*args, **kwargs)
        finally:
            torch.cuda.device_count = device_count

    return wrapper
