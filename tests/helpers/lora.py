"""LoRA for Megatron-Core: frozen base weights, trainable low-rank adapters on the parallel linears.

``apply_lora(model)`` freezes every parameter of a GPTModel (chunk) and wraps each targeted
``ColumnParallelLinear`` / ``RowParallelLinear`` so that

    output = base(x) + (alpha / rank) * B(A(x))        (A: [rank, in], B: [out, rank])

with the same ``(output, bias)`` return convention as the base. Call it *before* wrapping the
model in Megatron's ``DistributedDataParallel``: DDP allocates grad buffers only for parameters
that require grad, so the frozen base then has no ``main_grad`` and costs no gradient memory or
communication.

Tensor parallelism. Each adapter keeps the base layer's sharding, and its sharded factor is itself
a Megatron parallel linear (so TP communication, sequence parallelism, ``gather_output`` /
``input_is_parallel``, the TP attributes and the distributed-checkpoint sharding are Megatron's):

- column-parallel base (output sharded): A is replicated on every TP rank, B is a
  ``ColumnParallelLinear`` sharded on the output dim like the base. B's input gradient (dA's
  upstream) is all-reduced over TP by that linear, so dA is complete and identical on every TP
  rank, and the adapter's contribution to dx is complete too.
- row-parallel base (input sharded): A is a ``RowParallelLinear`` sharded on the input dim, whose
  partial products are all-reduced over TP (``reduce_from_tensor_model_parallel_region``), B is
  replicated and sees the same reduced activations and output gradient on every TP rank.

So the replicated factor's gradient needs no TP reduction and, like any replicated Megatron
parameter, it is marked ``tensor_model_parallel=False`` (the grad norm counts it once). Under
sequence parallelism it only sees this rank's slice of the sequence, so it is marked
``sequence_parallel=True`` and ``finalize_model_grads`` sums its gradient over TP, as it does for
LayerNorm weights.

Not supported (a clear error instead of silently wrong gradients): Transformer Engine linears,
expert linears with expert-TP > 1 (their communication is done by the token dispatcher),
``disable_grad_reduce`` and weight-less (``skip_weight_param_allocation``) linears.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule

__all__ = [
    "DEFAULT_TARGETS",
    "LoRAColumnParallelLinear",
    "LoRALinear",
    "LoRARowParallelLinear",
    "apply_lora",
    "lora_parameters",
]

DEFAULT_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Attention QKV and output projections, MLP (and expert) fc1 and fc2."""


def _zeros(tensor: torch.Tensor) -> torch.Tensor:
    # The init method handed to Megatron's linear: deterministic and RNG-free (the RNG tracker
    # is not touched); the factors are then initialized by `_init_adapter`.
    with torch.no_grad():
        return tensor.zero_()


def _tp_size(linear: torch.nn.Module) -> int:
    return linear.tp_group.size() if linear.tp_group is not None else 1


class LoRALinear(MegatronModule):
    """Base of the adapter wrappers: ``base`` (frozen), ``lora_A``, ``lora_B``, ``scaling``.

    Attributes the wrapper does not have are looked up on ``base`` (Megatron code reaches into its
    linears, e.g. ``linear_qkv.weight``).
    """

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float) -> None:
        super().__init__(base.config)
        self.base = base
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        # MegatronModule.sharded_state_dict uses it for the replicated factor.
        self.tp_group = base.tp_group

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base":  # not registered yet: do not recurse
                raise
            return getattr(self.base, name)

    def backward_dw(self) -> None:
        """Delayed weight-gradient hook of Megatron's linears (a no-op for the local ones)."""
        for module in (self.base, self.lora_A, self.lora_B):
            if hasattr(module, "backward_dw"):
                module.backward_dw()

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


def _replicated_factor(
    in_features: int, out_features: int, like: torch.nn.Parameter, sequence_parallel: bool
) -> torch.nn.Linear:
    """A replicated (not TP-sharded) bias-free factor with Megatron's parameter attributes."""
    linear = torch.nn.Linear(
        in_features, out_features, bias=False, device=like.device, dtype=like.dtype
    )
    weight = linear.weight
    set_defaults_if_not_set_tensor_model_parallel_attributes(weight)
    # Expert weights under EP are reduced over the expert-DP group, not the DP group: DDP reads
    # `allreduce` to put them into the expert buffers.
    weight.allreduce = getattr(like, "allreduce", True)
    if sequence_parallel:
        # Sees only this rank's sequence slice: finalize_model_grads sums it over TP.
        weight.sequence_parallel = True
    return linear


@torch.no_grad()
def _uniform_full(shape: tuple[int, int], fan_in: int, like: torch.Tensor) -> torch.Tensor:
    """PEFT's A init (kaiming_uniform with a=sqrt(5): U(+-1/sqrt(fan_in))) over the *full* factor,
    drawn from the default CPU generator as Megatron's ``use_cpu_initialization`` does, so that
    every layout gets the same values for the same seed."""
    bound = 1.0 / math.sqrt(fan_in)
    full = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound)
    return full.to(device=like.device, dtype=like.dtype)


class LoRAColumnParallelLinear(LoRALinear):
    """LoRA around a ``ColumnParallelLinear``: A replicated ``[rank, in]``, B sharded like the
    base on the output dim (a ``ColumnParallelLinear`` ``rank -> out``)."""

    def __init__(self, base: ColumnParallelLinear, rank: int, alpha: float) -> None:
        super().__init__(base, rank, alpha)
        sequence_parallel = bool(base.sequence_parallel)
        self.lora_A = _replicated_factor(base.input_size, rank, base.weight, sequence_parallel)
        self.lora_B = ColumnParallelLinear(
            rank,
            base.output_size,
            config=base.config,
            init_method=_zeros,
            bias=False,
            gather_output=base.gather_output,
            stride=getattr(base.weight, "partition_stride", 1),
            skip_bias_add=True,
            is_expert=base.is_expert,
            tp_group=base.tp_group,
        )
        self._init_adapter()

    @torch.no_grad()
    def _init_adapter(self) -> None:
        fan_in = self.base.input_size
        full = _uniform_full((self.rank, fan_in), fan_in, self.base.weight)
        group = self.base.tp_group
        if _tp_size(self.base) > 1:
            # A is replicated: TP ranks must hold the same values even when their default
            # generators drifted apart (nothing would ever bring them back together).
            dist.broadcast(full, src=dist.get_global_rank(group, 0), group=group)
        self.lora_A.weight.copy_(full)
        self.lora_B.weight.zero_()  # LoRA starts as the identity: output == base(x)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, output_bias = self.base(input_, weight, runtime_gather_output)
        # A on this rank's copy of the input (under SP: its sequence slice). lora_B's backward
        # all-reduces (reduce-scatters under SP) dh over TP, as the base does for dx, so dA and
        # the adapter's share of dx are complete.
        hidden = self.lora_A(input_)
        delta, _ = self.lora_B(hidden, runtime_gather_output=runtime_gather_output)
        return output + self.scaling * delta, output_bias


class LoRARowParallelLinear(LoRALinear):
    """LoRA around a ``RowParallelLinear``: A sharded like the base on the input dim (a
    ``RowParallelLinear`` ``in -> rank`` that all-reduces its partial products), B replicated
    ``[out, rank]``."""

    def __init__(self, base: RowParallelLinear, rank: int, alpha: float) -> None:
        super().__init__(base, rank, alpha)
        self.lora_A = RowParallelLinear(
            base.input_size,
            rank,
            config=base.config,
            init_method=_zeros,
            bias=False,
            input_is_parallel=base.input_is_parallel,
            skip_bias_add=True,
            stride=getattr(base.weight, "partition_stride", 1),
            is_expert=base.is_expert,
            tp_group=base.tp_group,
        )
        sequence_parallel = bool(base.sequence_parallel) and _tp_size(base) > 1
        self.lora_B = _replicated_factor(rank, base.output_size, base.weight, sequence_parallel)
        self._init_adapter()

    @torch.no_grad()
    def _init_adapter(self) -> None:
        fan_in = self.base.input_size
        full = _uniform_full((self.rank, fan_in), fan_in, self.base.weight)
        shards = full.chunk(_tp_size(self.base), dim=1)
        self.lora_A.weight.copy_(shards[self.base.tp_group.rank()])
        self.lora_B.weight.zero_()  # replicated and zero: identical on every TP rank

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, output_bias = self.base(input_)
        # Partial products of the sharded A are all-reduced over TP (forward), the gradient is
        # passed through unchanged (backward): the same reduction as the base's output.
        hidden, _ = self.lora_A(input_)
        return output + self.scaling * self.lora_B(hidden), output_bias


def _check_supported(name: str, module: torch.nn.Module) -> None:
    if getattr(module, "weight", None) is None:
        raise NotImplementedError(f"{name}: LoRA needs the linear to own its weight")
    if getattr(module, "disable_grad_reduce", False):
        # The adapter's replicated A would get a partial (per-TP-rank) gradient.
        raise NotImplementedError(f"{name}: LoRA does not support disable_grad_reduce")
    if getattr(module, "explicit_expert_comm", False) and _tp_size(module) > 1:
        # The dispatcher, not the linear, reduces over expert-TP: A's gradient would be partial.
        raise NotImplementedError(f"{name}: LoRA on expert linears needs expert-TP size 1")


def apply_lora(
    model: torch.nn.Module,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Iterable[str] = DEFAULT_TARGETS,
) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the targeted linears with LoRA adapters.

    A module is targeted when the last component of its name is in ``targets``; it must be a
    Megatron ``ColumnParallelLinear`` or ``RowParallelLinear`` (parameter-less placeholders such
    as ``IdentityOp`` are skipped). A is initialized as in PEFT (uniform, +-1/sqrt(in_features)),
    B to zero, so the wrapped model initially computes exactly what the base does.

    Call on each model chunk (GPTModel, one per virtual pipeline stage) before Megatron DDP.
    Collective over the tensor-parallel group (replicated factors are broadcast from TP rank 0).
    Returns the names of the wrapped modules, in ``named_modules`` order.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    targets = frozenset(targets)
    if not targets:
        raise ValueError("no LoRA targets given")
    params = list(model.parameters())
    if any(hasattr(p, "main_grad") for p in params) or hasattr(model, "ddp_config"):
        # DDP already allocated grad buffers for the base weights; adapters added now get none.
        raise ValueError("apply_lora must be called before wrapping the model in Megatron DDP")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("model already has LoRA adapters")

    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            _check_supported(name, module)
            found.append((name, module))
        elif any(True for _ in module.parameters()):
            raise NotImplementedError(
                f"{name}: LoRA supports Megatron's ColumnParallelLinear / RowParallelLinear "
                f"(local layer spec), not {type(module).__name__}"
            )
    if not found:
        raise ValueError(f"no module of the model matches the LoRA targets {sorted(targets)}")

    for param in params:  # before the adapters exist: they stay trainable
        param.requires_grad_(False)
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        cls = (
            LoRAColumnParallelLinear
            if isinstance(module, ColumnParallelLinear)
            else LoRARowParallelLinear
        )
        setattr(parent, child, cls(module, rank, alpha))
    return [name for name, _ in found]


def lora_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter parameters (``lora_A`` / ``lora_B`` weights) of ``model``, by name."""
    return [
        (name, param)
        for name, param in model.named_parameters()
        if ".lora_A." in f".{name}" or ".lora_B." in f".{name}"
    ]
