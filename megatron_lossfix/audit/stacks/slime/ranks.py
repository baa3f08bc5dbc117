"""``--stack slime``: what each rank runs, slime's training step under a layout.

slime's ``forward_step`` of ``train_one_step`` is restated here (``get_batch``, the model call,
``partial(loss_function, ...)``; ``train_one_step`` itself also runs slime's optimizer step and
releases the gradients); the schedule is the one ``train_one_step`` looks up on slime's
``model`` module: Megatron-Core's, or the adapter's once its switch ran
(:func:`megatron_lossfix.integrations.slime.adapter.enable`, or ``enable_mask_in_loss``).
Where no GPU is visible slime gets a CPU device through its own accelerator registry.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from megatron_lossfix.audit.oracle import OracleCase, microbatch_plan
from megatron_lossfix.audit.stacks.slime import batch as sb

__all__ = ["ROWS", "SLIME_ROW", "EXCLUDED_ROW", "runs", "slime_layout_grads", "use_cpu_accelerator"]

SLIME_ROW, ADAPTED_ROW = "slime", "slime+lossfix"
#: The adapter with the plugin's ``--lossfix-mask-in-loss`` (settings that drop tokens only).
EXCLUDED_ROW = "slime+lossfix+mask-in-loss"
ROWS: tuple[str, ...] = (SLIME_ROW, ADAPTED_ROW, EXCLUDED_ROW)
#: The modes the settings beyond ``ppo`` run in (``per_sample`` is ``per_rollout``'s special case).
SETTING_MODES: tuple[str, ...] = ("per_rollout", "per_token")


def runs(
    modes: Sequence[str], settings: Sequence[str], rows: Sequence[str] = ROWS
) -> list[tuple[str, str, str]]:
    """Every ``(row, mode, setting)`` a layout runs: ``ppo`` in every mode, the other settings
    in :data:`SETTING_MODES`, the mask-in-loss row for the settings that drop tokens."""
    out = []
    for setting in settings:
        for mode in modes:
            if setting != "ppo" and mode not in SETTING_MODES:
                continue
            for row in rows:
                if row != EXCLUDED_ROW or setting in sb.DROPPING:
                    out.append((row, mode, setting))
    return out


def use_cpu_accelerator() -> None:
    """Where no GPU is visible, give slime a CPU device through its own accelerator registry
    (``slime.utils.accelerator.register_accelerator``; slime registers CUDA and MUSA only):
    its ``get_batch`` asks the accelerator where to put ``cu_seqlens``."""
    if torch.cuda.is_available():
        return
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    class CPUAccelerator(Accelerator):
        name = device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index: Any = None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index: Any = None) -> str:
            return "cpu"

        def set_device(self, index: Any) -> None:
            return None

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device: Any = None) -> None:
            return None

        def current_stream(self, device: Any = None) -> Any:
            return None

        def default_stream(self, device: Any = None) -> Any:
            return None

        def empty_cache(self) -> None:
            return None

        def mem_get_info(self, device: Any = None) -> tuple[int, int]:
            return (0, 0)

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        def memory_reserved(self, device: Any = None) -> int:
            return 0

    accelerator.register_accelerator("cpu", CPUAccelerator, lambda: True, priority=-1)
    accelerator.set_accelerator(CPUAccelerator())


def _forward_step(args: Namespace, num_microbatches: int, gbs: int, it: Any, model: Any) -> tuple:
    """slime's ``train_one_step`` ``forward_step``, restated: ``get_batch``, the model call,
    and ``partial(loss_function, args, batch, num_microbatches, step_global_batch_size)``."""
    from slime.backends.megatron_utils.data import get_batch
    from slime.backends.megatron_utils.loss import loss_function

    batch = get_batch(it, list(sb.BATCH_KEYS), args.data_pad_size_multiplier, args.allgather_cp)
    output = model(
        input_ids=batch["tokens"],
        position_ids=None,
        attention_mask=None,
        labels=None,
        packed_seq_params=batch["packed_seq_params"],
        loss_mask=batch["full_loss_masks"],
    )
    return output, partial(loss_function, args, batch, num_microbatches, gbs)


def _switch(row: str, args: Namespace) -> None:
    """The documented switch of ``row`` (none for slime as released)."""
    from megatron_lossfix.integrations.slime import adapter

    if row == ADAPTED_ROW:
        adapter.enable(args)
    elif row == EXCLUDED_ROW:
        adapter.enable_mask_in_loss(args)


def _run_row(run: tuple[str, str, str], chunks: list, data: dict, plan: list, allgather: bool):
    """One slime training step (forward and backward, gradients reduced) of ``run``."""
    from megatron.core import parallel_state as ps
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.data import DataIterator

    row, mode, setting = run
    args = sb.slime_args(mode, allgather, setting)
    dp_rank = ps.get_data_parallel_rank()
    start = sum(sum(p) for p in plan[:dp_rank])
    device = next(chunks[0].parameters()).device
    rollout = sb.local_rollout(data, range(start, start + sum(plan[dp_rank])), device)
    bounds, at = [], 0
    for size in plan[dp_rank]:
        bounds.append(list(range(at, at + size)))
        at += size
    iterators = [DataIterator(rollout, bounds) for _ in chunks]
    step = partial(_forward_step, args, len(bounds), data["num_rollouts"])
    for chunk in chunks:
        chunk.zero_grad_buffer()
    # train_one_step looks its schedule up on slime's model module when the step starts: the
    # adapted rows go through the documented switch, undone after the row.
    megatrons = slime_model.get_forward_backward_func
    _switch(row, args)
    try:
        slime_model.get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks,
            num_microbatches=len(bounds),
            seq_length=data["max_tokens"],
            micro_batch_size=1,
            forward_only=False,
        )
    finally:
        slime_model.get_forward_backward_func = megatrons


def slime_layout_grads(
    layout: Any,
    case: OracleCase,
    modes: Sequence[str],
    num_microbatches: int,
    allgather: bool = False,
    rows: Sequence[str] = ROWS,
    settings: Sequence[str] = ("ppo",),
) -> dict[tuple[str, str, str], dict[str, torch.Tensor]] | None:
    """Every ``(row, mode, setting)`` step under ``layout`` (:func:`runs`); the full gradients
    on global rank 0."""
    from megatron.core import parallel_state as ps

    from megatron_lossfix.audit import tiny_gpt

    use_cpu_accelerator()
    tiny_gpt.init_layout(layout)
    models: dict[bool, tuple[list, Any]] = {}
    plan = microbatch_plan(case, ps.get_data_parallel_world_size(), num_microbatches)
    out = {}
    for run in runs(modes, settings, rows):
        per_token = run[1] == "per_token"
        if per_token not in models:  # Megatron's DDP fixes its gradient scaling when built
            models[per_token] = tiny_gpt.case_tiny_gpt(
                layout, case, calculate_per_token_loss=per_token
            )
        chunks, config = models[per_token]
        data = sb.slime_rollout(case, config.vocab_size, run[1])
        data["max_tokens"] = sum(data["total_lengths"])
        tiny_gpt.set_deterministic_params(chunks, case.seed)
        _run_row(run, chunks, data, plan, allgather)
        out[run] = tiny_gpt.gather_full_grads(chunks)
    return out if torch.distributed.get_rank() == 0 else None
