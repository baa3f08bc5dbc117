"""AReaL's Megatron training step through the plugin (``megatron_lossfix.integrations.areal``).

The switch :func:`enable` replaces ``MegatronEngine.train_batch`` (areal 1.0.4,
``areal/engine/megatron_engine.py``) in this process by :func:`lossfix_train_batch`, which runs
AReaL's own pieces in AReaL's order: ``_prepare_mb_list`` (its micro-batches), its
``forward_backward_batch`` (the packed, context-parallel forward) and ``_compute_logprobs_and_loss``
with AReaL's loss function, and ``optimizer_step``. What changes:

1. the schedule: while the step runs, the ``get_forward_backward_func`` AReaL's engine looks up
   answers with :class:`~megatron_lossfix.step.schedule.LossFixSchedule` in ``token_mean`` (the
   step's token mean, what AReaL's ``loss_weight_fn = loss_mask.count_nonzero()`` stands for),
   which hands each micro-batch the plugin's weights of its loss mask;
2. the normalization: AReaL's own scaling (``local / total x DP x micro-batches``, after
   ``compute_total_loss_weight``) is left out; the loss its ``loss_fn`` returns, a mean over the
   tokens it kept, is turned back into the weighted sum ``sum(w x loss)`` over those tokens
   (:func:`weighted_loss`), every term of it alike;
3. M2PO (``m2_threshold``): AReaL picks the tokens of each micro-batch; the adapter picks them
   once over the step (AReaL's own ``_apply_m2po_masking`` on the step's tokens, gathered over
   data-parallel ranks), which is what AReaL computes on one rank with one micro-batch, and the
   loss of each micro-batch gets its share of that choice.

Tokens the loss drops (M2PO's, rejection sampling's ``action='mask'``) are zeroed by default
and still counted (the plugin's default meaning; AReaL's own for rejection sampling). With
``enable(mask_in_loss=True)`` (the plugin's ``--lossfix-mask-in-loss``) they leave the count:
the step's mean over the kept tokens, AReaL's meaning for M2PO, exact under every layout.
The first-step re-split check is off unless ``MEGATRON_LOSSFIX_AREAL_SELF_CHECK=1``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mask_in_loss import kept_weights
from megatron_lossfix.step.schedule import LossFixSchedule
from megatron_lossfix.step.selfcheck import switched_on

__all__ = [
    "AREAL_MODE",
    "SELF_CHECK_ENV",
    "LossFixForwardBackward",
    "cp_local_tokens",
    "disable",
    "enable",
    "lossfix_config",
    "lossfix_train_batch",
    "step_m2po_keep",
    "weighted_loss",
]

#: AReaL's normalization (the step's token mean) as the plugin's mode.
AREAL_MODE = "token_mean"
#: The environment variable that turns the first-step re-split check on (``1``).
SELF_CHECK_ENV = "MEGATRON_LOSSFIX_AREAL_SELF_CHECK"
#: Keys of the micro-batches the plugin reads (beside its own ``loss_mask`` and weights).
ITEM, INDEX, LOCAL = "areal_item", "areal_index", "areal_cp_local"

#: The micro-batch whose loss runs now: (plugin weights, its tokens on this CP rank or None,
#: index, the step).
_CURRENT: ContextVar[tuple[torch.Tensor, torch.Tensor | None, int, _Step] | None] = ContextVar(
    "megatron_lossfix_areal", default=None
)
#: AReaL's own ``train_batch``, kept while the switch is on.
_ORIGINAL: dict[str, Any] = {}


def lossfix_config(*, mask_in_loss: bool = False) -> LossFixConfig:
    """The plugin configuration of AReaL's step: ``token_mean``; ``mask_in_loss``: tokens the
    loss drops leave the count."""
    checked = switched_on(
        SELF_CHECK_ENV, "AReaL's adapter", "the adapter writes the loss from AReaL's loss function"
    )
    return LossFixConfig(
        reduction=AREAL_MODE,
        self_check=checked,
        mask_in_loss=mask_in_loss,
    )


# ------------------------------------------------------------------------------ M2PO


def _m2po_threshold(loss_fn: Any) -> float | None:
    keywords = getattr(loss_fn, "keywords", None) or {}
    return keywords.get("m2_threshold")


def _gather_flat(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every data-parallel rank's 1-D ``local`` (lengths may differ), in rank order."""
    if group is None or dist.get_world_size(group) == 1:
        return [local]
    size = torch.tensor([local.numel()], device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)  # before the micro-batch loop: one sync per step
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [p[: int(s)] for p, s in zip(parts, sizes, strict=True)]


def step_m2po_keep(mbs: list[dict], threshold: float, group: Any = None) -> list[torch.Tensor]:
    """M2PO's kept tokens of each micro-batch, chosen over the whole step: AReaL's own
    ``_apply_m2po_masking`` on the loss tokens of every micro-batch of every data-parallel
    rank (``group``), as on one rank with one micro-batch. Needs the recomputed ``prox_logp``."""
    from areal.trainer.ppo.actor import _apply_m2po_masking

    if any("prox_logp" not in mb or mb["prox_logp"] is None for mb in mbs):
        raise ValueError(
            "the AReaL adapter picks M2PO's tokens over the step from the recomputed "
            "prox_logp: set actor.prox_logp_method=recompute (or drop m2_threshold)"
        )
    flat = {
        key: torch.cat([mb[key].reshape(-1).float() for mb in mbs])
        for key in ("logprobs", "prox_logp", "loss_mask")
    }
    gathered = {key: _gather_flat(value, group) for key, value in flat.items()}
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    start = sum(part.numel() for part in gathered["loss_mask"][:rank])
    whole = {key: torch.cat(parts) for key, parts in gathered.items()}
    keep = _apply_m2po_masking(
        whole["logprobs"], whole["prox_logp"], whole["loss_mask"].bool(), threshold
    )
    mine = keep[start : start + flat["loss_mask"].numel()]
    return [k.reshape(mb["loss_mask"].shape) for k, mb in
            zip(mine.split([mb["loss_mask"].numel() for mb in mbs]), mbs, strict=True)]  # fmt: skip


# ------------------------------------------------------------------------------ the loss


class _Step:
    """One training step: the plugin's config, AReaL's loss function and M2PO's step-wide
    choice (None without ``m2_threshold``)."""

    def __init__(
        self, config: LossFixConfig, loss_fn: Callable, m2po: list | None, cp_group: Any = None
    ) -> None:
        self.config, self.loss_fn, self.m2po = config, loss_fn, m2po
        self.cp_group = cp_group
        """The context-parallel group (None without context parallelism)."""


@contextlib.contextmanager
def _recording(step: _Step, index: int, seen: dict[str, torch.Tensor]) -> Iterator[None]:
    """While AReaL's loss runs: M2PO's mask is the step's choice (recorded as ``passed``), and
    the rejection-sampling mask is recorded (``rejected``)."""
    from areal.trainer.ppo import actor
    from areal.utils.functional import functional

    m2po, rejection = actor._apply_m2po_masking, functional.apply_rejection_sampling

    def step_m2po(old: Any, prox: Any, loss_mask: torch.Tensor, threshold: float) -> Any:
        chosen = (
            step.m2po[index] if step.m2po is not None else m2po(old, prox, loss_mask, threshold)
        )
        seen["passed"] = chosen = chosen.to(loss_mask.device).bool() & loss_mask.bool()
        return chosen.view_as(loss_mask)

    def recorded_rejection(*args: Any, **kwargs: Any) -> Any:
        result = rejection(*args, **kwargs)
        seen["rejected"] = result.loss_mask.bool()
        return result

    actor._apply_m2po_masking, functional.apply_rejection_sampling = step_m2po, recorded_rejection
    try:
        yield
    finally:
        actor._apply_m2po_masking, functional.apply_rejection_sampling = m2po, rejection


def weighted_loss(
    logprobs: torch.Tensor, entropy: torch.Tensor, inputs: dict[str, Any], **kwargs: Any
) -> torch.Tensor:
    """The ``loss_fn`` AReaL's ``_compute_logprobs_and_loss`` calls under the adapter: AReaL's
    own loss function on the micro-batch, times ``(tokens its mean divided by) x (the plugin's
    weight of a kept token)``: ``sum(w x loss)`` over the tokens it kept. The plugin's weights
    of a token mean are one value on every kept token, so each term of AReaL's loss (the policy
    term, a distillation term) is weighed alike."""
    current = _CURRENT.get()
    if current is None:
        raise RuntimeError("weighted_loss runs only inside the AReaL adapter's training step")
    weights, local, index, step = current
    seen: dict[str, torch.Tensor] = {}
    with _recording(step, index, seen):
        loss = step.loss_fn(logprobs, entropy, inputs, **kwargs)
    passed = seen.get("passed", inputs["loss_mask"].bool())
    keep = passed & seen["rejected"] if "rejected" in seen else passed
    if local is not None:  # context parallel: the plugin counts each token on its own rank
        keep = keep & local.bool()
    # The step's weights are one packed row ([1, tokens]); AReaL's masks are its tokens.
    w = kept_weights(weights.to(loss.dtype), keep.reshape(weights.shape))
    per_kept = w.sum() / keep.count_nonzero().clamp(min=1)
    if local is not None:
        # AReaL's loss on every CP rank is the whole sequences' (its log-probs gathered over
        # CP, whose backward sums the ranks' gradients): each rank weighs 1/CP of it, with the
        # weight of a kept token, which a rank without kept tokens of its own learns here.
        group = step.cp_group
        dist.all_reduce(per_kept, op=dist.ReduceOp.MAX, group=group)
        per_kept = per_kept / dist.get_world_size(group)
    return loss * passed.count_nonzero().clamp(min=1) * per_kept


def _plugin_loss(areal_loss: Callable, weights: torch.Tensor, local: torch.Tensor | None,
                 index: int, step: _Step, output_tensor: torch.Tensor) -> tuple:  # fmt: skip
    token = _CURRENT.set((weights, local, index, step))
    try:
        return areal_loss(output_tensor)  # (loss, {}): AReaL's _process_output
    finally:
        _CURRENT.reset(token)


def _forward_step(areal_step: Callable, step: _Step, data_iterator: Any, model: Any) -> tuple:
    """AReaL's ``forward_step`` on the micro-batch the plugin hands over, its loss weighted."""
    mb = next(data_iterator)
    output, areal_loss = areal_step(iter([mb[ITEM]]), model)
    weights = mb.get(step.config.weights_key)
    if weights is None:  # not the loss stage: Megatron never calls this loss
        return output, areal_loss
    local = mb[LOCAL]
    return output, functools.partial(_plugin_loss, areal_loss, weights, local, mb[INDEX], step)


def cp_local_tokens(item: Any) -> torch.Tensor | None:
    """The tokens of AReaL's micro-batch ``item`` (its packed, unpadded loss positions) that
    this context-parallel rank's forward holds, as AReaL slices them (its own
    ``split_packed_seqs_for_context_parallel`` on the padded sequences, then ``unpad_logits``);
    None without context parallelism."""
    from areal.engine.megatron_utils.packed_context_parallel import (
        split_packed_seqs_for_context_parallel,
    )
    from areal.utils.data import unpad_logits
    from megatron.core import parallel_state as mpu

    if mpu.get_context_parallel_world_size() == 1:
        return None
    padded = item.padded_mb["cu_seqlens"]
    positions = torch.arange(int(padded[-1]), device=padded.device)
    mine = split_packed_seqs_for_context_parallel(positions, padded)
    here = torch.zeros(len(positions), device=padded.device)
    here[mine] = 1.0
    return unpad_logits(here, item.padding_length, padded, item.old_cu_seqlens)


def _plugin_micro_batches(data_iterator: Any) -> list[Iterator[dict]] | Iterator[dict]:
    """AReaL's micro-batches (``MicroBatchItem``s; a list of iterators with virtual stages) as
    the plugin reads them: each one's loss mask as one packed row, the item itself, and its
    tokens on this CP rank (found here, before the micro-batch loop: AReaL's slicing reads its
    sequence lengths on the host)."""
    many = isinstance(data_iterator, (list, tuple))
    out = []
    for it in data_iterator if many else [data_iterator]:
        batches = [
            {
                "loss_mask": item.orig_mb["loss_mask"].reshape(1, -1).float(),
                ITEM: item,
                INDEX: k,
                LOCAL: cp_local_tokens(item),
            }
            for k, item in enumerate(it)
        ]
        out.append(iter(batches))
    return out if many else out[0]


class LossFixForwardBackward:
    """What AReaL's engine gets from ``get_forward_backward_func()`` during an adapted step:
    the training pass under :class:`LossFixSchedule`, AReaL's forward step and loss weighted."""

    def __init__(self, schedule: LossFixSchedule, step: _Step, megatron: Callable) -> None:
        self.schedule, self.step, self._megatron = schedule, step, megatron

    def __call__(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        forward_only: bool = False,
        **kwargs: Any,
    ) -> Any:
        if forward_only:
            return self._megatron(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                  forward_only=True, **kwargs)  # fmt: skip
        return self.schedule(
            forward_step_func=functools.partial(_forward_step, forward_step_func, self.step),
            data_iterator=_plugin_micro_batches(data_iterator),
            forward_only=False,
            **kwargs,
        )


def _refuse_other_weights(mbs: list[dict], loss_weight_fn: Callable) -> None:
    """The adapter stands for AReaL's token-count weights: refuse any other, in one line."""
    diff = torch.stack([
        torch.as_tensor(loss_weight_fn(mb), dtype=torch.float64).to(mb["loss_mask"].device)
        - mb["loss_mask"].count_nonzero().double()
        for mb in mbs
    ])  # fmt: skip
    if bool(diff.abs().max() > 0):  # one sync per step, before the micro-batch loop
        raise ValueError(
            "the AReaL adapter normalizes by loss tokens (token_mean): pass "
            "loss_weight_fn=lambda x: x['loss_mask'].count_nonzero(), or disable the adapter"
        )


def lossfix_train_batch(
    engine: Any,
    input_: list[dict[str, Any]] | dict[str, Any],
    loss_fn: Callable[..., torch.Tensor],
    loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor],
    *,
    schedule: LossFixSchedule,
) -> dict[str, float]:
    """``MegatronEngine.train_batch`` under the plugin (module docstring): AReaL's steps in
    AReaL's order, its normalization replaced by the plugin's ``token_mean``."""
    from areal.engine import megatron_engine
    from megatron.core import parallel_state as mpu

    engine._ensure_ready()
    engine.optimizer_zero_grad()
    input_batched, _ = engine._normalize_batch_input(input_)
    mb_list = engine._prepare_mb_list(input_batched).to(engine.device)
    _refuse_other_weights(mb_list.mbs, loss_weight_fn)
    threshold = _m2po_threshold(loss_fn)
    m2po = None
    if threshold is not None:
        m2po = step_m2po_keep(mb_list.mbs, threshold, mpu.get_data_parallel_group())
    cp = mpu.get_context_parallel_world_size() > 1
    step = _Step(schedule.config, loss_fn, m2po, mpu.get_context_parallel_group() if cp else None)
    loss_scale = engine.optimizer.get_loss_scale().item()
    one = torch.ones((), device=engine.device)

    def process_output(output: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        # Weight 1 of 1 and no multiplier beyond the optimizer's loss scale: the plugin's
        # weights carry the normalization (and every micro-batch's loss runs: mask_in_loss
        # hears from each).
        return engine._compute_logprobs_and_loss(
            output, inputs, weighted_loss, lambda x: one, one, loss_multiplier=loss_scale
        )

    lookup = megatron_engine.get_forward_backward_func
    megatron_engine.get_forward_backward_func = lambda *a, **k: LossFixForwardBackward(
        schedule, step, lookup(*a, **k)
    )
    try:
        engine.forward_backward_batch(mb_list, process_output, forward_only=False)
    finally:
        megatron_engine.get_forward_backward_func = lookup
    stats = engine.optimizer_step()
    stats["num_micro_batches"] = len(mb_list.mbs)
    return stats


# ------------------------------------------------------------------------------ the switch


def enable(*, mask_in_loss: bool = False) -> Callable[[], None]:
    """The switch: from now on, in this process, AReaL's ``MegatronEngine.train_batch`` runs
    :func:`lossfix_train_batch` (call it where the engine runs, before its first training step;
    ``mask_in_loss``: tokens the loss drops leave the count). Returns :func:`disable`."""
    from areal.engine.megatron_engine import MegatronEngine

    schedule = LossFixSchedule(lossfix_config(mask_in_loss=mask_in_loss))
    _ORIGINAL.setdefault("train_batch", MegatronEngine.__dict__["train_batch"])

    def train_batch(self: Any, input_: Any, loss_fn: Callable, loss_weight_fn: Callable) -> dict:
        return lossfix_train_batch(self, input_, loss_fn, loss_weight_fn, schedule=schedule)

    train_batch.lossfix_schedule = schedule  # type: ignore[attr-defined]
    MegatronEngine.train_batch = train_batch
    return disable


def disable() -> None:
    """AReaL's own ``train_batch`` again (a no-op when the switch is off)."""
    from areal.engine.megatron_engine import MegatronEngine

    if "train_batch" in _ORIGINAL:
        MegatronEngine.train_batch = _ORIGINAL.pop("train_batch")
