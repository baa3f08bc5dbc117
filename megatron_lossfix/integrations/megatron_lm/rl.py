"""Megatron-LM's own RL loop (``train_rl.py`` with ``megatron/rl``) through the plugin.

``train_rl.py`` trains GRPO with Megatron-LM's ``train()``: each step's micro-batches are rollout
rows (``prepare_data_for_update``) or packed bins of them (``--rl-use-sequence-packing``), and its
``loss_func`` returns ``(sum(loss * mask), tokens_of_the_micro_batch, report)`` with a zero count
turned into 1. Stock, the step's gradient therefore depends on the layout: Megatron-LM pads the
rows to a multiple of DP x micro-batch size and the bins to the same count on every DP rank, and
every padding row or empty bin adds a micro-batch (default path) or a phantom token (per-token
path). With ``--loss-reduction MODE`` the patched ``train_rl.py`` runs the step through
:class:`~megatron_lossfix.integrations.megatron_lm.training.MegatronLMLossFix`, as the patched
``pretrain_gpt.py`` does:

- :func:`rl_micro_batch` turns each micro-batch ``train_rl.forward_step`` would read into what
  the plugin reads: the loss mask of the log-prob positions and, for a packed bin, the sequence
  boundaries. A *sequence* is one trajectory row as Megatron-LM forms them: one per turn up to
  core_v0.19; on main one per rollout whose turns form a prefix chain, and one per turn of any
  other. Padding rows and empty bins have no loss token: they weigh exactly 0 and count nowhere.
- ``train_rl.forward_step`` reads its own item back (``megatron_lm.Recording``), and its
  ``loss_func`` receives ``lossfix=``: a callable that returns ``(sum(w * l), num_tokens,
  report)`` with this micro-batch's weights, reports ``lm loss`` so that Megatron-LM logs the
  mode's global loss, and the other RL terms (KL, ratios, entropy, truncation) as token means
  without phantom tokens. Nothing in it synchronizes with the host.
- :func:`check_args` refuses, before the first step and on every rank (each rank runs the same
  check on the same flags), what the plugin cannot make exact here.

Rollout generation (the inference engine, agents over HTTP) is not touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from megatron_lossfix.args import from_args
from megatron_lossfix.integrations.megatron_lm import rl_groups as megatron_lm_rl_groups
from megatron_lossfix.integrations.megatron_lm import rl_steps as megatron_lm_rl_steps
from megatron_lossfix.integrations.megatron_lm import training as megatron_lm
from megatron_lossfix.integrations.megatron_lm.cpu import enable_cpu_megatron_lm
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.mode_record import Ids
from megatron_lossfix.runtime.modes import ALIASES, MODE_RECORDS, STOCK, mode_of
from megatron_lossfix.runtime.process_groups import StepGroups
from megatron_lossfix.step.selfcheck import left_out

__all__ = [
    "ITEM_KEY",
    "RL_MODES",
    "MegatronLMRLLossFix",
    "add_args_provider",
    "check_args",
    "enable_cpu_megatron_lm",
    "rl_micro_batch",
    "wrap_forward_backward_func",
]

#: The ids the RL micro-batches carry (:func:`rl_micro_batch`: each row's GRPO group; no
#: trajectory ids, which the sequence modes take only where given).
RL_IDS = (Ids.NONE, Ids.PROMPT_GROUPS, Ids.TRAJECTORIES)
#: The modes Megatron-LM's RL loop honours (``off``: stock), with their aliases: those whose
#: ids the RL micro-batches carry. A mode that needs more is refused here until they do.
RL_MODES: tuple[str, ...] = (
    *(m.name for m in MODE_RECORDS if not m.stock and m.ids in RL_IDS),
    *(a for a, m in ALIASES.items() if mode_of(m).ids in RL_IDS),
    STOCK,
)

#: Where the plugin's micro-batch dict keeps the item ``train_rl.forward_step`` reads.
ITEM_KEY = "megatron_lm_rl_item"

add_args_provider = megatron_lm.add_args_provider


def check_args(args: argparse.Namespace) -> LossFixConfig | None:
    """The plugin config of a ``train_rl.py`` run, or None without ``--loss-reduction``.

    Raises ``ValueError`` with one line naming the flag for what the RL step cannot serve
    exactly: context parallelism (``train_rl`` all-reduces each micro-batch's loss over the CP
    group and its CP inference model is another one), CUDA graphs of the training step (they
    replay a captured loss function), an explicit ``--lossfix-self-check`` (rollout rows and
    packed bins cannot be re-split; the default check is skipped here), a mode outside
    :data:`RL_MODES`, and what the ``pretrain_gpt.py`` integration refuses
    (:func:`~megatron_lossfix.integrations.megatron_lm.training.incompatible_settings`).
    """
    rl_utils = sys.modules.get("megatron.rl.rl_utils")  # train_rl.py imported it
    if rl_utils is not None:
        megatron_lm_rl_groups.install(rl_utils)  # records each row's GRPO group, nothing else
    packing = sys.modules.get("megatron.rl.sequence_packing_utils")
    if packing is not None:  # packs each step's rows alone, under --loss-reduction only
        megatron_lm_rl_steps.install(packing)
    mode = getattr(args, "loss_reduction", None)
    if mode is not None and mode not in RL_MODES:
        raise ValueError(
            f"megatron_lossfix: --loss-reduction {mode} is not available in Megatron-LM's RL "
            f"loop (train_rl.py); use one of {', '.join(RL_MODES)}"
        )
    try:
        config = from_args(args)  # a missing --loss-norm-constant, ...: LossFixConfig's line
    except ValueError as exc:
        raise ValueError(f"megatron_lossfix: {exc}") from None
    if config is None:
        return None
    reasons = megatron_lm.incompatible_settings(args)
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        reasons.append(f"--context-parallel-size {args.context_parallel_size} (use 1)")
    sampled = getattr(args, "grpo_prompts_per_step", None), getattr(args, "grpo_group_size", None)
    batch = getattr(args, "global_batch_size", None)
    if None not in (*sampled, batch) and (sampled[0] * sampled[1]) % batch:
        reasons.append(
            f"--global-batch-size {batch} (it must divide --grpo-prompts-per-step x "
            f"--grpo-group-size = {sampled[0] * sampled[1]}: each optimizer step of a collection "
            "trains its share of the rollouts)"
        )
    if getattr(args, "rl_training_cuda_graphs", False):
        reasons.append("--rl-training-cuda-graphs")
    if config.self_check:
        reasons.append("--lossfix-self-check (rollout rows and packed bins are not re-split)")
    if reasons:
        raise ValueError(
            "megatron_lossfix: --loss-reduction in train_rl.py cannot be combined with "
            + "; ".join(reasons)
        )
    # Not asked for: the default first-step check stays out here, and says so once.
    if config.self_check is None:
        left_out(
            "Megatron-LM's RL loop (train_rl.py)",
            "the plugin writes its loss (rl_loss over the plugin's weights) and its rollout "
            "rows and packed bins, so there is no user loss to check",
        )
    return dataclasses.replace(config, self_check=False)


def wrap_forward_backward_func(forward_backward_func: Callable, args: argparse.Namespace) -> Any:
    """What the patched ``training.py`` calls for ``train_rl.py`` (``--perform-rl-step``):
    a :class:`MegatronLMRLLossFix`, or the function unchanged without ``--loss-reduction``."""
    config = check_args(args)
    if config is None:
        return forward_backward_func
    if isinstance(forward_backward_func, megatron_lm.MegatronLMLossFix):
        forward_backward_func = forward_backward_func.inner
    wrapper = MegatronLMRLLossFix(
        config, forward_backward_func, getattr(args, "lossfix_metrics_out", None)
    )
    if wrapper.metrics_out is not None:
        megatron_lm.record_train_steps(wrapper)
    return wrapper


# ---------------------------------------------------------------------------- micro-batches
def _packing_context() -> Any:
    """The current step's packed bins (``get_rl_runtime_state().packing_context``), or None."""
    from megatron.rl.rl_utils import get_rl_runtime_state

    return get_rl_runtime_state().packing_context


def rl_micro_batch(
    item: Any,
    mask_key: str,
    cu_seqlens_key: str,
    groups: tuple[str, str, megatron_lm_rl_groups.RowGroups] | None = None,
) -> dict:
    """One micro-batch of ``train_rl.py`` as the plugin reads it: ``{mask_key: [rows, positions]
    loss mask, cu_seqlens_key: boundaries (packed bins only), ITEM_KEY: item}``.

    ``item`` is what ``train_rl.forward_step`` reads from its data iterator: the tensors of a
    micro-batch of rows (tokens, advantages, old log-probs, loss mask, ...) or, with sequence
    packing, ``(bin_index,)``. The mask is that of the log-prob positions, as ``forward_step``
    slices it (``loss_mask[:, 1:]``): position ``j`` scores token ``j + 1``. In a packed bin
    every packed trajectory is one sequence: ``seq_starts`` of the bin, shifted one position to
    the left like the mask (the tokens after the last trajectory form one more, empty, segment).

    ``groups``: ``(group ids key, group count key, record)`` adds each sequence's GRPO group
    (:mod:`~megatron_lossfix.integrations.megatron_lm.rl_groups`) for ``group_mean``.
    """
    context = _packing_context()
    if context is not None and len(item) == 1:  # a packed bin: (bin_index,)
        index = int(item[0])  # a CPU tensor from the bin DataLoader: no device sync
        mask = context.packed_loss_mask[index : index + 1, 1:]
        starts = list(context.packing_info.seq_starts[index]) or [0]
        bounds = [0] + [max(int(s) - 1, 0) for s in starts[1:]]
        if len(bounds) < 2:
            bounds.append(0)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int64, device=mask.device)
        batch = {mask_key: mask, cu_seqlens_key: cu_seqlens, ITEM_KEY: item}
        packed = True
    else:
        mask = item[3][:, 1:]  # train_rl.forward_step: loss_mask[:, 1:]
        batch = {mask_key: mask, ITEM_KEY: item}
        packed = False
    if groups is not None:
        ids_key, count_key, record = groups
        bin_rows = context.packing_info.bin_seq_indices[index] if packed else None
        ids = megatron_lm_rl_groups.micro_batch_groups(record, mask.shape[0], bin_rows)
        batch[ids_key] = torch.tensor(ids, dtype=torch.int64, device=mask.device)
        batch[count_key] = record.count
    return batch


def _rl_micro_batches(source: Any, config: LossFixConfig) -> Iterator[dict]:
    """:func:`rl_micro_batch` of each item of ``source`` (an iterator: Megatron-LM's
    ``RerunDataIterator`` has ``__next__`` only), with the rows' groups for ``group_mean``."""
    groups = None
    if mode_of(config.reduction).ids is Ids.PROMPT_GROUPS:
        record = megatron_lm_rl_groups.step_groups(source)
        if record is None:
            raise ValueError(
                f"megatron_lossfix: --loss-reduction {config.reduction} needs the rollout "
                "groups of prepare_data_for_update; apply our patch to this Megatron-LM checkout "
                "(python -m megatron_lossfix.patches apply PATH)"
            )
        groups = (config.group_ids_key, config.num_groups_key, record)
    while True:
        try:
            item = next(source)
        except StopIteration:
            return
        yield rl_micro_batch(item, config.loss_mask_key, config.cu_seqlens_key, groups)


class MegatronLMRLLossFix(megatron_lm.MegatronLMLossFix):
    """:class:`~megatron_lossfix.integrations.megatron_lm.training.MegatronLMLossFix` for the
    step of ``train_rl.py``: its micro-batches (:func:`rl_micro_batch`), its ``forward_step``
    reading them back, and its ``loss_func``'s RL reports."""

    def _loss_chunk_iterator(self, source: Any, tp_group: Any, tp_rank: int) -> Any:
        """The RL micro-batches as the plugin reads them (:func:`rl_micro_batch`); every
        tensor-parallel rank builds the RL data itself, so nothing is broadcast."""
        if source is None:
            return None
        return _rl_micro_batches(source, self.config)

    def _wrap_forward_step(
        self, forward_step_func: Callable, tp_rank: int, groups: StepGroups
    ) -> Callable:
        weights_key = self.config.weights_key

        def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> tuple:
            items = (
                None if data_iterator is None else megatron_lm.Recording(data_iterator, ITEM_KEY)
            )
            output, loss_func = forward_step_func(items, model, *args, **kwargs)
            batch = None if items is None else items.last
            weights = batch.get(weights_key) if isinstance(batch, Mapping) else None
            if weights is None or mode_of(self.config.reduction).stock:
                return output, loss_func  # not the loss stage, or stock Megatron-LM
            if not megatron_lm.accepts_kwarg(loss_func, megatron_lm.LOSS_KWARG):
                raise TypeError(
                    "megatron_lossfix: train_rl.py's loss_func does not accept lossfix=...; "
                    "apply our patch to this Megatron-LM checkout "
                    "(python -m megatron_lossfix.patches apply PATH)"
                )
            lossfix = functools.partial(self._rl_loss, weights)
            return output, functools.partial(loss_func, **{megatron_lm.LOSS_KWARG: lossfix})

        return forward_step

    def _rl_loss(
        self,
        weights: torch.Tensor,
        output_tensor: torch.Tensor,
        loss_mask: torch.Tensor,
        terms: Mapping[str, torch.Tensor],
    ) -> tuple:
        """``(sum(w * l), num_tokens, report)`` of one micro-batch of ``train_rl.py``.

        ``report`` holds ``lm loss`` as :meth:`_loss` reports it (Megatron-LM then logs the
        step's loss L) and, for each of ``terms`` (per-position values: KL, ratios, ...),
        ``[sum(mask * term), sum(mask)]``, whose reduction Megatron-LM logs as the term's token
        mean over the step.
        """
        loss, num_tokens, report = self._loss(weights, output_tensor.float())
        mask = loss_mask.float().reshape(weights.shape)
        count = mask.sum()
        for name, term in terms.items():
            value = (term.float().reshape(mask.shape) * mask).sum()
            report[name] = torch.stack([value.detach(), count])
        return loss, num_tokens, report


# The patched training.py asks megatron_lm for the step; for train_rl.py it is this one.
megatron_lm.rl_step = wrap_forward_backward_func
