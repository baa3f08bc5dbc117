"""verl: its Megatron training step through
:class:`~megatron_lossfix.step.schedule.LossFixSchedule`.

verl (0.9.1) compensates Megatron's averaging by hand: ``agg_loss`` divides by a token count
all-reduced over the data-parallel group and multiplies by ``dp_size``, and the engine's
``postprocess_micro_batch_func`` multiplies by the micro-batch count (``python -m
megatron_lossfix audit --stack verl`` measures the result per layout). Through this adapter the
engine's training step instead:

* cuts the mini-batch into micro-batches as verl does (``prepare_micro_batches``);
* runs the plugin's schedule, which counts the step's tokens and sequences once over the
  data x context-parallel group and hands each micro-batch its per-token weights;
* aggregates every term of verl's loss (policy loss, entropy, KL: each ``agg_loss`` call) as the
  plain weighted sum ``sum(w * loss_mat)``; the schedule undoes Megatron's averaging, so there is
  no ``x num_micro_batch`` and no ``x dp_size`` any more.

verl loads it through its plugin entry points (group ``verl.plugins``, installed with ``pip
install megatron_lossfix[verl]``) when verl is imported; it changes nothing unless the
environment variable ``MEGATRON_LOSSFIX_VERL`` is set (in every worker: Ray's ``runtime_env``
``env_vars``): ``1`` maps verl's own ``actor.loss_agg_mode`` to the plugin's mode, a plugin mode
name forces that mode. Forward-only calls (log-probs) keep verl's own path.

verl's loss modes and the plugin's (``VERL_MODES``): ``token-mean`` -> ``token_mean``,
``seq-mean-token-mean`` -> ``sequence_mean``, ``seq-mean-token-sum`` ->
``seq_mean_token_sum_norm`` with C = 1, ``seq-mean-token-sum-norm`` -> ``seq_mean_token_sum_norm``
with C = ``actor.loss_scale_factor`` (required: verl's default, the padded width of each
micro-batch, is not one constant), ``token-sum`` -> ``sum``. One difference stays: verl's
sequence means divide by the configured mini-batch size, empty sequences included; the plugin's
by the sequences that have loss tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.step.selfcheck import left_out

if TYPE_CHECKING:
    from megatron_lossfix.step.schedule import LossFixSchedule

__all__ = [
    "ENV",
    "VERL_MODES",
    "forward_backward_batch",
    "install",
    "lossfix_config",
    "plugin_mode",
    "released_forward_backward_batch",
]

#: The switch: unset or empty, verl runs as released.
ENV = "MEGATRON_LOSSFIX_VERL"

#: verl ``loss_agg_mode`` -> (plugin mode, its fixed ``norm_constant`` or None).
VERL_MODES: dict[str, tuple[str, float | None]] = {
    "token-mean": ("token_mean", None),
    "seq-mean-token-mean": ("sequence_mean", None),
    "seq-mean-token-sum": ("seq_mean_token_sum_norm", 1.0),
    "seq-mean-token-sum-norm": ("seq_mean_token_sum_norm", None),
    "token-sum": ("sum", None),
}

#: verl modes that divide by the configured number of sequences (empty ones included).
DIVIDES_BY_BATCH_SIZE = frozenset(
    {"seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}
)


def plugin_mode(loss_agg_mode: str) -> str:
    """The plugin mode of verl's ``loss_agg_mode``; ``ValueError`` for one without."""
    if loss_agg_mode not in VERL_MODES:
        raise ValueError(
            f"verl loss_agg_mode {loss_agg_mode!r} has no megatron_lossfix counterpart; "
            f"use one of {', '.join(VERL_MODES)}"
        )
    return VERL_MODES[loss_agg_mode][0]


def lossfix_config(loss_agg_mode: str, *, loss_scale_factor: float | None = None) -> LossFixConfig:
    """The plugin's configuration for verl's ``loss_agg_mode`` (and ``loss_scale_factor``)."""
    mode = plugin_mode(loss_agg_mode)
    norm = VERL_MODES[loss_agg_mode][1]
    if mode == "seq_mean_token_sum_norm" and norm is None:
        if loss_scale_factor is None:
            raise ValueError(
                "verl loss_agg_mode 'seq-mean-token-sum-norm' needs actor.loss_scale_factor set "
                "(e.g. the maximum response length) for megatron_lossfix"
            )
        norm = float(loss_scale_factor)
    return LossFixConfig(reduction=mode, norm_constant=norm)


def _config_of(loss_function: Any, reduction: str | LossFixConfig | None) -> LossFixConfig:
    """The step's configuration: given, or from the environment switch, or from verl's actor
    config bound into its loss function (``partial(ppo_loss, config=actor_config)``)."""
    if isinstance(reduction, LossFixConfig):
        return reduction
    switch = reduction or os.environ.get(ENV, "")
    if switch and switch not in ("1", "auto"):
        return LossFixConfig(reduction=switch)
    actor = getattr(loss_function, "keywords", {}).get("config")
    if actor is None or not hasattr(actor, "loss_agg_mode"):
        raise ValueError(
            f"cannot tell verl's loss_agg_mode from the loss function; set {ENV} to a "
            "megatron_lossfix mode (e.g. token_mean)"
        )
    return lossfix_config(
        actor.loss_agg_mode, loss_scale_factor=getattr(actor, "loss_scale_factor", None)
    )


# ------------------------------------------------------------------------------ the step


@contextmanager
def _weighted_agg_loss(weights: torch.Tensor) -> Iterator[None]:
    """While verl's loss function runs: every ``agg_loss`` call is ``sum(w * loss_mat)``."""
    from verl.trainer.ppo import core_algos
    from verl.workers.utils import losses

    def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, **_: Any):
        del loss_mask, loss_agg_mode  # the weights are zero off the mask and carry the mode
        if loss_mat.shape != weights.shape:
            raise ValueError(
                f"verl's loss matrix {tuple(loss_mat.shape)} does not line up with the "
                f"micro-batch's loss weights {tuple(weights.shape)}: the adapter builds them "
                "from the padded response_mask (else loss_mask) of the micro-batch"
            )
        return (loss_mat * weights.to(loss_mat.dtype)).sum()

    saved = core_algos.agg_loss, losses.agg_loss
    core_algos.agg_loss = losses.agg_loss = agg_loss
    try:
        yield
    finally:
        core_algos.agg_loss, losses.agg_loss = saved


def _loss_mask(micro_batch: Any) -> torch.Tensor:
    """The mask verl's loss terms aggregate over, padded as they see it."""
    key = "response_mask" if "response_mask" in micro_batch.keys() else "loss_mask"
    mask = micro_batch[key]
    return mask.to_padded_tensor(0) if mask.is_nested else mask


def _postprocess(
    output: Any,
    data: Any,
    local_cp_size: Any = None,
    *,
    engine: Any,
    loss_function: Callable,
    weights: torch.Tensor,
    loss_mask: torch.Tensor,
) -> tuple:
    """verl's loss on one micro-batch as the plugin wants it: ``(sum(w * l), report)``, or
    with ``calculate_per_token_loss`` ``(sum(w * l), n_local, report)``."""
    from verl.workers.engine.utils import detach_tree

    del local_cp_size  # dynamic CP is refused before the step
    model_output = engine.prepare_model_outputs(output, data)
    with _weighted_agg_loss(weights):
        loss, metrics = loss_function(
            model_output=model_output, data=data, dp_group=engine.get_data_parallel_group()
        )
    report = {"loss": loss.detach(), "metrics": metrics, "model_output": detach_tree(model_output)}
    if not getattr(engine.tf_config, "calculate_per_token_loss", False):
        return loss, report
    return loss, _local_tokens(loss_mask), report


def _local_tokens(loss_mask: torch.Tensor) -> torch.Tensor:
    """The micro-batch's loss tokens on this context-parallel rank's share of its sequences
    (Megatron's split): every CP rank holds whole sequences in verl, and Megatron's per-token
    path adds these counts over the data x context-parallel group."""
    from megatron.core import parallel_state as mpu

    from megatron_lossfix.step.megatron_compat import slice_batch_for_cp

    local = slice_batch_for_cp({"loss_mask": loss_mask}, mpu.get_context_parallel_group())
    return local["loss_mask"].sum().to(torch.int)


def _micro_batches(engine: Any, data: Any) -> tuple[list, Any]:
    """The mini-batch cut into micro-batches as verl cuts them (``prepare_micro_batches``), and
    their indices into it; ``data`` and each micro-batch carry the non-tensor fields verl's loss
    functions read."""
    from megatron.core import parallel_state as mpu
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    tu.assign_non_tensor(data, sp_size=engine.engine_config.context_parallel_size)
    # verl's loss functions read these (metrics only, once agg_loss is the weighted sum): one
    # replica, and a count that tells them the loss is already global (sum its metrics).
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=1)
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    micro_batches, indices = prepare_micro_batches(
        data=data,
        dp_group=engine.get_data_parallel_group(),
        num_batches_divided_by=(
            engine.tf_config.microbatch_group_size_per_vp_stage if vpp and vpp > 1 else None
        ),
        same_micro_num_in_dp=True,
        min_num_micro_batch=None,
    )
    for micro_batch in micro_batches:
        tu.assign_non_tensor(micro_batch, num_micro_batch=len(micro_batches))
    return micro_batches, indices


def _forward_step(engine: Any, loss_function: Callable, config: LossFixConfig) -> Callable:
    """The schedule's ``forward_step``: verl's own, its loss written as the plugin wants it
    (:func:`_postprocess`) with the micro-batch's weights."""

    def forward_step(data_iterator: Any, model: Any) -> tuple:
        batch = next(data_iterator)
        # Only the loss stage's micro-batches carry weights; only there is the loss computed.
        post = functools.partial(
            _postprocess,
            engine=engine,
            loss_function=loss_function,
            weights=batch.get(config.weights_key),
            loss_mask=batch[config.loss_mask_key],
        )
        return engine.forward_step(
            iter([batch["verl_batch"]]),
            model,
            logits_processor_func=loss_function,
            postprocess_micro_batch_func=post,
        )

    return forward_step


def _schedule(config: LossFixConfig) -> LossFixSchedule:
    """The plugin's schedule for one call of the adapter."""
    from megatron_lossfix.step.schedule import LossFixSchedule

    # A schedule per call: every step would be its first; the check runs only when asked.
    if config.self_check is None:
        left_out(
            "verl's schedule",
            "the adapter writes the loss from verl's and builds a schedule per call (every "
            "step would be its first); LossFixConfig(self_check=True) checks every step",
        )
    return LossFixSchedule(dataclasses.replace(config, self_check=bool(config.self_check)))


def forward_backward_batch(
    engine: Any,
    data: Any,
    loss_function: Callable | None,
    forward_only: bool = False,
    *,
    reduction: str | LossFixConfig | None = None,
) -> Any:
    """verl's ``MegatronEngine.forward_backward_batch`` through the plugin's schedule.

    ``reduction``: a plugin mode or configuration; by default the ``MEGATRON_LOSSFIX_VERL``
    switch, else verl's ``loss_agg_mode`` from the loss function's bound actor config.
    """
    if forward_only or loss_function is None:
        return released_forward_backward_batch()(engine, data, loss_function, forward_only)
    from megatron.core import parallel_state as mpu
    from verl.utils.megatron.pipeline_parallel import make_batch_generator
    from verl.workers.engine.utils import postprocess_batch_func

    if engine.engine_config.dynamic_context_parallel:
        raise NotImplementedError(
            "megatron_lossfix's verl adapter does not support dynamic_context_parallel; "
            f"turn it off or unset {ENV}"
        )
    config = _config_of(loss_function, reduction)
    micro_batches, indices = _micro_batches(engine, data)
    batches = [{config.loss_mask_key: _loss_mask(mb), "verl_batch": mb} for mb in micro_batches]
    forward_step = _forward_step(engine, loss_function, config)
    losses_reduced = _schedule(config)(
        forward_step_func=forward_step,
        data_iterator=make_batch_generator(batches, vpp_size=len(engine.module)),
        model=engine.module,
        num_microbatches=len(micro_batches),
        seq_length=1,  # as verl: shapes travel with the pipeline's p2p messages
        micro_batch_size=1,
        forward_only=False,
    )
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    return postprocess_batch_func(output_lst=losses_reduced, indices=indices, data=data)


# ------------------------------------------------------------------------------ the switch

_RELEASED: dict[str, Callable] = {}


def released_forward_backward_batch() -> Callable:
    """verl's own ``MegatronEngine.forward_backward_batch``, also after :func:`install`."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    return _RELEASED.get("forward_backward_batch", MegatronEngine.forward_backward_batch)


def install() -> None:
    """Route verl's Megatron training step through the plugin (idempotent)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    if "forward_backward_batch" in _RELEASED:
        return
    _RELEASED["forward_backward_batch"] = MegatronEngine.forward_backward_batch

    def patched(self: Any, data: Any, loss_function: Callable, forward_only: bool = False) -> Any:
        return forward_backward_batch(self, data, loss_function, forward_only)

    MegatronEngine.forward_backward_batch = patched


def _load_plugin() -> None:
    """verl's entry point (group ``verl.plugins``): install when the switch is on."""
    if os.environ.get(ENV, ""):
        install()


_load_plugin()
