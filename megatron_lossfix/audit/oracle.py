"""The gradient oracle: one training step under a parallel layout versus a one-rank reference.

``layout_grads`` runs inside every rank of a :class:`~megatron_lossfix.audit.pool.DistPool`
call: it builds the tiny GPT for the layout, gives it the same global weights as any other
layout, feeds this rank's share of one deterministic global batch through the plugin's schedule
for each requested mode, and gathers the full gradient on global rank 0 (optionally also the
parameters after one optimizer step with gradient clipping). ``reference_grads`` computes, in
one process, what every layout must reproduce: one forward and backward of the whole global
batch as a single micro-batch, with the loss ``sum(w * l)`` and the weights of
``loss_weights``. ``relative_error`` compares the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from megatron_lossfix.audit.oracle_case import (
    OracleCase,
    id_ranges,
    make_global_batch,
    microbatch_ids,
    microbatch_plan,
    prompt_groups,
    row_settings,
)

__all__ = [
    "OracleCase",
    "layout_grads",
    "make_global_batch",
    "microbatch_plan",
    "reference_grads",
    "reference_weights",
    "relative_error",
    "row_settings",
    "set_moe_aux_scale",
]


def _on_model_device(batch: dict[str, torch.Tensor], chunks: list) -> dict[str, torch.Tensor]:
    """The batch on the model's device (a GPU run; a no-op under the CPU bridge)."""
    device = next(chunks[0].parameters()).device
    return {k: v.to(device) for k, v in batch.items()}


def _split(batch: dict[str, torch.Tensor], sizes: Sequence[int]) -> list[dict]:
    parts = {k: torch.split(v, list(sizes)) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(len(sizes))]


def _pack(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One ``[1, b*s]`` THD row holding the micro-batch's sequences back to back (one id per
    sequence stays one id per packed sequence)."""
    b, s = mb["tokens"].shape
    packed = {k: v.reshape(1, b * s) if v.dim() > 1 else v for k, v in mb.items()}
    packed["cu_seqlens"] = torch.arange(
        0, b * s + 1, s, dtype=torch.int32, device=mb["tokens"].device
    )
    return packed


def _model_output(case: OracleCase, model: Any, batch: dict) -> torch.Tensor:
    """Per-token cross entropy (SFT) or vocab-parallel logits ``[b, s, V/TP]`` (RL). The loss
    mask goes to the model too: Megatron computes multi-token prediction losses inside it."""
    labels = batch["labels"] if case.objective == "sft" else None
    return model(
        batch["tokens"], batch["position_ids"], None, labels=labels, loss_mask=batch["loss_mask"]
    )


def _rl_loss(case: OracleCase, batch: dict, weights: torch.Tensor, logits: torch.Tensor) -> tuple:
    """The full RL objective of one micro-batch: (weighted sum, num_tokens, stats)."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.rl.objective import rl_loss

    cp = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None
    return rl_loss(
        {**batch, "loss_weights": weights},
        logits,
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=cp,
        objective={"policy_loss": case.objective, **case.rl_kwargs},
    )


def _forward_step(case: OracleCase, num_microbatches: int, data_iterator: Any, model: Any) -> tuple:
    from megatron_lossfix.runtime.losses import weighted_loss

    batch = next(data_iterator)
    output = _model_output(case, model, batch)
    # Under ``off`` no weights come in: the loss mask is stock's weight.
    weights = batch.get("loss_weights", batch["loss_mask"])
    if case.objective == "sft":
        loss_func = partial(weighted_loss, weights, keep=_sft_keep(case))
    else:
        loss_func = partial(_rl_loss, case, batch, weights)
    if "loss_weights" in batch:
        return output, loss_func
    return output, partial(_stock_report, case, num_microbatches, loss_func)


def _sft_keep(case: OracleCase) -> Any:
    """The SFT loss's own mask: tokens whose cross entropy is below ``case.sft_keep_below``."""
    if case.sft_keep_below is None:
        return None
    return lambda per_token: per_token < case.sft_keep_below


def _stock_report(case: OracleCase, num_microbatches: int, loss_func: Any, output: Any) -> tuple:
    """``off``: the loss tuple unchanged, its report adding this micro-batch's share of the loss
    stock Megatron optimizes (``stock_loss_sum``) and its loss tokens (``num_tokens_sum``),
    both summed over the step by ``step_metrics``."""
    from megatron.core import parallel_state as ps

    loss, num_tokens, report = loss_func(output)
    if case.per_token:  # Megatron divides the summed loss by the step's token count
        share = loss.detach().clone()
    else:  # Megatron: loss / n / M, gradients averaged over D x CP
        scale = num_microbatches * ps.get_data_parallel_world_size()
        share = (
            loss.detach()
            / torch.clamp(num_tokens, min=1)
            / (scale * ps.get_context_parallel_world_size())
        )
    return loss, num_tokens, {**report, "stock_loss_sum": share, "num_tokens_sum": num_tokens}


def _stock_loss(case: OracleCase, metrics: dict) -> dict:
    """``off``: the loss stock Megatron optimizes and the step's loss tokens, from the reports
    Megatron returned."""
    loss, num_tokens = metrics.pop("stock_loss_sum"), metrics.pop("num_tokens_sum")
    if case.per_token:
        loss /= max(num_tokens, 1.0)
    return {**metrics, "loss": loss, "num_tokens": num_tokens}


def _cp_slicing_forward_step(inner: Any, data_iterator: Any, model: Any) -> tuple:
    """Megatron-LM's convention: the iterator yields whole sequences, forward_step slices them
    (and the weights with them) for this CP rank."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.step.megatron_compat import slice_batch_for_cp

    cp_group = ps.get_context_parallel_group()

    class _Sliced:
        def __next__(self) -> dict:
            return slice_batch_for_cp(next(data_iterator), cp_group)

    return inner(_Sliced(), model)


def _optimizer(case: OracleCase, chunks: list, distributed: bool) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=case.optimizer,
        lr=case.lr,
        weight_decay=0.0,
        clip_grad=case.clip_grad,
        adam_eps=case.adam_eps,
        use_distributed_optimizer=distributed,
    )
    return get_megatron_optimizer(config, chunks)


def _optimizer_step(optimizer: Any, chunks: list, gather_full_params: Any) -> dict[str, Any]:
    """Step and return the grad norm Megatron saw (before clipping) and each weight's update."""
    before = gather_full_params(chunks)
    _, grad_norm, _ = optimizer.step()
    # The step aliases param.grad to the grad buffer; a later backward would add it twice.
    optimizer.zero_grad()
    after = gather_full_params(chunks)
    if after is None:
        return {}
    return {"grad_norm": float(grad_norm), "update": {k: after[k] - before[k] for k in after}}


def _local_microbatches(
    case: OracleCase, chunks: list, vocab_size: int, num_microbatches: int
) -> list[dict]:
    """This rank's micro-batches of the global batch (CP-sharded or packed as the case says)."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.step.megatron_compat import slice_batch_for_cp

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    plan = microbatch_plan(case, dp, num_microbatches)
    batch = _on_model_device(make_global_batch(case, vocab_size), chunks)
    start = sum(sum(sizes) for sizes in plan[:dp_rank])
    local = {k: v[start : start + sum(plan[dp_rank])] for k, v in batch.items()}
    mbs = _split(local, plan[dp_rank])
    if case.schedule_kwargs.get("data_is_cp_sharded", False):
        mbs = [slice_batch_for_cp(mb, ps.get_context_parallel_group()) for mb in mbs]
    if case.packed:
        mbs = [_pack(mb) for mb in mbs]
    return [
        {**mb, **microbatch_ids(case, len(mb["group_ids"]), mb["group_ids"].device)} for mb in mbs
    ]


def layout_grads(
    layout: Any, case: OracleCase, modes: Sequence[str], num_microbatches: int
) -> dict[str, Any] | None:
    """Run one step per mode under ``layout``; on global rank 0 return
    ``{mode: {"grads": {name: grad}, "metrics": {...}}}`` plus, with ``case.optimizer``, the
    step's ``"grad_norm"`` and each weight's ``"update"`` (None on other ranks)."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit import tiny_gpt
    from megatron_lossfix.audit.training import train_step
    from megatron_lossfix.runtime.config import LossFixConfig
    from megatron_lossfix.step.schedule import LossFixSchedule

    tiny_gpt.init_layout(layout)
    # Looked up on the module when called: tests may wrap it to inspect the chunks.
    chunks, config = tiny_gpt.build_tiny_gpt(
        layout,
        seq_len=case.seq_length,
        calculate_per_token_loss=case.per_token,
        **case.model_kwargs,
    )
    mbs = _local_microbatches(case, chunks, config.vocab_size, num_microbatches)
    sharded = case.schedule_kwargs.get("data_is_cp_sharded", False)
    step = partial(_forward_step, case, len(mbs))
    if not sharded and ps.get_context_parallel_world_size() > 1:
        step = partial(_cp_slicing_forward_step, step)
    out: dict[str, Any] = {}
    for mode in modes:
        tiny_gpt.set_deterministic_params(chunks, case.seed)
        distributed = bool(case.model_kwargs.get("use_distributed_optimizer"))
        optimizer = _optimizer(case, chunks, distributed) if case.optimizer else None
        # The oracle is the check here: the first-step re-split check only when a case asks.
        kwargs = {"self_check": False, **case.config_kwargs(mode)}
        schedule = LossFixSchedule(LossFixConfig(**kwargs))
        # No optimizer here: the gradients are gathered before _optimizer_step.
        train_step(
            schedule,
            step,
            chunks,
            mbs,
            # Megatron divides the pipeline's seq_length by CP itself.
            seq_length=mbs[0]["tokens"].shape[1]
            * (ps.get_context_parallel_world_size() if sharded else 1),
            micro_batch_size=mbs[0]["tokens"].shape[0],
        )
        metrics = schedule.step_metrics()
        if row_settings(mode)[0] == "off":
            metrics = _stock_loss(case, metrics)
        result = {"grads": tiny_gpt.gather_full_grads(chunks), "metrics": metrics}
        if optimizer is not None:
            result.update(_optimizer_step(optimizer, chunks, tiny_gpt.gather_full_params))
        out[mode] = result
    return out if torch.distributed.get_rank() == 0 else None


def reference_weights(case: OracleCase, mode: str, plan: Sequence[Sequence[int]] | None) -> Any:
    """The reference's weights of a loss mask: the mode's (``off`` as ``token_mean``); for
    ``token_mean_legacy`` each DP rank's are those of its own micro-batches, divided by D; for
    ``group_mean`` (``prompt_mean``) over the global batch's prompt groups. Every rank computes
    them for the whole mini-batch it holds (``rank_local``)."""
    from megatron_lossfix.runtime.losses import loss_weights
    from megatron_lossfix.runtime.mode_record import Ids
    from megatron_lossfix.runtime.modes import mode_of

    target = "token_mean" if mode == "off" else mode_of(mode).name
    record = mode_of(target)

    def weights_of(mask: torch.Tensor) -> torch.Tensor:
        ranges, kwargs = id_ranges(case), {"rank_local": True}
        if record.ids is Ids.PROMPT_GROUPS:
            ids = prompt_groups(mask.shape[0])[0].to(mask.device)
            kwargs |= {"group_ids": [ids], "num_groups": ranges["num_groups"]}
        elif record.ids is Ids.PAIRS:
            kwargs |= {"pair_ids": [torch.arange(mask.shape[0], device=mask.device)]}
        elif case.trajectory_rows and record.ids is Ids.TRAJECTORIES:
            ids = torch.arange(mask.shape[0], device=mask.device) // case.trajectory_rows
            kwargs |= {"trajectory_ids": [ids], "num_trajectories": ranges["num_trajectories"]}
        if not record.split_dependent:
            return loss_weights([mask], target, norm_constant=case.norm_for(target), **kwargs)[0]
        rank_masks = torch.split(mask, [sum(sizes) for sizes in plan])
        return torch.cat(
            [
                torch.cat(
                    loss_weights(list(torch.split(masks, list(sizes))), target, rank_local=True)
                )
                for masks, sizes in zip(rank_masks, plan, strict=True)
            ]
        ) / len(plan)

    return weights_of


def set_moe_aux_scale(config: Any, device: torch.device) -> None:
    """The aux losses' backward reads a class-wide scale that Megatron's schedule sets; set
    what it would set for one rank and one micro-batch. Left unset, the backward would store a
    0-dim 1.0 there, which a later schedule call in this process cannot copy its [1]-shaped
    scale into (and a scale left by an earlier schedule call would be used)."""
    if not getattr(config, "num_moe_experts", None):
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device))


#: ``model_kwargs`` that choose the layout's data-parallel wrapper, not the model.
WRAPPER_KWARGS = ("use_distributed_optimizer", "average_in_collective", "megatron_fsdp")


def reference_grads(
    case: OracleCase, mode: str, plan: Sequence[Sequence[int]] | None = None
) -> dict[str, Any]:
    """One rank, one micro-batch: the whole global batch, loss ``sum(w * l)``; returns
    ``{"grads", "loss"}`` plus ``{"grad_norm", "update"}`` with ``case.optimizer``.

    ``plan`` (each DP rank's micro-batch sizes, :func:`microbatch_plan`) matters only for
    ``token_mean_legacy`` (see :func:`reference_weights`). ``off`` is compared with
    ``token_mean``. Must run on a rank whose process group has exactly one rank.
    """
    from megatron_lossfix.audit.tiny_gpt import (
        Layout,
        build_tiny_gpt,
        gather_full_grads,
        gather_full_params,
        init_layout,
        set_deterministic_params,
    )
    from megatron_lossfix.runtime.losses import weighted_sum

    layout = Layout()
    init_layout(layout)
    # The reference is plain Megatron DDP on one rank, whatever wrapper the layout runs.
    kwargs = {k: v for k, v in case.model_kwargs.items() if k not in WRAPPER_KWARGS}
    chunks, config = build_tiny_gpt(
        layout, seq_len=case.seq_length, calculate_per_token_loss=False, **kwargs
    )
    set_deterministic_params(chunks, case.seed)
    optimizer = _optimizer(case, chunks, distributed=False) if case.optimizer else None
    batch = _on_model_device(make_global_batch(case, config.vocab_size), chunks)
    weights_of = reference_weights(case, mode, plan)

    model = chunks[0]
    model.zero_grad_buffer()
    mtp_logits = _capture_mtp_logits(model, config)
    output = _model_output(case, model, batch)
    # A mask the loss decides is applied before the weights are counted: the kept tokens are
    # the loss mask here, as they are in the mode's definition (docs/design.md §10).
    kept = batch["loss_mask"] * _reference_keep(case, batch, output)
    if case.objective == "sft":
        loss = weighted_sum(output, weights_of(kept))
    else:
        loss = _rl_loss(case, batch, weights_of(kept), output)[0]
    main_loss = float(loss)
    mtp_losses: list[torch.Tensor] = []
    if mtp_logits is not None:
        mtp_losses = _reference_mtp_losses(batch, mtp_logits(), weights_of)
        scale = config.mtp_loss_scaling_factor / len(mtp_losses)
        loss = loss + scale * torch.stack(mtp_losses).sum()
    set_moe_aux_scale(config, loss.device)
    loss.backward()
    model.finish_grad_sync()
    result = {"grads": gather_full_grads(chunks), "loss": main_loss}
    if case.masks_in_loss:
        mask = batch["loss_mask"]
        result["kept_token_fraction"] = float(kept.sum() / mask.sum().clamp(min=1))
    result.update({f"mtp_loss_{j}": float(v) for j, v in enumerate(mtp_losses, start=1)})
    if optimizer is not None:
        result.update(_optimizer_step(optimizer, chunks, gather_full_params))
    return result


def _reference_keep(case: OracleCase, batch: dict, output: torch.Tensor) -> torch.Tensor:
    """The mask the case's loss decides from one rank's forward pass (1 where it decides none),
    computed as the loss computes it: on the detached per-token loss (SFT), or by
    ``rl.masks.keep_mask`` on the log-probs of the logits (RL)."""
    mask = batch["loss_mask"]
    if not case.masks_in_loss:
        return torch.ones_like(mask)
    if case.objective == "sft":
        return (output.detach() < case.sft_keep_below).to(mask.dtype)
    from megatron_lossfix.rl.logprobs import vocab_parallel_logprobs_entropy
    from megatron_lossfix.rl.masks import keep_mask

    logprobs, _ = vocab_parallel_logprobs_entropy(output.detach(), batch["labels"])
    old = torch.where(mask.bool(), batch["old_logprobs"], logprobs)
    options = case.rl_objective().mask_options
    keep, _ = keep_mask(logprobs, old, batch["advantages"], mask, **options)
    return keep.to(mask.dtype)


def _capture_mtp_logits(model: Any, config: Any) -> Any:
    """With MTP layers: collect the logits the output layer computes for them (before the main
    logits) and silence Megatron's own MTP backward, so that the reference adds the MTP loss
    itself; returns a function giving the MTP logits, or None without MTP."""
    num_layers = getattr(config, "mtp_num_layers", None) or 0
    if not num_layers:
        return None
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    unwrapped = model
    while not hasattr(unwrapped, "output_layer"):
        unwrapped = unwrapped.module
    seen: list[torch.Tensor] = []
    # A copy: Megatron's cross entropy overwrites its logits in place (exp).
    handle = unwrapped.output_layer.register_forward_hook(
        lambda _m, _i, out: seen.append(out[0].clone())
    )
    # Megatron attaches its own MTP loss with this class-wide backward scale: 0 here.
    MTPLossAutoScaler.set_loss_scale(torch.zeros(1, device=next(model.parameters()).device))

    def logits() -> list[torch.Tensor]:
        handle.remove()
        return seen[:num_layers]

    return logits


def _reference_mtp_losses(batch: dict, logits: list, weights_of: Any) -> list[torch.Tensor]:
    """``sum(w_j * l_j)`` of each MTP layer j: it predicts the label j positions ahead, with the
    mode's weights over the loss mask shifted by j."""
    from megatron_lossfix.runtime.weights import shifted_masks

    losses = []
    for j, layer_logits in enumerate(logits, start=1):
        labels = shifted_masks([batch["labels"]], j)[0]
        mask = shifted_masks([batch["loss_mask"]], j)[0]
        ce = torch.nn.functional.cross_entropy(
            layer_logits.transpose(0, 1).float().flatten(0, 1), labels.flatten(), reduction="none"
        ).view_as(mask)
        losses.append((weights_of(mask) * ce).sum())
    return losses


def relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of the full gradient (all parameters, flattened)."""
    if set(got) != set(ref):
        missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
        raise AssertionError(f"gradient names differ: missing {missing}, unexpected {extra}")
    names = sorted(ref)
    g = torch.cat([got[n].double().flatten() for n in names])
    r = torch.cat([ref[n].double().flatten() for n in names])
    return float((g - r).norm() / r.norm().clamp(min=1e-30))
