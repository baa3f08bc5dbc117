"""The data-parallel wrappers Megatron-Core ships, and what the step may rely on in each.

The step relies on a wrapper twice: its gradient reduction averages over data x context
parallelism as Megatron DDP's does (``megatron_compat.undo_averaging`` undoes it), and its
``scale_gradients`` multiplies the step's gradients (Megatron's per-token division in
``finalize_model_grads``, and the scale after the schedule of ``mask_in_loss``). Megatron's base
class ``_BaseDataParallel`` declares ``scale_gradients`` as a no-op, and a wrapper that does not
override it leaves the gradient silently unscaled.

So a wrapper is served only where the gradient oracle proved it exact (:data:`WRAPPERS`, the
same at megatron-core 0.16 through 0.19, docs/limits.md): :func:`wrapper_problem` refuses any
other ``_BaseDataParallel``, and any whose ``scale_gradients`` is the base class's no-op; and
:func:`scale_gradients` checks, until it has seen it once, that a wrapper's scale changed a
sample of the gradient by the factor (:func:`agree_scale_seen` makes that verdict every rank's).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.process_groups import max_over

#: What to use instead of a refused wrapper.
INSTEAD = (
    "use Megatron DDP (megatron.core.distributed.DistributedDataParallel, Megatron-LM's "
    "default; --use-distributed-optimizer works) or Megatron-FSDP (--use-megatron-fsdp)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Wrapper:
    """A data-parallel wrapper Megatron ships, by its class's full name."""

    qualname: str
    """``module.Class`` as Megatron defines it."""
    flag: str
    """How Megatron-LM selects it."""
    refusal: str | None = None
    """Why the plugin refuses it; None: proven exact by the gradient oracle."""
    unproven: Callable[[Any], str | None] | None = None
    """Why this chunk's settings at the installed release are not proven (None: they are)."""


#: Megatron-FSDP's sharding strategies and the megatron-core series (major, minor) at which the
#: gradient oracle proved each exact (tests/test_hard_layouts.py::test_data_parallel_wrappers).
#: ``no_shard`` misses at 0.16.1 and 0.17.1 by a relative L2 of about 1, stock Megatron alike.
MEGATRON_FSDP_PROVEN: dict[str, frozenset[tuple[int, int]]] = {
    "no_shard": frozenset({(0, 18), (0, 19)}),
    "optim": frozenset({(0, 16), (0, 17), (0, 18), (0, 19)}),
    "optim_grads": frozenset({(0, 16), (0, 17), (0, 18), (0, 19)}),
    "optim_grads_params": frozenset({(0, 16), (0, 17), (0, 18), (0, 19)}),
}


def _megatron_fsdp_unproven(chunk: Any) -> str | None:
    from megatron_lossfix.step.megatron_compat import megatron_core_version

    config = getattr(chunk, "ddp_config", None)
    strategy = getattr(config, "data_parallel_sharding_strategy", None)
    version = megatron_core_version()
    if version.release[:2] in MEGATRON_FSDP_PROVEN.get(strategy, ()):
        return None
    proven = sorted(
        s for s, series in MEGATRON_FSDP_PROVEN.items() if version.release[:2] in series
    )
    instead = f"--data-parallel-sharding-strategy {proven[-1]}, or " if proven else ""
    return (
        f"Megatron-FSDP with data_parallel_sharding_strategy={strategy!r} is not proven exact "
        f"at megatron-core {version}; use {instead}Megatron DDP (--use-distributed-optimizer "
        "works)"
    )


#: Every data-parallel wrapper of megatron-core 0.16-0.19 (Megatron-FSDP v2 is on Megatron-LM's
#: main branch only, and not in this table: refused as unknown).
WRAPPERS: tuple[Wrapper, ...] = (
    Wrapper(
        "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel",
        "Megatron DDP (default; --use-distributed-optimizer, --overlap-grad-reduce)",
    ),
    Wrapper(
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel",
        "--use-megatron-fsdp",
        unproven=_megatron_fsdp_unproven,
    ),
    Wrapper(
        "megatron.core.distributed.torch_fully_sharded_data_parallel.TorchFullyShardedDataParallel",
        "--use-torch-fsdp2",
        refusal=(
            "torch FSDP2 (TorchFullyShardedDataParallel, --use-torch-fsdp2) does not override "
            "Megatron's no-op scale_gradients, so Megatron's per-token division and the "
            "plugin's scale leave its gradients unscaled, and its averaging is unproven"
        ),
    ),
)
_BY_NAME = {w.qualname: w for w in WRAPPERS}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def known_wrapper(chunk: Any) -> Wrapper | None:
    """The table's entry for ``chunk``'s class or its nearest listed base class."""
    for cls in type(chunk).__mro__:
        if _qualname(cls) in _BY_NAME:
            return _BY_NAME[_qualname(cls)]
    return None


def _scale_is_noop(chunk: Any) -> bool:
    """Whether ``chunk.scale_gradients`` (bound by its class or set on the instance, as the
    Megatron-FSDP adapter does) is ``_BaseDataParallel``'s no-op."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    method = getattr(chunk, "scale_gradients", None)
    return getattr(method, "__func__", method) is _BaseDataParallel.scale_gradients


def wrapper_problem(chunks: list) -> str | None:
    """Why the step cannot rely on these chunks' data-parallel wrapper (one line naming what to
    use instead), or None: bare modules (``megatron_compat.unreduced_gradients`` refuses them
    where DP x CP > 1) and the proven wrappers of :data:`WRAPPERS`."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    for chunk in chunks:
        if not isinstance(chunk, _BaseDataParallel):
            continue
        name = type(chunk).__name__
        if _scale_is_noop(chunk):
            return (
                f"the model's wrapper {name} keeps _BaseDataParallel's no-op scale_gradients, "
                "so Megatron's per-token division and the plugin's scale would leave the "
                f"gradients unscaled; {INSTEAD}"
            )
        entry = known_wrapper(chunk)
        if entry is None:
            return (
                f"the model's wrapper {name} is not one whose gradient averaging and "
                f"scale_gradients the plugin has proven; {INSTEAD}"
            )
        if entry.refusal is not None:
            return f"{entry.refusal}; {INSTEAD}"
        if entry.unproven is not None and (problem := entry.unproven(chunk)) is not None:
            return problem
    return None


# ----------------------------------------------------------------- scales seen to work
#: Chunks whose ``scale_gradients`` the step has seen scale their gradients.
_SEEN: weakref.WeakSet = weakref.WeakSet()
#: Elements sampled from the start of each gradient (a few per parameter: one small tensor).
_SAMPLE = 8


def _grads(chunk: Any) -> list[torch.Tensor]:
    """This rank's gradient tensors of ``chunk`` (``main_grad`` else ``grad``; a sharded
    DTensor's local shard)."""
    grads = []
    for param in chunk.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel():
            grads.append(local)
    return grads


def _sample(grads: list[torch.Tensor]) -> torch.Tensor | None:
    if not grads:
        return None
    return torch.cat([g.detach().reshape(-1)[:_SAMPLE].double() for g in grads])


def scale_gradients(chunks: list, factor: float) -> int:
    """Multiply the step's gradients by ``factor`` after Megatron's schedule, as
    ``finalize_model_grads`` does on the per-token path: through the wrapper's
    ``scale_gradients`` (its gradient buffers), else each parameter's ``main_grad`` or ``grad``.

    Returns this rank's verdict on the wrappers not yet seen to work (a host sync, only then):
    0 nothing to judge (all seen, or a zero sample), 1 the scale worked, 2 it left the sampled
    gradient unchanged. Pass it to :func:`agree_scale_seen` on every rank."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    verdict = 0
    for chunk in chunks:
        if not isinstance(chunk, _BaseDataParallel):
            for grad in _grads(chunk):
                grad.mul_(factor)
            continue
        before = None if chunk in _SEEN else _sample(_grads(chunk))
        chunk.scale_gradients(factor)
        if before is None or not bool(before.abs().amax() > 0):
            continue
        after = _sample(_grads(chunk))
        scaled = after is not None and torch.allclose(after, before * factor, rtol=1e-5, atol=0)
        verdict = max(verdict, 1 if scaled else 2)
    return verdict


def unseen(chunks: list) -> bool:
    """Whether a wrapper of ``chunks`` has not yet been seen to scale (the same on every rank
    of a step: :func:`agree_scale_seen` decides it for all)."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    return any(isinstance(c, _BaseDataParallel) and c not in _SEEN for c in chunks)


def agree_scale_seen(chunks: list, verdict: int, groups: list) -> str | None:
    """Every rank's verdict (:func:`scale_gradients`), the worst over ``groups`` (named groups,
    together spanning the ranks of the model): why the scale cannot be relied on (on every
    rank), else None; the chunks count as seen once some rank saw the scale work."""
    worst = verdict
    if dist.is_initialized():
        from megatron_lossfix.step.agreement import default_device

        worst = int(max_over([float(verdict)], default_device(), *groups)[0])
    if worst == 2:
        names = sorted({type(c).__name__ for c in chunks})
        return (
            f"the model's wrapper {', '.join(names)} left the gradients unchanged when asked "
            f"to scale them (scale_gradients), so the step's gradient would be wrong; {INSTEAD}"
        )
    if worst == 1:
        _SEEN.update(chunks)
    return None
