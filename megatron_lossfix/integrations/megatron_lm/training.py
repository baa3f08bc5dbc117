"""Megatron-LM integration: what our patch of Megatron-LM's ``pretrain_gpt.py`` and
``megatron/training/training.py`` calls (``python -m megatron_lossfix.patches apply PATH``).

The patch itself stays a handful of lines; the code lives here:

- :func:`add_args_provider` composes our flags with Megatron-LM's ``extra_args_provider``.
- :func:`wrap_forward_backward_func` (called by ``training.py``'s ``train()`` when
  ``--loss-reduction`` is given) puts :class:`~megatron_lossfix.LossFixSchedule` around
  Megatron's ``forward_backward_func`` and wraps the user's ``forward_step`` so that the loss
  function it returns receives ``lossfix=...``: a callable that turns the model's per-token losses
  into ``(sum(w * l), num_tokens, report)`` with this micro-batch's weights (sliced for context
  parallelism like Megatron-LM slices the batch).
- The report is Megatron-LM's ``{"lm loss": [sum, count]}``, which ``train_step`` sums over
  micro-batches and the DP x CP group and logs as ``sum / count``. We report
  ``[contribution, indicator]``: the contributions add up to the step's loss L (docs/design.md
  §2) and the indicator is 1 on exactly one micro-batch of one DP x CP rank, so the logged
  ``lm loss`` is L.
- The loss stage's batches (masks to the device and to the tensor-parallel ranks, the
  micro-batch ``forward_step`` read) are :mod:`.batches`; ``--lossfix-metrics-out``'s record of
  each step is :mod:`.metrics` (both re-exported here).
- :func:`enable_cpu_megatron_lm` (from :mod:`.cpu`, re-exported for the patch) runs Megatron-LM's
  training loop on a machine without CUDA (gloo).

With ``--loss-reduction`` absent nothing here touches the training step; with ``off`` the step
is stock Megatron (the metrics record holds the loss Megatron-LM logs, no counts).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_lossfix.args import add_lossfix_args, from_args
from megatron_lossfix.integrations.megatron_lm.batches import (
    MasksToDevice,
    ReceivedMasks,
    Recording,
)
from megatron_lossfix.integrations.megatron_lm.cpu import enable_cpu_megatron_lm
from megatron_lossfix.integrations.megatron_lm.metrics import (
    LOSS_KEY,
    record_numbers,
    record_train_steps,
)
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.losses import weighted_loss
from megatron_lossfix.runtime.mode_record import megatron_normalizes
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.process_groups import StepGroups, group_size
from megatron_lossfix.step.megatron_compat import (
    model_parallel_groups,
    resolve_groups,
    slice_batch_for_cp,
)
from megatron_lossfix.step.schedule import LossFixSchedule
from megatron_lossfix.step.selfcheck import first_step_check

__all__ = [
    "LOSS_KEY",
    "MasksToDevice",
    "MegatronLMLossFix",
    "Recording",
    "add_args_provider",
    "enable_cpu_megatron_lm",
    "record_numbers",
    "record_train_steps",
    "wrap_forward_backward_func",
]

#: The keyword our patch adds to ``pretrain_gpt.loss_func``.
LOSS_KWARG = "lossfix"

#: What :func:`wrap_forward_backward_func` builds for ``train_rl.py`` (``--perform-rl-step``):
#: ``megatron_lm_rl.wrap_forward_backward_func``, set when the patched ``train_rl.py`` imports
#: that module (which builds on this one).
rl_step: Callable[[Callable, argparse.Namespace], Any] | None = None


# ---------------------------------------------------------------------------------- flags
def add_args_provider(
    extra_args_provider: Callable[[argparse.ArgumentParser], Any] | None = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that adds our flags after Megatron-LM's own provider (if any).

    It adds :func:`megatron_lossfix.args.add_lossfix_args` with ``--lossfix-metrics-out``.
    On a machine without CUDA, ``--distributed-backend`` defaults to ``gloo`` (NCCL cannot run
    there, so no run that could have worked changes).
    """

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            # Megatron-LM's providers return the parser; tolerate ones that return None.
            parser = extra_args_provider(parser) or parser
        add_lossfix_args(parser, megatron_lm=True)
        if not torch.cuda.is_available():
            parser.set_defaults(distributed_backend="gloo")
        return parser

    return provider


# ---------------------------------------------------------------------------------- the step


def accepts_kwarg(func: Callable, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # builtins, C callables: let the call decide
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class MegatronLMLossFix:
    """Megatron-LM's ``forward_backward_func`` with exact, layout-invariant normalization.

    Wraps :class:`~megatron_lossfix.LossFixSchedule`; what it adds is Megatron-LM's plumbing:
    data iterators only on tensor-parallel rank 0 (masks are broadcast), ``pretrain_gpt``'s
    ``get_batch`` dropping unknown batch keys (weights are handed to the loss function as
    ``lossfix=``), context-parallel slicing, and the ``[sum, count]`` loss report.

    Args:
        config: the plugin configuration (``off``: stock Megatron).
        forward_backward_func: Megatron's schedule (``get_forward_backward_func()``).
        metrics_out: append one JSON line per step here (last rank), or None.
        sft_evaluation: the schedule of Megatron-LM's ``evaluate()`` under ``--sft``, which
            divides each micro-batch's ``[value, count]`` report and averages the quotients
            over micro-batches and DP x CP ranks: each micro-batch then reports
            ``[contribution x M x DP x CP, 1]``, whose average is the step's loss L.
    """

    def __init__(
        self,
        config: LossFixConfig,
        forward_backward_func: Callable[..., Any],
        metrics_out: str | None = None,
        *,
        sft_evaluation: bool = False,
    ) -> None:
        self.config = config
        # The self-check runs here, around Megatron-LM's plumbing (TP-rank-0 data, the mask
        # broadcast, the loss keyword), so that its re-runs go through that plumbing too.
        self.schedule = LossFixSchedule(
            dataclasses.replace(config, self_check=False), forward_backward_func
        )
        self.self_check = first_step_check(config)
        self.inner = forward_backward_func
        """The wrapped Megatron schedule."""
        self.metrics_out = metrics_out
        self.sft_evaluation = sft_evaluation
        self._sft_scale: float | None = None
        self.last_metrics: dict[str, float] | None = None
        self._indicator_pending = False
        self._streaming = False
        self._step_start = 0.0

    @property
    def last_step(self) -> Any:
        """The wrapped schedule's record of the last step."""
        return self.schedule.last_step

    def __call__(self, **call: Any) -> list:
        """Megatron-LM calls it exactly like the function it replaces (see :meth:`_step`)."""
        if self.self_check is not None and self.self_check.due(call):
            return self.self_check.run(self.schedule.step, call, via=self._step)
        return self._step(**call)

    def _step(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        **kwargs: Any,
    ) -> list:
        from megatron.core.utils import get_model_config

        self._step_start = time.perf_counter()
        chunks = model if isinstance(model, list) else [model]
        per_token = bool(get_model_config(chunks[0]).calculate_per_token_loss)
        cfg = self.config
        # The rule of LossFixSchedule's passthrough: these modes use the mask as the weights and
        # leave the normalization to Megatron, so the report keeps Megatron-LM's [sum,
        # num_tokens] (under mask_in_loss too, as before: the report is not the weights).
        self._streaming = megatron_normalizes(mode_of(cfg.reduction), per_token)
        groups = resolve_groups(kwargs.get("pg_collection"))
        self._sft_scale = None
        if self.sft_evaluation:
            if self._streaming:  # the weights are the raw mask there: stock evaluation
                return self.inner(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=model,
                    num_microbatches=num_microbatches,
                    **kwargs,
                )
            self._sft_scale = float(num_microbatches * groups.dp_cp_size)
        # [contribution, indicator]: count 1 exactly once per step over the DP x CP group.
        self._indicator_pending = groups.dp_cp is None or dist.get_rank(groups.dp_cp) == 0
        tp_group = model_parallel_groups(kwargs.get("pg_collection")).tp
        tp_group = tp_group if group_size(tp_group) > 1 else None
        tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        if groups.is_last_stage:
            data_iterator = self._loss_stage_iterators(data_iterator, tp_group, tp_rank)
        result = self.schedule(
            forward_step_func=self._wrap_forward_step(forward_step_func, tp_rank, groups),
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            **kwargs,
        )
        if self.metrics_out is not None:
            # Collective over DP x CP and PP: every rank runs it, every step.
            self.last_metrics = self.schedule.step_metrics()
        return result

    def _loss_stage_iterators(self, data_iterator: Any, tp_group: Any, tp_rank: int) -> Any:
        iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
        iterators[-1] = self._loss_chunk_iterator(iterators[-1], tp_group, tp_rank)
        return iterators if isinstance(data_iterator, list) else iterators[0]

    def _loss_chunk_iterator(self, source: Any, tp_group: Any, tp_rank: int) -> Any:
        """What the plugin reads on the loss stage: ``pretrain_gpt``'s batches with their masks
        on the device; on tensor-parallel ranks other than 0 (no data iterator), the masks
        received from TP rank 0."""
        key = self.config.loss_mask_key
        if tp_rank > 0:
            return ReceivedMasks(key, tp_group)
        return None if source is None else MasksToDevice(source, key, tp_group)

    def _wrap_forward_step(
        self, forward_step_func: Callable, tp_rank: int, groups: StepGroups
    ) -> Callable:
        weights_key = self.config.weights_key

        def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> tuple:
            batch = None
            if tp_rank > 0 and groups.is_last_stage and data_iterator is not None:
                # Receive the mask before forward_step's own TP broadcasts, in the same order
                # as TP rank 0, whose get_batch reads (and broadcasts) it first.
                batch = next(data_iterator)
                inner = data_iterator
            else:
                inner = Recording(data_iterator) if data_iterator is not None else None
            output, loss_func = forward_step_func(inner, model, *args, **kwargs)
            if batch is None and inner is not None:
                batch = inner.last
            weights = batch.get(weights_key) if isinstance(batch, Mapping) else None
            if weights is None or mode_of(self.config.reduction).stock:
                return output, loss_func  # not the loss chunk, or stock Megatron
            if (
                isinstance(batch, Mapping)
                and (batch.get("cu_seqlens") is not None or batch.get("local_cp_size") is not None)
                and groups.cp_size > 1
            ):
                raise NotImplementedError(
                    "megatron_lossfix: packed (THD) or hybrid context-parallel batches are not "
                    "supported with --loss-reduction yet; use --context-parallel-size 1"
                )
            if not accepts_kwarg(loss_func, LOSS_KWARG):
                raise TypeError(
                    "megatron_lossfix: the loss function returned by forward_step does not "
                    "accept lossfix=...; apply our patch to this Megatron-LM checkout "
                    "(python -m megatron_lossfix.patches apply PATH) or add the keyword"
                )
            if groups.cp_size > 1:
                # Sliced by Megatron's own function, as pretrain_gpt.get_batch slices tokens.
                weights = slice_batch_for_cp({weights_key: weights}, groups.cp)[weights_key]
            return output, functools.partial(
                loss_func, **{LOSS_KWARG: functools.partial(self._loss, weights)}
            )

        return forward_step

    def _loss(self, weights: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
        """``(sum(w * l), num_tokens, {"lm loss": [value, count]})`` for one micro-batch."""
        if output_tensor.shape != weights.shape:
            if output_tensor.numel() != weights.numel():
                raise ValueError(
                    f"megatron_lossfix: per-token losses {tuple(output_tensor.shape)} do not "
                    f"match this micro-batch's weights {tuple(weights.shape)}"
                )
            output_tensor = output_tensor.reshape(weights.shape)
        loss, num_tokens, _ = weighted_loss(weights, output_tensor)
        if self._sft_scale is not None:
            # --sft evaluation averages value / count over micro-batches and DP x CP ranks.
            count = torch.ones((), dtype=torch.float32, device=loss.device)
            report = {LOSS_KEY: torch.stack([loss.detach().float() * self._sft_scale, count])}
            return loss, num_tokens, report
        if self._streaming:
            count = num_tokens.to(torch.float32)  # weights are the mask: Megatron-LM's report
        else:
            count = torch.ones((), dtype=torch.float32, device=loss.device)
            if not self._indicator_pending:
                count = count * 0
            self._indicator_pending = False
        report = {LOSS_KEY: torch.stack([loss.detach().float(), count]).view(2)}
        return loss, num_tokens, report


def wrap_forward_backward_func(forward_backward_func: Callable, args: argparse.Namespace) -> Any:
    """What the patched ``training.py`` calls when ``--loss-reduction`` is given.

    Returns a :class:`MegatronLMLossFix` (checking its first step unless
    ``--no-lossfix-self-check``), or the function unchanged when ``--loss-reduction`` is absent.
    Refuses combinations that would silently bypass the plugin.
    """
    if getattr(args, "perform_rl_step", False):  # train_rl.py: its own micro-batches and loss
        if rl_step is None:
            raise TypeError(
                "megatron_lossfix: --perform-rl-step, but train_rl.py does not import "
                "megatron_lossfix.integrations.megatron_lm.rl; apply our patch to this "
                "Megatron-LM checkout (python -m megatron_lossfix.patches apply PATH)"
            )
        return rl_step(forward_backward_func, args)
    config = from_args(args)
    if config is None:
        return forward_backward_func
    if isinstance(forward_backward_func, MegatronLMLossFix):
        # train() asked the module for its schedule after _route_evaluation replaced it.
        forward_backward_func = forward_backward_func.inner
    reasons = incompatible_settings(args)
    if reasons:
        raise ValueError(
            "megatron_lossfix: --loss-reduction cannot be combined with " + "; ".join(reasons)
        )
    wrapper = MegatronLMLossFix(
        config, forward_backward_func, getattr(args, "lossfix_metrics_out", None)
    )
    if wrapper.metrics_out is not None:
        record_train_steps(wrapper)
    _route_evaluation(config, args)
    return wrapper


def incompatible_settings(args: argparse.Namespace) -> list[str]:
    """The Megatron-LM settings ``--loss-reduction`` cannot be combined with, as flags (they
    would bypass the plugin or break what it assumes); empty when there are none."""
    reasons = []
    if getattr(args, "modelopt_enabled", False):
        reasons.append("ModelOpt (its loss_func replaces pretrain_gpt's)")
    if getattr(args, "logits_load_dir", None) is not None:
        reasons.append("--logits-load-dir (offline distillation loss)")
    scope = [str(s) for s in (getattr(args, "cuda_graph_scope", None) or [])]
    if getattr(args, "cuda_graph_impl", "none") == "full_iteration" or (
        getattr(args, "cuda_graph_impl", "none") == "local"
        and any(s.endswith("full_iteration") for s in scope)
    ):
        reasons.append("full-iteration CUDA graphs (the step reads its data before the graph)")
    if getattr(args, "hybrid_context_parallel", False):
        reasons.append("--hybrid-context-parallel")
    if (getattr(args, "context_parallel_size", 1) or 1) > 1 and getattr(
        args, "dataloader_inter_document_masking", False
    ):
        # Megatron-LM then balances CP shards per sequence; our weights are sliced plainly.
        reasons.append("--dataloader-inter-document-masking with context parallelism")
    return reasons


def _route_evaluation(config: LossFixConfig, args: argparse.Namespace) -> None:
    """Make Megatron-LM's ``evaluate()`` weigh its validation loss by the plugin's mode.

    ``evaluate()`` asks ``training.get_forward_backward_func`` for its own schedule. Without
    ``--sft`` it sums ``[loss, tokens]`` over micro-batches, DP x CP ranks and ``--eval-iters``
    and divides: the exact token mean, pooled over the evaluation, so ``token_mean`` is left as
    it is. Every other mode is routed through the plugin (the logged value is then the mean
    over ``--eval-iters`` of that mode's global loss of each evaluation batch), and so is every
    mode under ``--sft``, where ``evaluate()`` averages per-micro-batch means instead. ``off``
    stays stock. Wrapping the module attribute, as for ``train_step``, affects this run only.
    """
    if megatron_normalizes(mode_of(config.reduction), per_token=not getattr(args, "sft", False)):
        return  # evaluate() pools [loss, tokens] without --sft: Megatron's per-token division
    try:
        from megatron.training import training
    except ImportError:  # megatron-core alone: no Megatron-LM evaluate() to route
        return
    original = training.get_forward_backward_func
    original = getattr(original, "_lossfix_original", original)  # once per run, not nested
    sft = bool(getattr(args, "sft", False))

    @functools.wraps(original)
    def get_forward_backward_func(*fargs: Any, **fkwargs: Any) -> MegatronLMLossFix:
        return MegatronLMLossFix(config, original(*fargs, **fkwargs), sft_evaluation=sft)

    get_forward_backward_func._lossfix_original = original
    training.get_forward_backward_func = get_forward_backward_func
