"""The self-check's runs of the step (docs/design.md §9, steps 2 and 3): the re-split run, or
the two runs over halves of the loss tokens, each summarized by its sketch
(:func:`resplit_runs`), then the normal run, last (:func:`normal_run`), training going on from
it. Every run goes through the same plumbing, from zeroed gradients and the RNG states the step
started with. A model error raised in a re-run names the step's own micro-batch, and ends every
rank with the same line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.modules.dropout import _DropoutNd

from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.process_groups import ModelParallelGroups
from megatron_lossfix.step.agreement import StepRefused
from megatron_lossfix.step.counting_pass import rng_restored
from megatron_lossfix.step.driver import Step
from megatron_lossfix.step.selfcheck.gradient_sketch import Sketch
from megatron_lossfix.step.selfcheck.microbatch_resplit import loss_token_half
from megatron_lossfix.step.selfcheck.model import CheckedModel
from megatron_lossfix.step.selfcheck.plan import Choice, how_resplit, plugin_step
from megatron_lossfix.step.selfcheck.reads import replays
from megatron_lossfix.step.weigh import loss_factor

__all__ = ["Resplit", "normal_run", "resplit_runs"]


class Resplit(NamedTuple):
    """What the re-split runs leave: ``sketches`` (the re-split run's, or the two halves'),
    ``reference`` (None: the normal run's sketch, after them; with dropout, whose masks cannot
    match across splits, the normal split's, all these runs in eval mode), and ``tokens``, on
    the device, for Megatron's per-token path: row 0, the token counts the loss functions
    return (Megatron divides the run's gradient by their sum), row 1, the factor the step gave
    each loss (``weigh.loss_factor``; 1 where none), of the halves (columns 0, 1) and of the
    normal run (2, by :func:`normal_run`)."""

    sketches: list[Sketch]
    reference: Sketch | None
    tokens: torch.Tensor


def resplit_runs(
    run: Callable[..., Any],
    step: Step,
    call: dict,
    reads: list,
    choice: Choice,
    model: CheckedModel,
    shards: ModelParallelGroups,
    normal: dict,
) -> Resplit:
    """The re-split run(s) of ``choice``. A loss function the step refuses in them is refused
    again by running the normal split (``normal``), so that the refusal names its
    micro-batches; any other error raises one line, the same on every rank
    (:func:`_rerun_failed`)."""
    tokens = torch.zeros(2, 3, dtype=torch.float64, device=model.device)  # per-token divisors
    try:
        sketches, reference = _reruns(run, plugin_step(step), call, reads, choice.items,
                                      choice.plan, model, shards, tokens)  # fmt: skip
    except StepRefused:  # on every rank: the normal split's refusal names its micro-batches
        model.zero_grads()
        run(**normal)
        raise
    except Exception as exc:
        raise _rerun_failed(exc, choice.plan) from exc
    return Resplit(sketches, reference, tokens)


def normal_run(
    run: Callable[..., Any], step: Any, normal: dict, model: CheckedModel, tokens: torch.Tensor
) -> Any:
    """The normal run, from zeroed gradients (training goes on from it, as without the check);
    its result. On Megatron's per-token path its loss functions' token counts and the step's
    factor go to ``tokens[:, 2]``."""
    model.zero_grads()
    counted = _counting_tokens(normal["forward_step_func"], tokens, 2) if model.per_token else None
    result = run(**({**normal, "forward_step_func": counted} if counted else normal))
    if counted:
        _record_factor(plugin_step(step), tokens, 2)
    return result


def _record_factor(step: Step | None, tokens: torch.Tensor, slot: int) -> None:
    """The factor the step's last run gave each loss, into ``tokens[1, slot]`` (1: none)."""
    record = None if step is None else step.last_step
    factor = None if record is None or record.counts is None else loss_factor(record)
    tokens[1, slot] = 1.0 if factor is None else torch.as_tensor(factor).to(tokens)


def _reruns(
    run: Callable[..., Any],
    step: Step,
    call: dict,
    reads: list,
    items: list,
    plan: tuple,
    model: CheckedModel,
    shards: ModelParallelGroups,
    tokens: torch.Tensor,
) -> tuple[list[Sketch], Sketch | None]:
    """The re-split run's sketch (``halves``: the two runs' sketches, the first over every
    micro-batch with half of the loss tokens of those in the plan's window, the second over
    the window's micro-batches only with their other half; ``tokens[0:2]`` gets the token
    counts their losses return), and the reference's: None (the normal run, after these) or,
    with dropout, whose masks cannot match across splits, the normal split's, all runs then in
    eval mode. The RNG states are put back after each run. A model error names the step's own
    micro-batch."""

    window = plan[4] if plan[0] == "halves" else None
    whole: list = []  # the window's weights as the whole step weighs them (the first run's)

    def halved(which: int) -> Callable[[list, list], tuple[list, list]]:
        """``Step.halves`` of run ``which``: the first over every micro-batch, halving the
        window's (whose whole-step weights it keeps); the second over the window's only, with
        those weights (the step, reading the window alone, weighs it by the window's counts)."""
        cfg = step.config
        half = loss_token_half(
            which,
            mask_key=cfg.loss_mask_key,
            cu_seqlens_key=cfg.cu_seqlens_key,
            id_keys=(cfg.group_ids_key, cfg.trajectory_ids_key, cfg.pair_ids_key),
            unit_key=cfg.pair_ids_key if mode_of(cfg.reduction).ids.whole_units else None,
            only=window if which == 0 else None,
        )

        def first(batches: list, weights: list) -> tuple[list, list]:
            whole[:] = [weights[k] for k in window]
            return half(batches, weights)

        return first if which == 0 else lambda batches, _: half(batches, whole)

    def rerun(data: list, plan: tuple | None, which: int | None = None) -> Sketch:
        model.zero_grads()
        if which == 1:  # the second half: the window's micro-batches only
            data = [None if got is None else got[window.start : window.stop] for got in data]
            kwargs = replays(call, data, ("halves", 2, len(window), None), source=False)
        else:
            kwargs = replays(call, data, plan if which is None else None, source=False)
        offset = window.start if which == 1 else 0  # the step's index of the run's first
        kwargs["forward_step_func"] = _named_errors(kwargs["forward_step_func"], plan, offset)
        if which is not None:
            kwargs["forward_step_func"] = _counting_tokens(kwargs["forward_step_func"], tokens,
                                                           which)  # fmt: skip
            step.halves = halved(which)
        try:
            with rng_restored():
                run(**kwargs)
        finally:
            if which is not None:
                step.halves = None
        if which is not None and model.per_token:
            _record_factor(step, tokens, which)
        sketch = model.sketch(shards)
        _return_freed_host_memory()
        return sketch

    chunks = model.chunks
    training = [c.training for c in chunks]
    rates = [getattr(model.config, f"{k}_dropout", 0) for k in ("hidden", "attention")]
    rates += [d.p for c in chunks for d in c.modules() if isinstance(d, _DropoutNd)]
    dropout = any(training) and any((rate or 0) > 0 for rate in rates)
    try:
        with rng_restored():
            for chunk in chunks if dropout else ():
                chunk.eval()
            if plan[0] == "halves":
                runs = [rerun(reads, plan, 0), rerun(reads, plan, 1)]
            else:
                runs = [rerun(items, plan)]
            return runs, rerun(reads, None) if dropout else None
    finally:
        for chunk, mode in zip(chunks, training, strict=True) if dropout else ():
            chunk.train(mode)


def _return_freed_host_memory() -> None:
    """Hand the host memory the last run freed back to the system (glibc's ``malloc_trim``),
    so that the next run's buffers do not stack on a fragmented heap: the check's runs then
    leave a process's peak as one run does. Nothing where that call does not exist."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _counting_tokens(forward_step_func: Callable, tokens: torch.Tensor, slot: int) -> Callable:
    """``forward_step_func`` whose loss functions add the token counts they return to
    ``tokens[0, slot]`` (on the device: Megatron's per-token path divides the gradient by their
    sum, which the runs over halves of the loss tokens change)."""

    def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> tuple:
        output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)

        @functools.wraps(loss_func)
        def loss(*a: Any, **kw: Any) -> Any:
            outputs = loss_func(*a, **kw)
            if isinstance(outputs, (tuple, list)) and len(outputs) == 3:
                if isinstance(outputs[1], torch.Tensor):
                    tokens[0, slot] += outputs[1].detach().to(tokens.device, tokens.dtype).sum()
            return outputs

        return output, loss

    return forward_step


class _ModelError(RuntimeError):
    """The user's ``forward_step`` raised in a re-run of the check (``microbatch``: the step's
    own micro-batch it was reading, or None)."""

    def __init__(self, error: BaseException, microbatch: int | None) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.microbatch = error, microbatch


def _named_errors(forward_step_func: Callable, plan: tuple, first: int = 0) -> Callable:
    """``forward_step_func`` whose errors name the step's own micro-batch: the forward steps of
    each model chunk are counted, and the re-run's micro-batch mapped back by ``plan`` (a run
    over halves that starts at the step's micro-batch ``first``)."""
    calls: dict[int, int] = {}

    def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> tuple:
        j = calls.get(id(model), 0)
        calls[id(model)] = j + 1
        try:
            return forward_step_func(data_iterator, model, *args, **kwargs)
        except _ModelError:
            raise
        except Exception as exc:
            kind = plan[0]
            k = j // 2 if kind == "split" else first + j if kind == "halves" else None
            raise _ModelError(exc, k) from exc

    return forward_step


_RERUNS = [0]  # the check's re-runs started in this process: a store key per check


def _rerun_failed(error: BaseException, plan: tuple) -> BaseException:
    """The one-line error of a re-run that raised: this rank's model error, naming the step's
    micro-batch, is written to the process group's store, so that ranks waiting for this one
    in a collective, which fail when it leaves (or at the collective's timeout), end with the
    same line instead of their own collective's error."""
    _RERUNS[0] += 1
    key = f"megatron_lossfix/self_check/error/{_RERUNS[0]}"
    store = _default_store()
    if isinstance(error, _ModelError):
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = "" if error.microbatch is None else f" reading micro-batch {error.microbatch}"
        message = (
            f"megatron_lossfix self-check: forward_step raised {error} on rank {rank}{where} "
            f"of the first step (micro-batches as the step splits them; the check's re-run "
            f"{how_resplit(0, plan)}): fix "
            "the model or its data, or drop the check with --no-lossfix-self-check"
        ).replace("\n", " ")
        if store is not None:
            store.set(key, message)
        return RuntimeError(message)
    if store is not None and dist.is_initialized():
        try:
            if store.check([key]):
                return RuntimeError(store.get(key).decode() + " (seen from rank "
                                    f"{dist.get_rank()}, which waited for it)")  # fmt: skip
        except Exception:  # noqa: BLE001 - the store may be gone with its peers: the own error
            pass
    return error


def _default_store() -> Any:
    """The default process group's store, or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no store: each rank reports its own error
        return None
