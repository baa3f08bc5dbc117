"""slime's Megatron training step with exact, layout-invariant loss normalization.

slime (0.3.1) undoes Megatron's averaging by hand at the end of its ``loss_function``
(``slime/backends/megatron_utils/loss.py``): by default it sums per-rollout token means
(``get_sum_of_sample_mean`` with the step's ``rollout_mask_sums``) and multiplies by
``num_microbatches / step_global_batch_size x (DP x CP)``; with ``--calculate-per-token-loss``
it sums the masked per-token terms and returns ``num_tokens = sum(clamp_min(loss_mask.sum(),
1))``, which counts one phantom token for every fully masked sample. Its KL and entropy terms
go through the same reducer.

This module swaps that normalization for the plugin's without editing slime's files. Its one
switch is slime's own hook flag::

    --custom-megatron-init-path megatron_lossfix.integrations.slime.adapter.enable

:func:`enable` makes slime's ``train_one_step`` take its schedule from
:class:`LossFixForwardBackward` (slime looks ``get_forward_backward_func`` up on its ``model``
module when a step starts; forward-only passes keep Megatron's). Each training step then

1. reads the step's micro-batches from slime's ``DataIterator`` (which samples each one holds)
   and hands the plugin their loss masks over the response tokens, one packed row per
   micro-batch with ``cu_seqlens`` at the sample boundaries and, in slime's default setting,
   each sample's rollout (``rollout_ids``) as its group;
2. runs slime's own ``forward_step`` (``get_batch``: packing, both context-parallel layouts;
   the model call) under :class:`~megatron_lossfix.step.schedule.LossFixSchedule`;
3. calls slime's own ``loss_function`` (policy, value, SFT or custom loss, TIS, OPSM, KL,
   entropy) with every reducer it builds replaced by the plain weighted sum ``sum(w * x)`` with
   the plugin's weights ``w``, so the loss is ``sum(w * pg) - entropy_coef * sum(w * entropy)
   + kl_loss_coef * sum(w * kl)`` over this rank's tokens.

slime's settings and the plugin's modes (:data:`SLIME_MODES`):

* default (``--calculate-per-token-loss`` off): each rollout's token mean, averaged over the
  step's rollouts: ``group_mean`` over ``rollout_ids`` (a rollout of one sample is a sequence:
  ``sequence_mean``). slime divides by every rollout of the step (``step_global_batch_size``),
  the plugin by those with a loss token: they differ by (rollouts with a loss token / all
  rollouts) where one is fully masked;
* ``--calculate-per-token-loss``: ``token_mean``, over the real loss tokens only.

Tokens that slime's loss drops itself (the rejection masks a ``--custom-tis-function-path``
function returns, OPSM) are, by default, zeroed in the numerator with the weights of the step's
loss masks, as slime's own reducer keeps its denominators: the plugin's zeroed ("counted
before") semantics, each term masked as slime masks it (OPSM zeroes the policy term only). With
the switch :func:`enable_mask_in_loss` (the plugin's ``--lossfix-mask-in-loss``) they leave the
normalization instead, counted globally from the tokens the loss keeps, and every term of the
loss, as if their loss mask had been 0. The first-step re-split check is off
unless ``MEGATRON_LOSSFIX_SLIME_SELF_CHECK=1``; the loss values slime reports per micro-batch
are weighted sums (``LossFixForwardBackward.schedule.step_metrics()`` gives the step's loss).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.step.schedule import LossFixSchedule
from megatron_lossfix.step.selfcheck import switched_on

__all__ = [
    "SLIME_MODES",
    "LossFixForwardBackward",
    "enable",
    "enable_mask_in_loss",
    "lossfix_config_for",
    "plugin_micro_batches",
    "weighted_loss_function",
]

#: slime's normalization settings and the plugin mode of the same per-token weights.
SLIME_MODES: dict[str, str] = {
    "per_sample": "sequence_mean",
    "per_rollout": "group_mean",
    "per_token": "token_mean",
}
#: The environment variable that turns the first-step re-split check on (``1``).
SELF_CHECK_ENV = "MEGATRON_LOSSFIX_SLIME_SELF_CHECK"
#: Keys of the micro-batches the plugin reads (beside its own ``loss_mask`` and weights).
ROLLOUT_DATA, INDICES = "slime_rollout_data", "slime_indices"


def lossfix_config_for(args: Any, *, mask_in_loss: bool = False) -> LossFixConfig:
    """The plugin configuration of slime's ``args``: ``token_mean`` with
    ``--calculate-per-token-loss``, else ``group_mean`` over the samples' rollouts;
    ``mask_in_loss`` (or ``args.lossfix_mask_in_loss``): the plugin's excluded semantics for
    the tokens slime's loss drops."""
    per_token = getattr(args, "calculate_per_token_loss", None)
    if per_token is None:
        raise ValueError("slime args have no calculate_per_token_loss: pass slime's parsed args")
    mode = SLIME_MODES["per_token" if per_token else "per_rollout"]
    checked = switched_on(
        SELF_CHECK_ENV,
        "slime's adapter",
        "the adapter writes the loss from slime's per-token losses",
    )
    return LossFixConfig(
        reduction=mode,
        self_check=checked,
        mask_in_loss=mask_in_loss or bool(getattr(args, "lossfix_mask_in_loss", False)),
    )


# ------------------------------------------------------------------------------ the data


def _rollout_ids(rollout_data: Any) -> Any:
    ids = rollout_data.get("rollout_ids") if hasattr(rollout_data, "get") else None
    if ids is None:
        raise ValueError(
            "slime's rollout data has no 'rollout_ids' (each sample's rollout); the default "
            "setting weighs by rollout: keep slime's _convert_samples_to_train_data output"
        )
    return ids


def _id_range(iterators: Sequence[Any], group: Any) -> tuple[int, int]:
    """The smallest rollout id and the id range of the step, over the data-parallel group."""
    ids = torch.as_tensor([int(i) for i in _rollout_ids(iterators[0].rollout_data)])
    ends = torch.stack([-ids.min(), ids.max()]).to(torch.long)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
        ends = ends.to(device)
        torch.distributed.all_reduce(ends, op=torch.distributed.ReduceOp.MAX, group=group)
    low, high = -int(ends[0]), int(ends[1])
    return low, high - low + 1


def plugin_micro_batches(
    data_iterator: Any, num_microbatches: int, *, grouped: bool, dp_group: Any = None
) -> list[Iterator[dict]] | Iterator[dict]:
    """The step's micro-batches of slime's ``DataIterator`` (or one per virtual stage), as the
    plugin reads them: per micro-batch the samples' response loss masks as one packed row
    (``loss_mask``, ``cu_seqlens``), with ``grouped`` each sample's rollout (``group_ids``,
    ``num_groups``), and what slime's ``forward_step`` reads back (the rollout data and the
    micro-batch's sample indices). Advances slime's iterators past the step."""
    many = isinstance(data_iterator, (list, tuple))
    iterators = list(data_iterator) if many else [data_iterator]
    low, num_groups = _id_range(iterators, dp_group) if grouped else (0, 0)
    out = []
    for it in iterators:
        data, start = it.rollout_data, it.offset
        batches = []
        for indices in it.micro_batch_indices[start : start + num_microbatches]:
            masks = [data["loss_masks"][i] for i in indices]
            lengths = torch.tensor([0] + [int(m.numel()) for m in masks])
            device = masks[0].device if masks else "cpu"
            mb = {
                ROLLOUT_DATA: data,
                INDICES: list(indices),
                "loss_mask": torch.cat([m.reshape(-1) for m in masks]).float()[None],
                "cu_seqlens": lengths.cumsum(0).to(device=device, dtype=torch.int32),
            }
            if grouped:
                ids = [int(_rollout_ids(data)[i]) - low for i in indices]
                mb.update(group_ids=torch.tensor(ids, device=device), num_groups=num_groups)
            batches.append(mb)
        it.offset = start + num_microbatches
        out.append(iter(batches))
    return out if many else out[0]


# ------------------------------------------------------------------------------ the loss


def _local_count(weights: Sequence[torch.Tensor], batch: dict) -> torch.Tensor:
    """This rank's loss tokens (non-zero weights) after slime's context-parallel slicing."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    total = torch.zeros((), dtype=torch.int, device=weights[0].device if weights else "cpu")
    for w, t, r in zip(weights, batch["total_lengths"], batch["response_lengths"], strict=True):
        total = total + slice_log_prob_with_cp(w != 0, t, r).sum(dtype=torch.int)
    return total


def _on_this_rank(batch: dict, device: Any) -> list[torch.Tensor]:
    """Per sample, its response positions that slime's context-parallel slicing leaves on this
    rank (as ``slice_log_prob_with_cp`` picks them), as a full-length 0/1 float mask."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    out = []
    for t, r in zip(batch["total_lengths"], batch["response_lengths"], strict=True):
        mask = torch.zeros(r, device=device)
        mask[slice_log_prob_with_cp(torch.arange(r, device=device), t, r)] = 1.0
        out.append(mask)
    return out


class _Reducers:
    """The reducers slime's loss builds in one call (``get_sum_of_sample_mean``), each giving
    ``sum(w * x)`` under the plugin's weights ``w`` (``per_sample``: the step's weights of each
    sample, full length). The loss terms use the reducer built last (slime rebuilds it with the
    masks its TIS function returns); an older one only reports metrics (``ois``, ``tis_*``).

    Zeroed (default): a token a reducer's masks drop gets weight 0, its sample's weights stay
    the step's; OPSM zeroes the policy term itself. ``mask_in_loss``: the kept mask (the
    masks of the reducer the terms use, times slime's OPSM mask) goes through
    :func:`~megatron_lossfix.runtime.mask_in_loss.kept_weights` once, on this CP rank's tokens, so
    the dropped tokens leave the step's counts and every term (policy, KL, entropy)."""

    def __init__(self, per_sample: list[torch.Tensor], batch: dict, mask_in_loss: bool) -> None:
        self.per_sample, self.batch, self.mask_in_loss = per_sample, batch, mask_in_loss
        self.opsm: torch.Tensor | None = None
        """slime's OPSM keep mask (this CP rank's response tokens), once its loss computed it."""
        self._latest: object | None = None
        self._kept: tuple[object, list[torch.Tensor]] | None = None

    def build(
        self,
        reducer: Callable,
        total_lengths: Any,
        response_lengths: Any,
        loss_masks: Any,
        sample_denoms: Any = None,
        calculate_per_token_loss: bool = False,
    ) -> Callable:
        """What ``get_sum_of_sample_mean`` returns while slime's loss runs."""
        token = self._latest = object()

        def reduce(x: torch.Tensor) -> torch.Tensor:
            masks = self._weights(token, loss_masks)
            return reducer(total_lengths, response_lengths, masks, None, True)(x)

        return reduce

    def _weights(self, token: object, loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not self.mask_in_loss or token is not self._latest:
            return [w * (m != 0) for w, m in zip(self.per_sample, loss_masks, strict=True)]
        if self._kept is None or self._kept[0] is not token:
            self._kept = (token, self._kept_weights(loss_masks))
        return self._kept[1]

    def _kept_weights(self, loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        from megatron_lossfix.runtime.mask_in_loss import kept_weights

        device = self.per_sample[0].device if self.per_sample else "cpu"
        local = _on_this_rank(self.batch, device)
        keep = [(m != 0).to(device) * on for m, on in zip(loss_masks, local, strict=True)]
        if self.opsm is not None:  # this rank's tokens, in slime's order: spread over them
            spread = torch.cat(keep)
            spread[torch.cat(local) != 0] *= self.opsm.to(device=device, dtype=spread.dtype)
            keep = list(spread.split([len(m) for m in keep]))
        weights = torch.cat([w * on for w, on in zip(self.per_sample, local, strict=True)])
        kept = kept_weights(weights[None], torch.cat(keep)[None])[0]
        return list(kept.split([len(m) for m in keep]))

    def opsm_recorder(self, compute_opsm_mask: Callable) -> Callable:
        """slime's ``compute_opsm_mask``, its keep mask also recorded here."""

        def record(*args: Any, **kwargs: Any) -> tuple:
            mask, clipfrac = compute_opsm_mask(*args, **kwargs)
            self.opsm = mask.detach()
            return mask, clipfrac

        return record


def _refuse_unweighted(args: Any) -> None:
    """slime settings whose loss the adapter cannot weigh: one line naming what to change."""
    if getattr(args, "recompute_loss_function", False) and (
        getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)
    ):
        # Its TIS branch builds a reducer again when the backward recomputes the loss, after
        # the adapter has put slime's own back.
        raise ValueError(
            "the slime adapter cannot run --recompute-loss-function with --use-tis or "
            "--get-mismatch-metrics: drop --recompute-loss-function"
        )
    if getattr(args, "custom_pg_loss_reducer_function_path", None) is not None:
        raise ValueError(
            "the slime adapter cannot weigh a custom pg_loss reducer (it normalizes pg_loss "
            "itself): drop --custom-pg-loss-reducer-function-path"
        )


def weighted_loss_function(
    slime_loss: partial,
    weights: torch.Tensor,
    output_tensor: torch.Tensor,
    *,
    mask_in_loss: bool = False,
) -> tuple:
    """slime's own ``loss_function`` (``slime_loss``: the ``partial`` its ``forward_step``
    returns) with every reducer it builds giving ``sum(w * x)`` under the plugin's weights
    (``weights``: ``[1, response tokens]`` of the micro-batch); returns the plugin's 3-tuple
    ``(sum(w * loss), loss tokens on this rank, slime's report)``. ``mask_in_loss``: the tokens
    slime's loss drops (TIS rejection masks, OPSM) leave the normalization (:class:`_Reducers`)."""
    from megatron.core import mpu
    from slime.backends.megatron_utils import loss as slime_loss_module

    args, batch, *rest = slime_loss.args
    _refuse_unweighted(args)
    lengths = [int(m.numel()) for m in batch["loss_masks"]]
    reducers = _Reducers(list(weights.reshape(-1).split(lengths)), batch, mask_in_loss)
    reducer, opsm = slime_loss_module.get_sum_of_sample_mean, slime_loss_module.compute_opsm_mask
    # The per-token path of slime's loss_function multiplies by CP alone (undone below).
    token_args = copy.copy(args)
    token_args.calculate_per_token_loss = True
    slime_loss_module.get_sum_of_sample_mean = partial(reducers.build, reducer)
    slime_loss_module.compute_opsm_mask = reducers.opsm_recorder(opsm)
    try:
        loss, _, report = slime_loss.func(token_args, batch, *rest, output_tensor)
    finally:
        slime_loss_module.get_sum_of_sample_mean = reducer
        slime_loss_module.compute_opsm_mask = opsm
    loss = loss / mpu.get_context_parallel_world_size()
    return loss, _local_count(reducers.per_sample, batch), report


def _forward_step(
    slime_step: Callable,
    config: LossFixConfig,
    data_iterator: Any,
    model: Any,
    *args: Any,
    **kw: Any,
) -> tuple:
    """slime's ``forward_step`` on the micro-batch the plugin hands over, its loss weighted."""
    from slime.backends.megatron_utils.data import DataIterator

    mb = next(data_iterator)
    own = DataIterator(mb[ROLLOUT_DATA], [mb[INDICES]])
    output, slime_loss = slime_step(own, model, *args, **kw)
    weights_key = config.weights_key
    if weights_key not in mb:  # not the loss stage: Megatron never calls this loss
        return output, slime_loss
    if not isinstance(slime_loss, partial):
        raise TypeError(
            "slime's forward_step must return partial(loss_function, args, batch, ...), got "
            f"{type(slime_loss).__name__}"
        )
    weighted = partial(weighted_loss_function, mask_in_loss=config.mask_in_loss)
    return output, partial(weighted, slime_loss, mb[weights_key])


# ------------------------------------------------------------------------------ the switch


class LossFixForwardBackward:
    """What slime's ``get_forward_backward_func()`` returns once :func:`enable` ran: training
    steps under :class:`LossFixSchedule` with slime's loss weighted by the plugin; forward-only
    passes (log-probs, values) run Megatron's schedule unchanged."""

    def __init__(
        self,
        args: Any,
        forward_backward_func: Callable | None = None,
        *,
        mask_in_loss: bool = False,
    ) -> None:
        self.args = args
        self.config = lossfix_config_for(args, mask_in_loss=mask_in_loss)
        self.schedule = LossFixSchedule(self.config, forward_backward_func)
        self._megatron = forward_backward_func

    def __call__(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        forward_only: bool = False,
        **kwargs: Any,
    ) -> Any:
        if forward_only:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            fbf = self._megatron or get_forward_backward_func()
            return fbf(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                forward_only=True,
                **kwargs,
            )
        from megatron.core import mpu

        grouped = self.config.reduction == "group_mean"
        batches = plugin_micro_batches(
            data_iterator,
            num_microbatches,
            grouped=grouped,
            dp_group=mpu.get_data_parallel_group() if grouped else None,
        )
        step = partial(_forward_step, forward_step_func, self.config)
        return self.schedule(
            forward_step_func=step,
            data_iterator=batches,
            model=model,
            num_microbatches=num_microbatches,
            forward_only=False,
            **kwargs,
        )


def enable(args: Any, *, mask_in_loss: bool = False) -> LossFixForwardBackward:
    """slime's ``--custom-megatron-init-path`` hook: from now on slime's training steps run
    through :class:`LossFixForwardBackward` (module docstring). Returns it."""
    from slime.backends.megatron_utils import model as slime_model

    fbf = LossFixForwardBackward(args, mask_in_loss=mask_in_loss)
    slime_model.get_forward_backward_func = lambda *a, **k: fbf
    return fbf


def enable_mask_in_loss(args: Any) -> LossFixForwardBackward:
    """:func:`enable` with the plugin's ``--lossfix-mask-in-loss``: the tokens slime's loss
    drops (a TIS function's rejection masks, OPSM) leave the normalization and every term of
    the loss, exactly under every layout (``--custom-megatron-init-path
    megatron_lossfix.integrations.slime.adapter.enable_mask_in_loss``)."""
    return enable(args, mask_in_loss=True)
