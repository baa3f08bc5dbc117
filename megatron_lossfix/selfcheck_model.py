"""The self-check's side of the model and of the process groups.

:mod:`megatron_lossfix.selfcheck` runs a step twice, differently split, and compares the
gradients; these are the pieces it needs around the model: snapshot, restore and compare the
gradients (``main_grad`` under Megatron DDP, else ``.grad``; the distributed optimizer's shards
gathered back), save and restore the RNG states and registered buffers, tell from the
configuration whether the gradient depends on the split by design, pick the groups the check
communicates over, and make every rank reach the same decision (the same re-split plan, the
same flags).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.megatron_compat import StepGroups
from megatron_lossfix.reduction import group_size
from megatron_lossfix.resplit import ResplitPlan, resplit_plan

__all__ = [
    "SPLIT_DEPENDENT_MODES",
    "agree_flags",
    "broadcasts_batches",
    "plan_resplit",
    "why_not_checkable",
    "grad_of",
    "has_dropout",
    "model_chunks",
    "model_config_of",
    "module_buffers",
    "params_device",
    "relative_error",
    "replica_spread",
    "restore_grads",
    "rng_state",
    "set_rng_state",
    "snapshot_grads",
    "split_dependent_features",
    "trainable_params",
    "unshard_distributed_optimizer",
    "zero_grads",
]


def model_chunks(model: Any) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def trainable_params(chunks: list) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        for param in chunk.parameters():
            if id(param) not in seen and param.requires_grad:
                seen.add(id(param))
                out.append(param)
    return out


def unshard_distributed_optimizer(chunks: list) -> None:
    """The distributed optimizer leaves each DP rank only its reduce-scattered shard of every
    bucket; gather the shards back so that ``main_grad`` is the full gradient. The optimizer
    reads only this rank's shard, which this does not change."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.use_distributed_optimizer:
            continue
        groups = [
            *getattr(chunk, "bucket_groups", []),
            *getattr(chunk, "expert_parallel_bucket_groups", []),
        ]
        for bucket_group in groups:
            group = bucket_group.intra_distributed_optimizer_instance_group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            for bucket in bucket_group.buckets:
                views = shard_buffer(bucket.grad_data, size)
                dist.all_gather(views, views[rank].clone(), group=group)


def zero_grads(chunks: list) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()  # also resets DDP's per-step bucket state
        else:
            for param in chunk.parameters():
                grad = grad_of(param)
                if grad is not None:
                    grad.zero_()


def _counted(param: torch.nn.Parameter, tp_group: dist.ProcessGroup | None) -> bool:
    """Count each gradient element once over the model-parallel group, as Megatron's grad norm
    does: no TP-replicated copy but rank 0's, no tied-embedding copy."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False) or tp_group is None:
        return True
    return dist.get_rank(tp_group) == 0


def relative_error(
    params: list[torch.nn.Parameter], reference: list[torch.Tensor | None], groups: StepGroups
) -> float:
    """Relative L2 distance between the current gradient and ``reference`` over the whole model."""
    sums = {}
    for param, ref in zip(params, reference, strict=True):
        grad = grad_of(param)
        if ref is None or grad is None or not _counted(param, groups.tp):
            continue
        expert = not getattr(param, "allreduce", True)
        acc = sums.setdefault(expert, torch.zeros(2, dtype=torch.float64, device=grad.device))
        acc[0] += (grad.double() - ref.double()).square().sum()
        acc[1] += ref.double().square().sum()
    total = torch.zeros(2, dtype=torch.float64)
    for expert in (False, True):
        group = groups.expert_mp if expert else groups.mp
        acc = sums.get(expert)
        if acc is None:
            # Still take part in the collective: another rank of the group may hold such params.
            acc = torch.zeros(2, dtype=torch.float64, device=params_device(params))
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(acc, group=group)
        total += acc.cpu()
    diff, ref = total.tolist()
    return (diff**0.5) / max(ref**0.5, 1e-30) if ref > 0 else float(diff > 0)


def replica_spread(
    params: list[torch.nn.Parameter],
    grads: list[torch.Tensor | None],
    groups: StepGroups,
    device: torch.device,
) -> tuple[float, int]:
    """How far the gradient differs across the data x context-parallel replicas, which must all
    hold the same reduced gradient; and the index (into ``params``) of the parameter where it
    differs most (-1: none).

    One all-reduce (MAX) over that group of two checksums per dense parameter, the sum and the
    sum of squares of its gradient, each with its negation (so the maximum gives the minimum
    too). Expert parameters are replicated over the expert data-parallel group instead and are
    left out. The spread of a parameter is the largest of (spread of its sums) / (sqrt(numel) x
    its L2 norm) and (spread of its squared norms) / (its squared norm): relative, 0 when every
    replica holds the same gradient."""
    dense = [
        (i, grad)
        for i, (param, grad) in enumerate(zip(params, grads, strict=True))
        if grad is not None and getattr(param, "allreduce", True)
    ]
    if group_size(groups.dp_cp) <= 1 or not dense:
        return 0.0, -1
    sums = torch.stack(
        [torch.stack([g.double().sum(), g.double().square().sum()]) for _, g in dense]
    ).to(device)
    both = torch.cat([sums, -sums], dim=1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=groups.dp_cp)
    high, low = both[:, :2], -both[:, 2:]
    square = high[:, 1].clamp(min=1e-300)
    numel = torch.tensor([float(g.numel()) for _, g in dense], dtype=torch.float64, device=device)
    spread = torch.maximum(
        (high[:, 0] - low[:, 0]) / (numel.sqrt() * square.sqrt()),
        (high[:, 1] - low[:, 1]) / square,
    )
    worst = int(spread.argmax())
    return float(spread[worst]), dense[worst][0]


def params_device(params: list[torch.nn.Parameter]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


# ------------------------------------------------------------------------------ state


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        # get_states copies the dict; the tracker replaces (never mutates) its state tensors.
        state["tracker"] = get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001 - no tracker, nothing to restore
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "tracker" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def model_config_of(chunks: list) -> Any:
    try:
        from megatron.core.utils import get_model_config

        return get_model_config(chunks[0])
    except Exception:  # noqa: BLE001 - not a Megatron model
        return None


def split_dependent_features(config: Any) -> list[str]:
    """Model features whose gradient legitimately depends on batch composition."""
    if config is None:
        return []
    found = []
    if getattr(config, "num_moe_experts", None):
        if (getattr(config, "moe_aux_loss_coeff", 0) or 0) > 0:
            found.append("MoE load-balancing loss")
        if (getattr(config, "moe_z_loss_coeff", None) or 0) > 0:
            found.append("MoE z-loss")
        if getattr(config, "moe_expert_capacity_factor", None) is not None:
            found.append("MoE expert capacity (token dropping)")
    return found


def has_dropout(config: Any, chunks: list) -> bool:
    if not any(chunk.training for chunk in chunks):
        return False
    if config is not None and (
        (getattr(config, "hidden_dropout", 0) or 0) > 0
        or (getattr(config, "attention_dropout", 0) or 0) > 0
    ):
        return True
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
        for chunk in chunks
        for m in chunk.modules()
    )


def module_buffers(chunks: list) -> list[torch.Tensor]:
    """Registered buffers (MoE expert bias and token counts, ...) that a re-run may update.
    ``nn.Module.buffers`` explicitly: Megatron DDP's ``buffers`` attribute is its grad buffers."""
    return [b for chunk in chunks for b in torch.nn.Module.buffers(chunk)]


def snapshot_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if grad_of(p) is None else grad_of(p).detach().clone() for p in params]


@torch.no_grad()
def restore_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads, strict=True):
        current = grad_of(param)
        if grad is not None and current is not None:
            current.copy_(grad)
        elif grad is None and getattr(param, "main_grad", None) is None:
            param.grad = None  # the re-run created it


# ------------------------------------------------------------------------------ decisions
#: Modes whose gradient depends on the micro-batch split by design (or that are stock Megatron).
SPLIT_DEPENDENT_MODES = ("off", "token_mean_legacy")


def why_not_checkable(schedule: Any, model: Any) -> str | None:
    """Why this setup cannot be checked, from configuration alone (the same on every rank)."""
    # The schedule's public configuration; a plain forward_backward_func has none.
    reduction = getattr(getattr(schedule, "config", None), "reduction", None)
    if reduction in SPLIT_DEPENDENT_MODES:
        return (
            f"reduction {reduction!r} depends on the micro-batch split by definition "
            "(Megatron's mean of per-micro-batch means)"
        )
    features = split_dependent_features(model_config_of(model_chunks(model)))
    if features:
        return (
            f"the model uses {', '.join(features)}, whose gradient depends on the batch "
            "composition by design (they are nonlinear in it; Megatron keeps them per "
            "micro-batch)"
        )
    return None


def agree_flags(flags: list[float], groups: StepGroups, device: torch.device) -> list[float]:
    """Element-wise max of per-rank flags over every rank of the model: the model-parallel
    group, then the data x context-parallel group (together they span the grid)."""
    tensor = torch.tensor(flags, dtype=torch.float64, device=device)
    for group in (groups.mp, groups.dp_cp):
        if group_size(group) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def broadcasts_batches(reads: bool, groups: StepGroups, device: torch.device) -> bool:
    """Whether some tensor-parallel group has ranks that read data (``reads``) and ranks that
    do not: then ``forward_step`` broadcasts the batch (Megatron-LM's
    ``get_batch_on_this_tp_rank``) into buffers of the configured micro-batch shape, and only a
    shape-keeping re-split works."""
    flags = torch.tensor([float(reads), float(not reads)], device=device)
    if group_size(groups.tp) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=groups.tp)
    mixed = float(bool(flags[0] > 0 and flags[1] > 0))
    return bool(agree_flags([mixed], groups, device)[0])


def plan_resplit(
    call: dict, chunks: list, groups: StepGroups, keep_shapes: bool
) -> ResplitPlan | None:
    """The re-split of the step ``call`` describes; every stage of a pipeline plans alike."""
    pp = group_size(groups.pp)
    interleaved = None
    if len(chunks) > 1:
        config = model_config_of(chunks)
        interleaved = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp
    return resplit_plan(
        call["num_microbatches"],
        call.get("micro_batch_size"),
        pipeline_size=pp,
        interleaved_group=interleaved,
        keep_shapes=keep_shapes,
    )
