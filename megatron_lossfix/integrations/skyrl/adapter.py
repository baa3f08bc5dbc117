"""SkyRL's Megatron model wrapper with exact, layout-invariant loss normalization.

SkyRL (0.4.0) normalizes the policy loss in the advantages on the driver
(``apply_loss_reduction_to_advantages_minibatch``), multiplies the loss by
``num_microbatches x dp_size`` inside ``MegatronModelWrapper.forward_backward_mini_batch`` to undo
Megatron's averaging, and keeps the KL and entropy terms as per-micro-batch means. This module
swaps that normalization for the plugin's: :class:`LossFixModelWrapper` runs SkyRL's own
``forward_step`` (padding removal or packing, the model call) under :class:`LossFixSchedule`,
and its loss is the plain weighted sum of every term with the plugin's weights ``w``::

    loss = sum(w * pg) + kl_loss_coef * sum(w * kl) - entropy_loss_coef * sum(w * entropy)

built from SkyRL's own pieces: its log-prob and entropy kernels, its registered policy loss (called
with the raw advantages and ``loss_mask=w``, so its masked sum is ``sum(w * pg)``) and its
``compute_approx_kl``.

What a SkyRL user changes (two places, three for ``prompt_mean``; SkyRL 0.4.0 has no
configuration key that picks the model-wrapper class: ``MegatronPolicyWorkerBase.init_model``
builds ``MegatronModelWrapper``):

1. the policy worker's ``init_model`` ends with
   ``self.model = LossFixModelWrapper.from_wrapper(self.model)`` (``lossfix=`` picks the mode; by
   default ``algorithm.loss_reduction``, with ``algorithm.max_seq_len`` as the constant of
   ``seq_mean_token_sum_norm``; ``prompt_mean`` is the plugin's ``group_mean``);
2. the trainer stops pre-scaling the advantages (``RayPPOTrainer._normalize_advantages`` without
   its ``apply_loss_reduction_to_advantages_minibatch`` step): the plugin's weights carry the
   normalization, and :func:`raw_advantages` is what the workers should get;
3. with ``prompt_mean``, every micro-batch dict the policy worker hands
   ``forward_backward_mini_batch`` also carries ``group_ids`` (each row's prompt, numbered over
   the mini-batch: :func:`group_ids_from_boundaries` of SkyRL's ``prompt_boundaries``, sliced
   like the other rows' fields) and ``num_groups`` (the mini-batch's prompt count). The plugin
   then sums each prompt's loss tokens over every micro-batch and DP rank; a prompt with no
   loss token (all masked, e.g. by ``zero_variance_filter``) neither contributes nor counts,
   where SkyRL's own ``prompt_mean`` still counts it (docs/design.md §2).

SkyRL's SFT path (``loss_fn="cross_entropy"``) goes through the adapter too, as ``sum(w * nll)``
over the raw (unscaled) loss mask. Forward-only passes, temperature other than 1, the fused
LM-head path and MTP draft training run SkyRL's own code unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.step.schedule import LossFixSchedule
from megatron_lossfix.step.selfcheck import left_out

# LossFixModelWrapper is made by the module's __getattr__, which imports SkyRL on first use.
__all__ = [  # noqa: F822
    "SKYRL_MODES",
    "LossFixModelWrapper",
    "group_ids_from_boundaries",
    "lossfix_config_for",
    "raw_advantages",
]

#: SkyRL's ``algorithm.loss_reduction`` values and the plugin's mode of the same meaning.
SKYRL_MODES: dict[str, str] = {
    "token_mean": "token_mean",
    "token_mean_legacy": "token_mean_legacy",
    "sequence_mean": "sequence_mean",
    "seq_mean_token_sum_norm": "seq_mean_token_sum_norm",
    "prompt_mean": "group_mean",
}


def lossfix_config_for(algorithm: Any) -> LossFixConfig:
    """The plugin configuration matching SkyRL's ``AlgorithmConfig`` (``loss_reduction``, and
    ``max_seq_len`` as the constant of ``seq_mean_token_sum_norm``)."""
    mode = getattr(algorithm, "loss_reduction", None)
    if mode not in SKYRL_MODES:
        raise ValueError(
            f"algorithm.loss_reduction={mode!r} has no plugin mode; use one of "
            f"{', '.join(SKYRL_MODES)}"
        )
    norm = None
    if mode == "seq_mean_token_sum_norm":
        norm = getattr(algorithm, "max_seq_len", None)
        if not norm:
            raise ValueError("seq_mean_token_sum_norm needs algorithm.max_seq_len > 0")
    return LossFixConfig(reduction=SKYRL_MODES[mode], norm_constant=norm)


def group_ids_from_boundaries(
    prompt_boundaries: Sequence[tuple[int, int]], num_rows: int
) -> torch.Tensor:
    """Each row's prompt index (``int64``, ``[num_rows]``) from SkyRL's mini-batch-relative
    ``prompt_boundaries`` (``(start, end)`` per prompt, what its ``prompt_mean`` uses): the
    ``group_ids`` of step 3 in the module docstring, with ``num_groups`` =
    ``len(prompt_boundaries)``. Rows outside every prompt, or in two, are refused."""
    ids = torch.full((num_rows,), -1, dtype=torch.long)
    for p, (start, end) in enumerate(prompt_boundaries):
        if not 0 <= start <= end <= num_rows or bool((ids[start:end] >= 0).any()):
            raise ValueError(
                f"prompt_boundaries[{p}] = ({start}, {end}) overlaps another prompt or leaves "
                f"the mini-batch's {num_rows} rows"
            )
        ids[start:end] = p
    if bool((ids < 0).any()):
        row = int((ids < 0).nonzero()[0, 0])
        raise ValueError(f"row {row} of the mini-batch belongs to no prompt in prompt_boundaries")
    return ids


def raw_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """What the trainer hands the workers instead of SkyRL's pre-scaled advantages: the
    advantages themselves, zero outside the loss mask."""
    return advantages * (loss_mask > 0)


def _wrapper_class() -> type:
    # Imported on first use: importing the package must not need SkyRL.
    from skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper import (
        MegatronModelWrapper,
    )

    return MegatronModelWrapper


def _action_logprobs(wrapper: Any, logits: torch.Tensor, data: dict) -> torch.Tensor:
    """SkyRL's own log-prob kernels, as its ``loss_func`` calls them (unfused paths)."""
    import megatron.core.parallel_state as mpu
    from skyrl.backends.skyrl_train.distributed.megatron.model_utils import (
        from_parallel_logits_to_logprobs,
        from_parallel_logits_to_logprobs_packed_sequences,
    )

    tp_rank = mpu.get_tensor_model_parallel_rank()
    vocab = logits.shape[-1]
    packed = data.get("packed_seq_params")
    if packed is not None and data.get("packed_targets") is not None:
        token_logprobs = from_parallel_logits_to_logprobs_packed_sequences(
            logits,
            data["packed_targets"],
            packed.cu_seqlens_q_padded,
            data["sequences"].shape[1],
            vocab_start_index=tp_rank * vocab,
            vocab_end_index=(tp_rank + 1) * vocab,
            group=mpu.get_tensor_model_parallel_group(),
            inference_only=False,
            cp_group=mpu.get_context_parallel_group(),
            chunk_size=wrapper.cfg.logprobs_chunk_size,
            attention_mask=data["attention_mask"],
            sub_seq_lengths=data.get("sub_seq_lengths_list"),
        )
    else:
        token_logprobs = from_parallel_logits_to_logprobs(
            logits,
            data["sequences"],
            vocab_start_index=tp_rank * vocab,
            vocab_end_index=(tp_rank + 1) * vocab,
            tp_group=mpu.get_tensor_model_parallel_group(),
            inference_only=False,
            cp_group=None,
            chunk_size=wrapper.cfg.logprobs_chunk_size,
        )
    return token_logprobs[:, -data["num_actions"] :]


def _weighted_entropy(
    cfg: Any, logits: torch.Tensor, data: dict, weights: torch.Tensor
) -> torch.Tensor:
    """``sum(w * entropy)`` over this rank's action tokens, with SkyRL's entropy kernels (and
    the trainer config's chunking of them)."""
    import megatron.core.parallel_state as mpu
    from skyrl.backends.skyrl_train.distributed.megatron.model_utils import (
        vocab_parallel_entropy,
        vocab_parallel_entropy_packed_sequences,
    )

    num_actions = data["num_actions"]
    packed = data.get("packed_seq_params")
    if packed is not None and data.get("packed_targets") is not None:
        # SkyRL's packed kernel weights each token by its mask argument and divides this rank's
        # share by the micro-batch's weight total clamped at 1; multiplying back gives the sum.
        _, local = vocab_parallel_entropy_packed_sequences(
            logits,
            packed.cu_seqlens_q_padded,
            data["sequences"].shape[1],
            num_actions,
            data["attention_mask"],
            weights,
            mpu.get_context_parallel_group(),
            sub_seq_lengths=data.get("sub_seq_lengths_list"),
            chunk_size=cfg.vocab_entropy_chunk_size,
            chunk_memory_mb=cfg.vocab_entropy_chunk_memory_mb,
        )
        return local * weights.sum().detach().clamp(min=1.0)
    entropy = vocab_parallel_entropy(
        logits[:, -num_actions - 1 : -1, :],
        chunk_size=cfg.vocab_entropy_chunk_size,
        chunk_memory_mb=cfg.vocab_entropy_chunk_memory_mb,
    )
    return (entropy * weights).sum()


def _exact_loss(
    wrapper: Any, policy_loss_fn: Any, loss_config: Any, sft: bool, data: dict, logits: Any
) -> tuple:
    """Every term as a plain weighted sum with the plugin's weights (Tinker semantics)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl

    weights = data[wrapper.lossfix_config.weights_key]
    action_log_probs = _action_logprobs(wrapper, logits, data)
    # SkyRL's policy losses end in reduce_loss, a masked sum: the weights as the mask make it
    # sum(w * pg) with the raw advantages.
    policy_loss, loss_metrics = policy_loss_fn(
        action_log_probs,
        data["old_action_log_probs"],
        data["advantages"],
        config=loss_config,
        loss_mask=weights,
        rollout_logprobs=data.get("rollout_action_logprobs"),
    )
    loss = policy_loss
    report: dict[str, torch.Tensor] = {"policy_loss_sum": policy_loss.detach()}
    if loss_config.use_kl_loss and not sft:
        kl = compute_approx_kl(
            action_log_probs,
            data["base_action_log_probs"],
            loss_mask=weights,
            kl_estimator_type=loss_config.kl_estimator_type,
        ).sum()
        loss = loss + loss_config.kl_loss_coef * kl
        report["policy_kl_sum"] = kl.detach()
    if loss_config.use_entropy_loss and not sft:
        entropy = _weighted_entropy(wrapper.cfg, logits, data, weights)
        loss = loss - loss_config.entropy_loss_coef * entropy
        report["policy_entropy_sum"] = entropy.detach()
    num_tokens = (data["loss_mask"] > 0).sum()
    return loss, num_tokens, report


def _exact_forward_step(
    wrapper: Any,
    skyrl_step: Any,
    policy_loss_fn: Any,
    loss_config: Any,
    sft: bool,
    it: Any,
    model: Any,
) -> tuple:
    """SkyRL's forward_step (its batch preparation and model call) with the exact loss."""
    output, skyrl_loss = skyrl_step(it, model)
    data = skyrl_loss.keywords["data"]
    return output, partial(_exact_loss, wrapper, policy_loss_fn, loss_config, sft, data)


class _LossFixWrapperMixin:
    """The part of :class:`LossFixModelWrapper` that does not depend on SkyRL's import: its
    configuration, its construction from SkyRL's wrapper, and the exact step."""

    lossfix_config: LossFixConfig
    lossfix_schedule: LossFixSchedule

    def __init__(self, *args: Any, lossfix: LossFixConfig | str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)  # SkyRL's MegatronModelWrapper
        if lossfix is None:
            lossfix = lossfix_config_for(self.cfg.algorithm)
        if isinstance(lossfix, str):
            lossfix = LossFixConfig(reduction=lossfix)
        # SkyRL defers the gradients' data-parallel reduction to its optimizer step
        # (run_pending_grad_sync), so right after a step they are not yet equal on every
        # rank: the first-step check runs only when asked for.
        if lossfix.self_check is None:
            left_out(
                "SkyRL's model wrapper",
                "the adapter writes the loss from SkyRL's, and SkyRL reduces the gradients "
                "over data-parallel ranks only at its optimizer step",
            )
        lossfix = dataclasses.replace(lossfix, self_check=bool(lossfix.self_check))
        self.lossfix_config = lossfix
        # One schedule for the wrapper's life: its per-model checks run once.
        self.lossfix_schedule = LossFixSchedule(lossfix)

    @classmethod
    def from_wrapper(cls, wrapper: Any, lossfix: LossFixConfig | str | None = None) -> Any:
        """The same model, optimizer and policy loss as SkyRL's ``wrapper``, with the
        plugin's step: ``self.model = LossFixModelWrapper.from_wrapper(self.model)`` after
        the policy worker's ``init_model``."""
        return cls(
            wrapper.cfg,
            wrapper.actor_module,
            wrapper.actor_optimizer,
            wrapper.policy_loss_fn,
            is_vlm=wrapper.is_vlm,
            lossfix=lossfix,
        )

    def _lossfix_forward_backward(self, *, forward_step_func: Any, **kwargs: Any) -> Any:
        step = partial(_exact_forward_step, self, forward_step_func, *self._lossfix_loss)
        return self.lossfix_schedule(forward_step_func=step, **kwargs)


def _make_class() -> type:
    base = _wrapper_class()

    class LossFixModelWrapper(_LossFixWrapperMixin, base):  # type: ignore[misc, valid-type]
        """``MegatronModelWrapper`` whose training step runs under :class:`LossFixSchedule` with
        every loss term weighted by the plugin (see the module docstring).

        ``lossfix``: a :class:`LossFixConfig` or mode name; None takes SkyRL's
        ``algorithm.loss_reduction``. The advantages in the micro-batches must be raw (not
        pre-scaled by SkyRL's driver).
        """

        def forward_backward_mini_batch(
            self,
            micro_batches: list[dict],
            seq_len: int,
            micro_batch_size: int,
            temperature: float = 1.0,
            loss_fn: str | None = None,
            loss_fn_config: dict[str, Any] | None = None,
            forward_only: bool = False,
            return_per_token_outputs: bool = True,
        ) -> list[dict]:
            from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
            from skyrl.backends.skyrl_train.workers.megatron import megatron_model_wrapper as mw

            unsupported = (
                forward_only
                or temperature != 1.0
                or self._fused_lm_head
                or self.lossfix_config.reduction == "off"
            )
            if unsupported:
                return super().forward_backward_mini_batch(
                    micro_batches,
                    seq_len,
                    micro_batch_size,
                    temperature,
                    loss_fn,
                    loss_fn_config,
                    forward_only,
                    return_per_token_outputs,
                )
            if loss_fn_config:
                raise ValueError(
                    "LossFixModelWrapper: loss_fn_config overrides are not supported; set them "
                    "in the trainer's algorithm config"
                )
            policy_loss_fn = (
                PolicyLossRegistry.get(loss_fn) if loss_fn is not None else self.policy_loss_fn
            )
            # SFT (cross entropy) has no KL or entropy term.
            sft = loss_fn == "cross_entropy"
            self._lossfix_loss = (policy_loss_fn, self.cfg.algorithm, sft)
            # SkyRL looks the schedule up by this module-level name when the step starts; it is
            # swapped for the call only, so forward-only passes and other wrappers keep Megatron's.
            original = mw.get_forward_backward_func
            mw.get_forward_backward_func = lambda *a, **k: self._lossfix_forward_backward
            try:
                return super().forward_backward_mini_batch(
                    micro_batches,
                    seq_len,
                    micro_batch_size,
                    temperature,
                    loss_fn,
                    return_per_token_outputs=return_per_token_outputs,
                )
            finally:
                mw.get_forward_backward_func = original

    LossFixModelWrapper.__qualname__ = "LossFixModelWrapper"
    return LossFixModelWrapper


def __getattr__(name: str) -> Any:
    # LossFixModelWrapper subclasses SkyRL's class, which is imported only when asked for.
    if name == "LossFixModelWrapper":
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
