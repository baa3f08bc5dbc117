"""What the RL replay (:mod:`~megatron_lossfix.integrations.megatron_lm.rl_replay`) records of
each step, and reading it back.

With a plan's ``out`` (:mod:`~megatron_lossfix.integrations.megatron_lm.rl_plans`), the last
rank appends one JSON line per step: ``iteration``, ``loss_reduction``, ``lm_loss`` (what
``train_step`` reduced for the log), ``grad_norm``, ``num_microbatches``, ``num_sequences`` and
``num_tokens`` (the rows with a loss token and the loss tokens the step read, over the
data-parallel ranks) and ``grad``, the paths of a ``torch.save`` per pipeline stage of every
parameter and its gradient (``main_grad``) after the step, tensor parallelism's shards gathered
(run with ``--clip-grad 0``: clipping rescales it in place); under a plugin mode also
``weights`` (paths: the plugin's weights of each micro-batch, one file per data-parallel rank)
and ``lossfix_loss``, ``lossfix_num_tokens``, ``lossfix_num_sequences`` (the step's metrics).
:func:`read_records` reads them back.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["read_records", "recording_train_step"]


def read_records(out: str | os.PathLike) -> list[dict]:
    """The ``out`` lines of a run, each with ``grad`` and ``param``: the full gradient and the
    parameters, one float64 vector each (parameters in name order, named in ``grad_names``,
    the pipeline stages' joined; ``stage_files``: the stages' files) and, under a plugin mode,
    ``weights``: the plugin's weights of every micro-batch row (or packed bin), data-parallel
    ranks in order."""
    import torch

    records = []
    for line in Path(out).read_text().splitlines():
        record = json.loads(line)
        record["stage_files"] = record["grad"]
        views = [torch.load(path) for path in record["grad"]]  # one per pipeline stage
        for key in ("grad", "param"):
            tensors = {k: v for view in views for k, v in view[key].items()}
            record[key] = torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])
        record["grad_names"] = sorted(k for view in views for k in view["grad"])
        if record.get("weights"):
            rows = [w for path in record["weights"] for w in torch.load(path)]
            record["weights"] = torch.cat([w.reshape(-1, w.shape[-1]) for w in rows])
        records.append(record)
    return records


class _Counting:
    """The step's data iterator, counting the rows with a loss token and the loss tokens of the
    items the step reads (tensors: no host sync until the step is over)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.rows: list = []
        self.tokens: list = []

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        item = next(self.source)
        from megatron.rl.rl_utils import get_rl_runtime_state

        context = get_rl_runtime_state().packing_context
        if context is not None and len(item) == 1:  # a packed bin: (bin_index,)
            index = int(item[0])
            self.tokens.append(context.packed_loss_mask[index, 1:].sum())
            rows = context.packing_info.bin_seq_indices[index]
            self.rows.append(self.tokens[-1].new_tensor(float(len(rows))))
        else:
            mask = item[3][:, 1:].float()  # train_rl.forward_step: loss_mask[:, 1:]
            self.tokens.append(mask.sum())
            self.rows.append((mask.sum(1) > 0).sum().float())
        return item

    def counts(self, group: Any) -> tuple[int, int]:
        """(rows, tokens) the step read over ``group`` (the data-parallel ranks)."""
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")  # fmt: skip
        both = torch.zeros(2, dtype=torch.float64, device=device)
        if self.rows:
            read = [torch.stack(self.rows).sum(), torch.stack(self.tokens).sum()]
            both = torch.stack(read).to(device=device, dtype=torch.float64)
        dist.all_reduce(both, group=group)
        return int(both[0]), int(both[1])


def _counted(forward_backward_func: Any, counting: list) -> Any:
    """``forward_backward_func`` reading its data through a :class:`_Counting` (the same
    GRPO-group record as the iterator it wraps)."""
    from megatron_lossfix.integrations.megatron_lm import (
        rl_groups as megatron_lm_rl_groups,
    )

    def counted(*args: Any, **kwargs: Any) -> Any:
        source = kwargs.get("data_iterator")
        if source is not None and not isinstance(source, list):
            kwargs["data_iterator"] = megatron_lm_rl_groups.same_rows(_Counting(source), source)
            counting.append(kwargs["data_iterator"])
        return forward_backward_func(*args, **kwargs)

    return counted


def _one_rank_view(model: Sequence) -> dict:
    """This rank's parameters and gradients (``main_grad``) under the names and shapes of the
    one-rank model: ``{"grad": {name: tensor}, "param": {name: tensor}}``. Tensor-parallel shards
    are gathered over the tensor-parallel group, a pipeline stage's layers take their global
    numbers, and the last stage's copy of tied word embeddings is left out."""
    import torch
    import torch.distributed as dist
    from megatron.core import mpu

    tp_group = mpu.get_tensor_model_parallel_group()
    tp_size = mpu.get_tensor_model_parallel_world_size()

    def whole(tensor: torch.Tensor, param: Any) -> torch.Tensor:
        tensor = tensor.detach()
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(tensor) for _ in range(tp_size)]
            dist.all_gather(shards, tensor.contiguous(), group=tp_group)
            tensor = torch.cat(shards, dim=param.partition_dim)
        return tensor.cpu().clone()

    view: dict[str, dict] = {"grad": {}, "param": {}}
    for chunk in model:
        layers = {}  # "<...>.layers.<local>." -> "<...>.layers.<global>."
        for name, module in chunk.named_modules():
            local = re.fullmatch(r"(.*\.layers)\.(\d+)", name)
            if local and hasattr(module, "layer_number"):
                layers[f"{name}."] = f"{local[1]}.{module.layer_number - 1}."
        for name, param in chunk.named_parameters():
            if getattr(param, "shared", False):
                continue  # the last stage's copy of the word embeddings
            grad = getattr(param, "main_grad", None)
            prefix = next((k for k in layers if name.startswith(k)), None)
            name = name if prefix is None else layers[prefix] + name[len(prefix) :]
            view["grad"][name] = whole(param.grad if grad is None else grad, param)
            view["param"][name] = whole(param, param)
    return view


def recording_train_step(train_step: Any, plan: dict, settings: Any, megatron_lm_rl: Any) -> Any:
    """``train_step`` with the plan's mode of each iteration, recording what it measured: the
    rows and tokens the step read, the full gradient and parameters (each pipeline stage's,
    saved by its first rank of data and tensor parallelism), and under a plugin mode the step's
    counts and loss and the weights of every micro-batch (saved by each data-parallel rank of
    the loss stage)."""
    names = list(inspect.signature(train_step).parameters)
    out = None if plan.get("out") is None else Path(plan["out"])

    def recorded(*args: Any, **kwargs: Any) -> tuple:
        call = dict(zip(names[: len(args)], args, strict=True)) | kwargs
        iteration = int(call.get("iteration") or 0)
        wanted = settings(iteration)
        weights: list = []
        plugin = _with_mode(call, wanted, weights, megatron_lm_rl)
        counting: list[_Counting] = []
        if out is not None:
            call["forward_backward_func"] = _counted(call["forward_backward_func"], counting)
        result = train_step(**call)
        if out is not None:
            step = _Step(iteration, wanted, call["model"], plugin, counting, weights)
            _record(out, step, result)
        return result

    return recorded


def _with_mode(call: dict, wanted: dict, weights: list, megatron_lm_rl: Any) -> Any:
    """Give ``call`` the forward-backward function of the plan's mode, when the plan names one
    (``None``: stock Megatron-LM); returns the plugin's wrapper (None under stock or without
    the key), which appends each micro-batch's weights to ``weights``."""
    from megatron.training import get_args

    if "loss_reduction" not in wanted:
        return None
    inner = call["forward_backward_func"]
    inner = getattr(inner, "inner", inner)  # the run's own plugin wrapper: unwrap it
    plugin = None
    if wanted["loss_reduction"] is not None:
        mode_args = copy.copy(get_args())
        mode_args.loss_reduction = wanted["loss_reduction"]
        mode_args.loss_norm_constant = wanted.get("loss_norm_constant")
        mode_args.lossfix_metrics_out = None
        inner = plugin = megatron_lm_rl.wrap_forward_backward_func(inner, mode_args)
        rl_loss = plugin._rl_loss

        def kept_rl_loss(micro_batch_weights: Any, *rest: Any) -> tuple:
            weights.append(micro_batch_weights.detach().cpu().clone())
            return rl_loss(micro_batch_weights, *rest)

        plugin._rl_loss = kept_rl_loss
    call["forward_backward_func"] = inner
    return plugin


@dataclass(frozen=True)
class _Step:
    """One step as :func:`_record` reads it besides its result."""

    iteration: int
    wanted: dict  # the plan's settings of the iteration
    model: Any
    plugin: Any  # the plugin's wrapper; None under stock Megatron-LM
    counting: list  # the step's counting data iterator (one a step without VPP)
    weights: list  # the plugin's weights of each micro-batch


def _record(out: Path, step: _Step, result: tuple) -> None:
    """Save the step's views and weights and append its line to ``out``: every rank takes part
    in the count, the metrics and the view; the last one writes the line."""
    import torch
    import torch.distributed as dist
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    reader = step.counting[0] if step.counting else _Counting(iter(()))  # one a step (no VPP)
    rows, tokens = reader.counts(mpu.get_data_parallel_group())
    plugin = step.plugin
    metrics = plugin.schedule.step_metrics() if plugin is not None else {}  # collective
    view = _one_rank_view(step.model)  # collective over TP
    stem = out.with_name(f"{out.stem}.{step.iteration + 1}")
    stages = mpu.get_pipeline_model_parallel_world_size()
    stage_paths = [f"{stem}.pp{p}.pt" for p in range(stages)]
    dp_rank, tp_rank = mpu.get_data_parallel_rank(), mpu.get_tensor_model_parallel_rank()
    if dp_rank == 0 and tp_rank == 0:
        torch.save(view, stage_paths[mpu.get_pipeline_model_parallel_rank()])
    dp_paths = [f"{stem}.w.dp{d}.pt" for d in range(mpu.get_data_parallel_world_size())]
    if step.weights and tp_rank == 0:
        torch.save(step.weights, dp_paths[dp_rank])
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    loss_dict, grad_norm = result[0], result[5]
    lm_loss = loss_dict.get("lm loss") if isinstance(loss_dict, dict) else None
    record = {
        "iteration": step.iteration + 1,
        "loss_reduction": step.wanted.get(
            "loss_reduction", getattr(get_args(), "loss_reduction", None)
        ),
        "lm_loss": None if lm_loss is None else float(lm_loss),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "num_microbatches": get_num_microbatches(),
        "num_sequences": rows,
        "num_tokens": tokens,
        "grad": stage_paths,
        "weights": dp_paths if plugin is not None else None,
        **{f"lossfix_{k}": metrics[k] for k in ("loss", "num_tokens", "num_sequences")
           if k in metrics},
    }  # fmt: skip
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")
