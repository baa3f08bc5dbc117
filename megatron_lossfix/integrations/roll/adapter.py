"""ROLL's Megatron training step with the plugin's weights (``megatron_lossfix.integrations.roll``).

ROLL (alibaba/ROLL, 8eb27cc) already undoes Megatron's averaging: ``MegatronTrainStrategy.
train_step`` all-reduces the step's loss tokens and valid samples over DP and scales each
micro-batch's loss by ``num_microbatches x DP``. What it gets wrong is in the loss: ``agg_loss``
(``roll/utils/functionals.py``) divides Dr. GRPO's sums by each micro-batch's width, which
dynamic batching and packing change; the ``token-mean`` numerator is not masked, so the tokens a
train-infer filter drops keep their gradient; ``length_loss_weight`` normalizes per micro-batch
(per sample under packing, where it is then 1); DPO means the pairs of each micro-batch.

The switch :func:`enable` (no edit of ROLL's files) replaces, in this process:

1. ``MegatronTrainStrategy.train_step`` by :func:`lossfix_train_step`: before ROLL's own step it
   computes the plugin's weights of the step's loss masks (``loss_weights`` in the mode of the
   actor's ``loss_agg_mode``, counts all-reduced over the data-parallel group: every CP rank holds
   whole rows in ROLL's loss), ROLL's sample weights over the whole step, or DPO's pair weights,
   and hands them to ROLL's step as batch fields, which ROLL's own micro-batching (static, dynamic,
   packed) cuts with the rows; then ROLL's step runs unchanged;
2. ``agg_loss`` (as the RLVR actor's module sees it, and ``roll.utils.functionals.agg_loss``
   for code that looks it up there): in the step's ``loss_agg_mode`` it returns
   ``sum(w x loss x mask)`` (times the sample weights it is given) with the plugin's weights
   ``w``; every other call (metrics in another mode) is ROLL's own;
3. ``ActorWorker.compute_sample_weights`` (RLVR): the step's weights, as ROLL computes them on one
   rank with one micro-batch (its own method, over the step's response lengths gathered over DP);
4. ``loss_fn`` of ROLL's DPO worker: ``sum_p w_p l_p`` with ``l_p`` ROLL's own loss of pair ``p``
   and ``w_p`` the plugin's pair weight (``pair_mean`` and ``pair_weights``: every pair of the
   step with a response token counts once, whatever micro-batch or rank holds it).

Modes: ``token-mean`` is ``token_mean``, ``seq-mean-token-mean`` is ``sequence_mean``,
``seq-mean-token-sum`` is ``seq_mean_token_sum_norm`` with constant 1 and
``seq-mean-token-sum-norm`` is the plugin's ``sum`` over Dr. GRPO's constant: ROLL divides the
step's token sum by the constant alone, no sequence count (the plugin's ``seq_mean_token_sum_norm``
also divides by the sequences); the constant is ROLL's static divisor (the batch's width minus
one, what ROLL divides by without dynamic batching or packing) or ``norm_constant``.
Tokens a train-infer filter drops are zeroed and still counted by default (the plugin's zeroed
meaning, what ROLL's counts mean); with ``enable(mask_in_loss=True)`` they leave the count (the
excluded meaning): ROLL's filter depends on the data alone (old and inference log-probs), so the
adapter decides it over the step with ROLL's own ``compute_train_infer_correction`` first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.runtime.losses import loss_weights
from megatron_lossfix.runtime.pairs import pair_weights

__all__ = [
    "ROLL_MODES",
    "WEIGHT_KEY",
    "disable",
    "enable",
    "lossfix_train_step",
    "plugin_mode",
]

#: ROLL's ``loss_agg_mode`` -> (the plugin's mode, its constant, whether the weights are divided
#: by Dr. GRPO's constant: ROLL divides the step's token sum by it alone, with no sequence count).
ROLL_MODES: dict[str, tuple[str, float | None, bool]] = {
    "token-mean": ("token_mean", None, False),
    "seq-mean-token-mean": ("sequence_mean", None, False),
    "seq-mean-token-sum": ("seq_mean_token_sum_norm", 1.0, False),
    "seq-mean-token-sum-norm": ("sum", None, True),
}
#: The batch fields the adapter adds for the step (removed after it).
WEIGHT_KEY, SAMPLE_KEY, PAIR_KEY = "lossfix_weight", "lossfix_sample_weight", "lossfix_pair_weight"


@dataclass(frozen=True, slots=True)
class _Micro:
    """What the patched functions read while one micro-batch's (or packed sample's) loss runs."""

    mode: str | None
    weights: torch.Tensor | None
    sample_weights: torch.Tensor | None
    pair_weights: torch.Tensor | None


_CURRENT: ContextVar[_Micro | None] = ContextVar("roll_lossfix_micro", default=None)
_ORIGINALS: dict[str, Any] = {}
_SETTINGS: dict[str, Any] = {}


def plugin_mode(
    loss_agg_mode: str, width: int, norm_constant: float | None
) -> tuple[str, float | None, float]:
    """The plugin's mode, its constant and the divisor of its weights for ROLL's
    ``loss_agg_mode`` on a batch of ``width`` log-prob positions (Dr. GRPO's constant:
    ``norm_constant``, else ``width``); ``ValueError`` naming the choices for another mode."""
    if loss_agg_mode not in ROLL_MODES:
        raise ValueError(
            f"loss_agg_mode {loss_agg_mode!r} has no counterpart in megatron_lossfix; choose "
            f"from {', '.join(ROLL_MODES)}"
        )
    mode, constant, divided = ROLL_MODES[loss_agg_mode]
    divisor = float(norm_constant if norm_constant is not None else width) if divided else 1.0
    return mode, constant, divisor


def _dp_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def _filter_keep(worker: Any, batch: Any, mask: torch.Tensor) -> torch.Tensor:
    """The step's kept tokens of ROLL's train-infer filters (``compute_train_infer_correction``
    on this rank's whole batch: its rules are per token or per sequence, from the data)."""
    from roll.utils.train_infer_corrections import compute_train_infer_correction

    cfg = worker.pipeline_config.train_infer_correction
    if not any(f.enabled for f in getattr(cfg, "filters", [])):
        return torch.ones_like(mask)
    if "old_log_probs" not in batch.batch:
        raise ValueError(
            "the ROLL adapter decides train-infer filters before the step from old_log_probs: "
            "set enable_old_logprobs_recompute (or drop mask_in_loss and length weights)"
        )
    old = batch.batch["old_log_probs"]
    infer = batch.batch["infer_logprobs"] if "infer_logprobs" in batch.batch else old
    _, keep, _ = compute_train_infer_correction(
        cfg=cfg, response_mask=mask.long(), old_log_probs=old, infer_log_probs=infer
    )
    return keep.to(mask.dtype)


def _step_sample_weights(worker: Any, batch: Any, lengths: torch.Tensor) -> torch.Tensor:
    """ROLL's ``compute_sample_weights`` over the whole step (lengths and difficulties gathered
    over DP), this rank's rows."""
    group = _dp_group()
    difficulty = batch.non_tensor_batch.get("difficulty") if batch.non_tensor_batch else None
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (lengths.cpu(), difficulty), group=group)
    rank = dist.get_rank(group)
    start = sum(len(p[0]) for p in parts[:rank])
    every = torch.cat([p[0] for p in parts]).to(lengths.device)
    non_tensor = {}
    if difficulty is not None:
        import numpy as np

        non_tensor["difficulty"] = np.concatenate([np.asarray(p[1]) for p in parts])
    data = type(batch)(batch=None, non_tensor_batch=non_tensor, meta_info={})
    weights = _ORIGINALS["compute_sample_weights"](worker, data, every[:, None])
    return weights[start : start + len(lengths)]


def _prepare_actor(strategy: Any, worker: Any, batch: Any) -> str:
    """The step's weights (and sample weights) of the RLVR actor, as batch fields; returns the
    ``loss_agg_mode`` they answer."""
    config = worker.pipeline_config
    response = batch.batch["response_mask"][:, 1:]
    if "final_response_mask" in batch.batch:
        response = batch.batch["final_response_mask"]
    mask = response.float()
    needs_filter = _SETTINGS["mask_in_loss"] or config.length_loss_weight
    keep = _filter_keep(worker, batch, mask) if needs_filter else torch.ones_like(mask)
    mode, constant, divisor = plugin_mode(
        config.loss_agg_mode, mask.shape[-1], _SETTINGS["norm_constant"]
    )
    counted = mask * keep if _SETTINGS["mask_in_loss"] else mask
    (weights,) = loss_weights([counted], mode, norm_constant=constant, dp_group=_dp_group())
    batch.batch[WEIGHT_KEY] = weights / divisor
    if config.length_loss_weight or config.difficulty_loss_weight:
        lengths = (mask * keep).sum(-1)
        batch.batch[SAMPLE_KEY] = _step_sample_weights(worker, batch, lengths)
    return config.loss_agg_mode


def _prepare_dpo(strategy: Any, batch: Any) -> None:
    """DPO's pair weights, one per row (its pair's): the plugin's ``pair_mean`` weights of the
    pairs' response tokens (ROLL's ``get_logps`` mask), summed over each pair (``pair_weights``):
    ``1 / P`` over the step's pairs with a response token, counted over the data-parallel group."""
    config = strategy.worker_config
    if config.use_dynamic_batching_in_train or config.use_sequence_packing:
        raise ValueError(
            "ROLL's DPO loss pairs adjacent rows (chosen, rejected): dynamic batching sorts them "
            "apart and sequence packing takes each row's loss alone; turn both off"
        )
    rows = batch.batch["input_ids"].shape[0]
    per_micro = config.training_args.per_device_train_batch_size
    if rows % 2 or per_micro % 2:
        raise ValueError(
            f"ROLL's DPO pairs adjacent rows: the batch ({rows} rows) and "
            f"per_device_train_batch_size ({per_micro}) must be even"
        )
    attention = batch.batch["attention_mask"].bool()
    positions = torch.arange(attention.shape[-1], device=attention.device)[None, :]
    prompt = batch.batch["prompt_id_lens"].to(attention.device)[:, None]
    mask = (attention & (positions >= prompt))[:, 1:]
    # Local to this rank's batch, which the plugin weighs as one micro-batch; ROLL's even
    # micro-batches keep every pair whole.
    ids = torch.arange(rows, device=mask.device) // 2
    (weights,) = loss_weights([mask], "pair_mean", pair_ids=[ids], dp_group=_dp_group())
    batch.batch[PAIR_KEY] = pair_weights(weights, ids)[ids]


def lossfix_train_step(self: Any, batch: Any, loss_func: Callable) -> Any:
    """ROLL's ``MegatronTrainStrategy.train_step`` with the plugin's weights (module docstring)."""
    worker = getattr(loss_func, "__self__", None)
    kind = _worker_kind(worker)
    if kind is None:
        return _ORIGINALS["train_step"](self, batch, loss_func)
    mode = None
    if kind == "dpo":
        _prepare_dpo(self, batch)
    else:
        mode = _prepare_actor(self, worker, batch)

    @functools.wraps(loss_func)
    def weighted_loss_func(data: Any, output_tensor: torch.Tensor) -> Any:
        fields = data.batch
        micro = _Micro(
            mode=mode,
            weights=fields[WEIGHT_KEY] if WEIGHT_KEY in fields else None,
            sample_weights=fields[SAMPLE_KEY] if SAMPLE_KEY in fields else None,
            pair_weights=fields[PAIR_KEY] if PAIR_KEY in fields else None,
        )
        token = _CURRENT.set(micro)
        try:
            return loss_func(data, output_tensor)
        finally:
            _CURRENT.reset(token)

    try:
        return _ORIGINALS["train_step"](self, batch, weighted_loss_func)
    finally:
        for key in (WEIGHT_KEY, SAMPLE_KEY, PAIR_KEY):
            if key in batch.batch:
                del batch.batch[key]


def _worker_kind(worker: Any) -> str | None:
    """``rlvr`` or ``dpo`` for the workers whose loss the adapter weighs, else ``None``."""
    from roll.pipeline.dpo.actor_worker import ActorWorker as DpoWorker
    from roll.pipeline.rlvr.actor_worker import ActorWorker as RlvrWorker

    if isinstance(worker, DpoWorker):
        return "dpo"
    if isinstance(worker, RlvrWorker):
        return "rlvr"
    return None


def _agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    batch_num_tokens: Any = None,
    global_valid_samples: Any = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """ROLL's ``agg_loss`` in the step's mode: ``sum(w x loss x mask)`` (times the sample
    weights) with the plugin's weights; ROLL's own otherwise."""
    micro = _CURRENT.get()
    if micro is None or micro.weights is None or loss_agg_mode != micro.mode:
        return _ORIGINALS["agg_loss"](
            loss_mat, loss_mask, loss_agg_mode, batch_num_tokens, global_valid_samples, weights
        )
    w = micro.weights.to(loss_mat.dtype) * loss_mask.to(loss_mat.dtype)
    if weights is not None:
        w = w * weights.to(loss_mat.dtype)[:, None]
    return (loss_mat * w).sum()


def _compute_sample_weights(self: Any, data: Any, response_mask: torch.Tensor) -> torch.Tensor:
    """The step's sample weights of these rows (ROLL's own per micro-batch otherwise)."""
    micro = _CURRENT.get()
    if micro is None or micro.sample_weights is None:
        return _ORIGINALS["compute_sample_weights"](self, data, response_mask)
    return micro.sample_weights.to(response_mask.device).float()


def _dpo_loss_fn(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ROLL's DPO loss with the pairs weighted by the plugin: ``sum_p w_p l_p``, ``l_p`` ROLL's
    own loss of pair ``p`` alone."""
    original = _ORIGINALS["dpo_loss_fn"]
    micro = _CURRENT.get()
    logps = (policy_chosen_logps, policy_rejected_logps)
    refs = (reference_chosen_logps, reference_rejected_logps)
    if micro is None or micro.pair_weights is None:
        return original(*logps, *refs, *args, **kwargs)
    _, chosen, rejected = original(*logps, *refs, *args, **kwargs)
    pair_w = micro.pair_weights[0::2].to(policy_chosen_logps.dtype)
    losses = torch.stack(
        [
            original(*(t[p : p + 1] for t in (*logps, *refs)), *args, **kwargs)[0]
            for p in range(len(pair_w))
        ]
    )
    return (pair_w * losses).sum(), chosen, rejected


def _targets() -> dict[str, tuple[Any, str, Any]]:
    """What :func:`enable` replaces: name -> (owner, attribute, replacement)."""
    import roll.pipeline.dpo.actor_worker as dpo
    import roll.pipeline.rlvr.actor_worker as rlvr
    import roll.utils.functionals as functionals
    from roll.distributed.strategy.megatron_strategy import MegatronTrainStrategy

    return {
        "train_step": (MegatronTrainStrategy, "train_step", lossfix_train_step),
        "agg_loss": (rlvr, "agg_loss", _agg_loss),
        "functionals_agg_loss": (functionals, "agg_loss", _agg_loss),
        "compute_sample_weights": (
            rlvr.ActorWorker,
            "compute_sample_weights",
            _compute_sample_weights,
        ),
        "dpo_loss_fn": (dpo, "loss_fn", _dpo_loss_fn),
    }


def enable(*, mask_in_loss: bool = False, norm_constant: float | None = None) -> Callable[[], None]:
    """Switch the adapter on in this process (module docstring); returns :func:`disable`.
    ``mask_in_loss``: the tokens ROLL's train-infer filters drop leave the count;
    ``norm_constant``: Dr. GRPO's constant (default: the batch's width minus one, ROLL's static
    divisor). Calling it again changes the settings."""
    if norm_constant is not None and not norm_constant > 0:
        raise ValueError(f"norm_constant must be > 0, got {norm_constant}")
    _SETTINGS.update(mask_in_loss=bool(mask_in_loss), norm_constant=norm_constant)
    if not _ORIGINALS:
        for name, (owner, attr, replacement) in _targets().items():
            _ORIGINALS[name] = (
                owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            )
            setattr(owner, attr, replacement)
    return disable


def disable() -> None:
    """Restore ROLL's own functions (a no-op when the adapter is off)."""
    if not _ORIGINALS:
        return
    for name, (owner, attr, _) in _targets().items():
        setattr(owner, attr, _ORIGINALS[name])
    _ORIGINALS.clear()


@contextmanager
def enabled(**kwargs: Any) -> Iterator[None]:
    """:func:`enable` for the ``with`` block."""
    enable(**kwargs)
    try:
        yield
    finally:
        disable()
