"""The self-check: the first step's gradient must not move when re-split (docs/design.md §9).

The check runs on top of the step: it calls it (:class:`~megatron_lossfix.step.driver.Step`, or what
runs it, such as Megatron-LM's plumbing around it) re-split and normally, last, after learning
what it reads (read ahead where the step reads all its micro-batches first, else in a
forward-only pass), so that training goes on from the normal run with nothing to put back.
It keeps no copy of a gradient: each run's is summarized by per-parameter sums and a few
seeded random projections (:class:`Sketch`). The step knows nothing of it;
``LossFixSchedule`` composes the two (:func:`first_step_check`): by default in every mode that
can be checked, skipped silently where the step cannot be re-split; when the config asks for it
explicitly (``self_check=True``), a step that cannot be checked is warned about or refused.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.dropout import _DropoutNd

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.process_groups import (
    ModelParallelGroups,
    StepGroups,
    group_size,
    max_over,
)
from megatron_lossfix.step.agreement import StepRefused
from megatron_lossfix.step.counting_pass import recorded, replaying, rng_restored
from megatron_lossfix.step.driver import Step
from megatron_lossfix.step.gradient_sketch import (
    HOW_MEASURED,
    Sketch,
    block_elements,
    combined,
    gradient,
    relative_error,
    sketch_gradients,
)
from megatron_lossfix.step.megatron_compat import (
    gradient_side_paths,
    model_config_of,
    model_parallel_groups,
    resolve_groups,
)
from megatron_lossfix.step.microbatch_resplit import loss_token_half, resplit, resplit_plan

__all__ = ["SelfCheck", "SelfCheckError", "first_step_check", "left_out", "switched_on"]


class SelfCheckError(RuntimeError):
    """The gradient moved under a re-split of the step, or differs across DP x CP replicas."""


def first_step_check(config: LossFixConfig) -> SelfCheck | None:
    """The check of ``config``'s first training step, or None: ``self_check=False``, or the
    default (None) in a mode whose gradient depends on the split."""
    wanted = config.self_check
    if wanted is None:
        wanted = not mode_of(config.reduction).split_dependent
    return SelfCheck(config) if wanted else None


_LEFT_OUT: set[str] = set()  # where this process already said the check stays out


def left_out(where: str, why: str) -> None:
    """Say once per process (rank 0), in one line, that the default first-step check does not
    run in ``where``, and ``why`` (docs/design.md §9): never a silent skip."""
    if where in _LEFT_OUT:
        return
    _LEFT_OUT.add(where)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"megatron_lossfix self-check: not run in {where}: {why}", flush=True)


def switched_on(env: str, where: str, why: str) -> bool:
    """Whether the environment variable ``env`` is ``1``: the switch of an adapter that writes
    the loss itself (``where``) to run the first-step check; off, the run says so once
    (:func:`left_out`), with ``why`` the check stays out and that ``env=1`` runs it."""
    on = os.environ.get(env) == "1"
    if not on:
        left_out(where, f"{why}; {env}=1 runs it")
    return on


class SelfCheck:
    """The first training step's re-split check of a schedule whose config has ``self_check``."""

    def __init__(self, config: LossFixConfig) -> None:
        self.config = config
        self.tolerance = config.self_check_tolerance
        self.explicit = config.self_check is True  # asked for: say why a step is not checked
        self.checked = False  # the first training step was seen (checked or skipped)
        self.last_error: float | None = None  # relative L2 change of the gradient (None: none)
        self.last_plan: tuple | None = None  # (kind, factor, num_microbatches, micro_batch_size)
        self.last_replica_spread: float | None = None  # relative spread over the DP x CP ranks

    def due(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call is the training step to check (the first one)."""
        return not self.checked and not kwargs.get("forward_only")

    def run(self, step: Step, call: dict, via: Callable[..., Any] | None = None) -> Any:
        """Check the step ``call``: read its data (ahead, the step agreeing on it first, or in
        a forward-only pass), run it re-split, then run it normally (training goes on from that
        last run); its result.

        ``step``: the step whose record names the groups; ``via``: what runs it (by default
        ``step`` itself), so that every run goes through the same plumbing.
        """
        self.checked = True
        run = step if via is None else via
        model, m = call["model"], call["num_microbatches"]
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        model_config = model_config_of(chunks[0])[0]  # None: not a Megatron model
        reason = _why_not_checkable(self.config.reduction, model_config, chunks)
        if reason:
            self._skipped(reason)
            return run(**call)
        params = list(dict.fromkeys(p for c in chunks for p in c.parameters() if p.requires_grad))
        device = params[0].device if params else torch.device("cpu")
        unset, held = _entry_state(params, device)
        # 1. What forward_step reads from each data iterator: read ahead, then the step's own
        # reading and agreement on the normal split without its schedule, where the step reads
        # all its micro-batches first; else a forward-only pass (no gradient).
        reads, record = _read_ahead(step, call, via, len(chunks))
        if reads is None:
            reads = _reading_pass(run, call)
            record = step.last_step
        if record is None:
            raise RuntimeError("the self-check's step left no record: it did not run the step")
        groups = record.groups
        shards = model_parallel_groups(record.pg_collection)
        # 2. The same data re-split; every rank learns whether any rank cannot, or holds
        # gradients from before the step, in one all-reduce over every rank of the model.
        plan = _plan(call, chunks, model_config, reads, groups, shards, device)
        items, problem = _resplit_reads(reads, plan, m, self.config.loss_mask_key)
        flags = [float(problem is not None), float(plan is not None and problem is None), held]
        failed, changed, held_any = max_over(flags, device, shards.mp, groups.dp_cp).tolist()
        normal = _replays(call, reads)
        if held_any:
            self._skipped("the gradients were not zero before the step (accumulated over calls)")
            return run(**normal)
        if failed or not changed:  # rows cannot move without growing: halves of the tokens
            target = _plugin_step(step)
            why_not = _why_no_halves(self.config, model_config, target)  # the same everywhere
            if why_not:
                problem = problem or "no rank can move a row without growing a micro-batch"
                if self.explicit:  # every rank: the flags are all-reduced
                    drop = "this data cannot be checked: drop --lossfix-self-check"
                    raise ValueError(f"megatron_lossfix self-check: {problem}; {why_not}; {drop}")
                self._skipped(f"{problem}, and {why_not}; only the replicas were compared")
                result = run(**normal)
                self._replicas(chunks, params, groups, shards, device)
                return result
            plan, items = ("halves", 2, m, None), reads
        self.last_plan = plan
        # 3. The re-split run(s) (and, with dropout, the normal split, all in eval mode), each
        # summarized by its sketch; RNG states put back after them.
        per_token = bool(getattr(model_config, "calculate_per_token_loss", False))
        tokens = torch.zeros(3, dtype=torch.float64, device=device)  # per-token divisors
        try:
            runs, reference = _reruns(run, _plugin_step(step), call, reads, items, plan, chunks,
                                      params, unset, model_config, shards, tokens)  # fmt: skip
        except StepRefused:  # on every rank: the normal split's refusal names its micro-batches
            _zero_grads(chunks, params, unset)
            run(**normal)
            raise
        except Exception as exc:
            raise _rerun_failed(exc, plan) from exc
        # 4. The normal run, last: training goes on from it, as without the check; 5. every
        # DP x CP replica must hold the same reduced gradient.
        _zero_grads(chunks, params, unset)
        counted = _counting_tokens(call["forward_step_func"], tokens, 2) if per_token else None
        result = run(**({**normal, "forward_step_func": counted} if counted else normal))
        sketch = self._replicas(chunks, params, groups, shards, device)
        reference = sketch if reference is None else reference
        # 6. The re-split run's sketch (the halves' sum) against the normal run's.
        resplit_sketch = runs[0]
        if len(runs) == 2:
            factors = _divisor_factors(tokens, per_token, groups, shards, device)
            resplit_sketch = combined(list(zip(runs, factors, strict=True)), reference)
        error = relative_error(reference, resplit_sketch, shards, device)
        self.last_error = error
        self._report(error, m, plan)
        return result

    def _replicas(
        self,
        chunks: list,
        params: list,
        groups: StepGroups,
        shards: ModelParallelGroups,
        device: torch.device,
    ) -> Sketch:
        """The sketch of the gradient now held (the distributed optimizer's shards gathered
        first); raises ``SelfCheckError`` when the DP x CP replicas do not hold the same."""
        _unshard(chunks)
        sketch = sketch_gradients(params, shards)
        spread, worst = _replica_spread(params, sketch, groups)
        spread_max = float(max_over([spread], device, shards.mp, groups.dp_cp)[0])
        self.last_replica_spread = spread_max
        if not spread_max <= self.tolerance:
            mine = spread == spread_max
            raise self._replicas_differ(spread_max, mine, worst, chunks, params, groups)
        return sketch

    def _skipped(self, why: str) -> None:
        """A step that cannot be checked: a warning when the check was asked for, else one
        line (rank 0): never a silent skip."""
        if self.explicit:
            warnings.warn(f"megatron_lossfix self-check skipped: {why}", stacklevel=4)
        elif not dist.is_initialized() or dist.get_rank() == 0:
            print(f"megatron_lossfix self-check: not run on the first step: {why}", flush=True)

    def _replicas_differ(
        self, spread: float, mine: bool, worst: int, chunks: list, params: list, groups: StepGroups
    ) -> SelfCheckError:
        """The failure of step 2; ``mine``: the largest spread was measured here, at parameter
        ``worst``, which the message names."""
        where = "between the replicas of another model-parallel rank"
        if worst >= 0 and mine:
            names = {id(p): n for c in chunks for n, p in c.named_parameters()}
            where = f"most in {names.get(id(params[worst]), 'a parameter')!r}"
        return SelfCheckError(
            f"megatron_lossfix self-check failed: after the first step the gradient differs "
            f"across the {group_size(groups.dp_cp)} data x context-parallel ranks by "
            f"{spread:.3g} (relative; tolerance {self.tolerance:g}), {where}; those "
            "ranks must hold the same reduced gradient. The gradients were not reduced "
            "across data-parallel ranks, or were rescaled on some ranks: set "
            "config.finalize_model_grads_func = finalize_model_grads "
            "(megatron.core.distributed), keep the model in DistributedDataParallel, and do "
            "not reduce or rescale gradients elsewhere."
        )

    def _report(self, error: float, m: int, plan: tuple | None) -> None:
        """Raise ``SelfCheckError`` when the re-split moved the gradient, else one line."""
        how, reduction = _how(m, plan), self.config.reduction
        if not error <= self.tolerance:
            raise SelfCheckError(
                f"megatron_lossfix self-check failed: re-running the first step's data {how} "
                f"changed the gradient by {error:.3g} (relative L2, {HOW_MEASURED}; tolerance "
                f"{self.tolerance:g})"
                f" under reduction {reduction!r}. The loss depends on how the step is split, "
                "so it is not the mode's global "
                "normalization. Probably: (1) double scaling: loss_func divides the weighted sum "
                "by its own token count or by the number of micro-batches (a per-micro-batch "
                "mean, or calculate_per_token_loss plus a manual division), but the plugin's "
                "weights already normalize: return (sum(weights * loss), num_tokens, report) as "
                "megatron_lossfix.weighted_loss does; (2) the loss ignores the plugin's weights "
                "(batch['loss_weights']) and uses the raw loss mask; (3) the model mixes samples "
                "(batch statistics, token dropping). With bf16/fp16 compute rounding alone moves "
                "the gradient by about 1e-3: raise --lossfix-self-check-tolerance. The "
                "gradient in place is the normal run's."
            )
        # Every rank measured the same error (it is all-reduced): one line for the whole run.
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"megatron_lossfix self-check passed: re-running the first step's data {how} "
                f"changed the gradient by {error:.2g} (relative L2, {HOW_MEASURED}; tolerance "
                f"{self.tolerance:g})",
                flush=True,
            )


def _entry_state(params: list, device: torch.device) -> tuple[list[bool], float]:
    """Which parameters hold no gradient yet (None), and 1.0 if any holds a nonzero one (the
    runs start from zero, as a step after ``zero_grad_buffer`` does), else 0.0."""
    unset = [gradient(p) is None for p in params]
    held = torch.zeros((), dtype=torch.bool, device=device)
    size = block_elements(device)
    for param in params:
        grad = gradient(param)
        for block in () if grad is None else grad.detach().reshape(-1).split(size):
            held |= block.any()
    return unset, float(held)


def _zero_grads(chunks: list, params: list, unset: list[bool]) -> None:
    """The gradients as before the step: zero (DDP's ``zero_grad_buffer`` also resets its
    per-step bucket state), None where there was none."""
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=False)
    for param, none in zip(params, unset, strict=True):
        if none and getattr(param, "main_grad", None) is None:
            param.grad = None


def _read_ahead(step: Step, call: dict, via: Any, num_chunks: int) -> tuple:
    """``([micro-batches], record)`` where ``step`` itself reads all its micro-batches before
    its schedule (a ``Step`` called directly, one model chunk and data iterator, no pipeline
    parallelism: every rank is the loss stage), else ``(None, None)``. The micro-batches (dicts
    copied) are read here; the step then reads them again and agrees on them with its peers,
    without running its schedule, so that a refusal or a disagreement surfaces exactly as
    without the check (a read that raised raises there again)."""
    given = call["data_iterator"]
    sources = given if isinstance(given, list) else [given]
    if via is not None or type(step) is not Step or num_chunks != 1 or len(sources) != 1:
        return None, None
    pg_collection = call.get("pg_collection")
    pg_collection = step.pg_collection if pg_collection is None else pg_collection
    if sources[0] is None or resolve_groups(pg_collection).pp_size > 1:
        return None, None
    items: list = []
    error: BaseException | None = None
    for _ in range(call["num_microbatches"]):
        try:
            item = next(sources[0])
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - the step meets it again and refuses
            error = exc
            break
        items.append(dict(item) if isinstance(item, Mapping) else item)
    dry = copy.copy(step)
    dry.inner = _no_schedule
    it = _replaying_then(items, error)
    dry(**{**call, "data_iterator": [it] if isinstance(given, list) else it, "forward_only": True})
    return [items], dry.last_step


def _no_schedule(**call: Any) -> list:
    """A schedule that takes the step's micro-batches (with their input checks, such as
    ``check_finite``'s) and runs nothing: the self-check's step reads and agrees only."""
    given = call["data_iterator"]
    batches = given[-1] if isinstance(given, list) else given
    for _ in zip(range(call["num_microbatches"]), batches, strict=False):
        pass
    return []


def _replaying_then(items: list, error: BaseException | None) -> Iterator:
    """``items`` (dicts copied), then ``error`` raised, if any."""
    for item in items:
        yield dict(item) if isinstance(item, Mapping) else item
    if error is not None:
        raise error


def _reading_pass(run: Callable[..., Any], call: dict) -> list[list | None]:
    """What ``forward_step`` reads from each data iterator (None: no iterator), in a forward-only
    pass of the step without autograd; the RNG states put back."""
    given = call["data_iterator"]
    as_list = isinstance(given, list)
    sources = given if as_list else [given]
    reads = [None if it is None else [] for it in sources]
    its = [it if it is None else recorded(it, r) for it, r in zip(sources, reads, strict=True)]
    with rng_restored(), torch.no_grad():
        run(**{**call, "data_iterator": its if as_list else its[0], "forward_only": True})
    return reads


def _replays(call: dict, reads: list, plan: tuple | None = None, source: bool = True) -> dict:
    """``call`` over ``reads`` (each iterator's micro-batches, dicts copied: forward_step may
    pop), re-split by ``plan``; ``source``: then what the call's iterators still yield."""
    given = call["data_iterator"]
    as_list = isinstance(given, list)
    sources = given if as_list else [given]
    rest = sources if source else [iter(()) for _ in sources]
    its = [None if r is None else replaying(r, s) for r, s in zip(reads, rest, strict=True)]
    kwargs = {**call, "data_iterator": its if as_list else its[0]}
    if plan is not None:
        kwargs["num_microbatches"] = plan[2]
        if plan[3] is not None and "micro_batch_size" in call:
            kwargs["micro_batch_size"] = plan[3]
    return kwargs


def _reruns(
    run: Callable[..., Any],
    step: Step,
    call: dict,
    reads: list,
    items: list,
    plan: tuple,
    chunks: list,
    params: list,
    unset: list[bool],
    model_config: Any,
    shards: ModelParallelGroups,
    tokens: torch.Tensor,
) -> tuple[list[Sketch], Sketch | None]:
    """The re-split run's sketch (``halves``: the two runs' sketches, each run weighing one half
    of every micro-batch's loss tokens; ``tokens[0:2]`` gets the token counts their losses
    return), and the reference's: None (the normal run, after these) or, with dropout, whose
    masks cannot match across splits, the normal split's, all runs then in eval mode. The RNG
    states are put back after each run. A model error names the step's own micro-batch."""

    def rerun(data: list, plan: tuple | None, which: int | None = None) -> Sketch:
        _zero_grads(chunks, params, unset)
        kwargs = _replays(call, data, plan if which is None else None, source=False)
        kwargs["forward_step_func"] = _named_errors(kwargs["forward_step_func"], plan)
        if which is not None:
            kwargs["forward_step_func"] = _counting_tokens(kwargs["forward_step_func"], tokens,
                                                           which)  # fmt: skip
            cfg = step.config
            ids = (cfg.group_ids_key, cfg.trajectory_ids_key)
            step.halves = loss_token_half(
                which, mask_key=cfg.loss_mask_key, cu_seqlens_key=cfg.cu_seqlens_key, id_keys=ids
            )
        try:
            with rng_restored():
                run(**kwargs)
        finally:
            step.halves = None
        _unshard(chunks)
        sketch = sketch_gradients(params, shards)
        _return_freed_host_memory()
        return sketch

    training = [c.training for c in chunks]
    rates = [getattr(model_config, f"{k}_dropout", 0) for k in ("hidden", "attention")]
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
    ``tokens[slot]`` (on the device: Megatron's per-token path divides the gradient by their
    sum, which the runs over halves of the loss tokens change)."""

    def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> tuple:
        output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)

        @functools.wraps(loss_func)
        def loss(*a: Any, **kw: Any) -> Any:
            outputs = loss_func(*a, **kw)
            if isinstance(outputs, (tuple, list)) and len(outputs) == 3:
                if isinstance(outputs[1], torch.Tensor):
                    tokens[slot] += outputs[1].detach().to(tokens.device, tokens.dtype).sum()
            return outputs

        return output, loss

    return forward_step


def _divisor_factors(
    tokens: torch.Tensor,
    per_token: bool,
    groups: StepGroups,
    shards: ModelParallelGroups,
    device: torch.device,
) -> list[float]:
    """What each run over half of the loss tokens is multiplied by to be the half of the normal
    run's gradient: 1, except on Megatron's per-token path, which divided each run's gradient by
    its own token count (summed over DP x CP) instead of the normal run's."""
    if not per_token:
        return [1.0, 1.0]
    total = tokens.clone()
    if group_size(groups.dp_cp) > 1:
        dist.all_reduce(total, group=groups.dp_cp)
    total = max_over(total, device, shards.mp)  # the loss stage's counts on every stage
    halves, normal = total[:2].tolist(), float(total[2])
    return [half / normal if normal > 0 else 1.0 for half in halves]


class _ModelError(RuntimeError):
    """The user's ``forward_step`` raised in a re-run of the check (``microbatch``: the step's
    own micro-batch it was reading, or None)."""

    def __init__(self, error: BaseException, microbatch: int | None) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error, self.microbatch = error, microbatch


def _named_errors(forward_step_func: Callable, plan: tuple) -> Callable:
    """``forward_step_func`` whose errors name the step's own micro-batch: the forward steps of
    each model chunk are counted, and the re-run's micro-batch mapped back by ``plan``."""
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
            k = j // 2 if kind == "split" else j if kind == "halves" else None
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
            f"{_how(0, plan)}): fix "
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


def _plugin_step(step: Any) -> Step | None:
    """The plugin's :class:`Step` that ``step`` is or wraps (through ``inner``), or None."""
    for _ in range(8):
        if isinstance(step, Step) or step is None:
            return step
        step = getattr(step, "inner", None)
    return None


def _why_no_halves(config: LossFixConfig, model_config: Any, step: Step | None) -> str | None:
    """Why the runs over halves of the loss tokens cannot check this step (the same on every
    rank), or None: only the loss function's weights are halved, so a gradient term outside
    it, or a loss that decides its own masks (whose kept counts the step normalizes by),
    would count twice."""
    if step is None:
        return "the step is not the plugin's Step, whose weights the halves set"
    if config.mask_in_loss:
        return "the loss decides its masks (mask_in_loss), whose counts halves would change"
    paths = gradient_side_paths(model_config)
    if paths:
        return f"the model adds {', '.join(paths)} outside the loss, which halves would count twice"
    return None


def _plan(
    call: dict,
    chunks: list,
    model_config: Any,
    reads: list,
    groups: StepGroups,
    shards: ModelParallelGroups,
    device: torch.device,
) -> tuple | None:
    """The re-split every stage of the pipeline agrees on (:func:`resplit_plan`)."""
    # TP ranks that read data beside ranks that do not: forward_step broadcasts the batch
    # into buffers of the configured shape (get_batch_on_this_tp_rank): shuffle rows only.
    tp_reads = max_over([float(any(reads)), float(not any(reads))], device, shards.tp)
    mixed = max_over([float(tp_reads.min() > 0)], device, shards.mp, groups.dp_cp)
    pp = group_size(groups.pp)
    group = getattr(model_config, "microbatch_group_size_per_vp_stage", None) or pp
    group = group if len(chunks) > 1 else None  # interleaved: the count must fit the group
    m = call["num_microbatches"]
    return resplit_plan(m, call.get("micro_batch_size"), pp, group, bool(mixed[0] > 0))


def _resplit_reads(
    reads: list, plan: tuple | None, m: int, mask_key: str
) -> tuple[list, str | None]:
    """Each iterator's reads re-split by ``plan``, or why this rank cannot."""
    items = []
    for c, got in enumerate(reads):
        try:
            if got and plan and len(got) != m:
                raise ValueError(f"forward_step read {len(got)} micro-batches, not {m}")
            items.append(resplit(got, plan, mask_key=mask_key) if got and plan else got)
        except (ValueError, RuntimeError) as exc:  # RuntimeError: torch.cat of odd shapes
            return items, f"cannot re-split data iterator {c}: {exc}"
    return items, None


def _how(m: int, plan: tuple | None) -> str:
    """How the re-run split the step, for the pass and failure messages."""
    if plan is None:
        return f"in the same {m} micro-batches here (other ranks re-split)"
    if plan[0] == "shuffle":
        return f"in {plan[2]} micro-batches with their rows dealt differently"
    if plan[0] == "halves":
        return (
            f"as two runs of its {plan[2]} micro-batches, each weighing every other loss token "
            "of each (no row can move without growing a micro-batch)"
        )
    return f"as {plan[2]} micro-batches instead of {m} (each micro-batch cut in {plan[1]})"


def _why_not_checkable(reduction: str | None, config: Any, chunks: list = ()) -> str | None:
    """Why the step cannot be checked (the same on every rank), or None: its gradient depends
    on the split by design, or the model holds no parameters to compare."""
    if reduction is not None and mode_of(reduction).split_dependent:
        return (
            f"reduction {reduction!r} depends on the micro-batch split by definition "
            "(Megatron's mean of per-micro-batch means)"
        )
    if not all(isinstance(chunk, torch.nn.Module) for chunk in chunks):
        return "the model is not a torch.nn.Module: no gradient to compare"
    moe = getattr(config, "num_moe_experts", None)
    aux, z = ((getattr(config, f"moe_{k}_loss_coeff", 0) or 0) > 0 for k in ("aux", "z"))
    capacity = getattr(config, "moe_expert_capacity_factor", None) is not None
    names = ("MoE load-balancing loss", "MoE z-loss", "MoE expert capacity (token dropping)")
    features = [name for name, on in zip(names, (aux, z, capacity), strict=True) if moe and on]
    if features:
        return (
            f"the model uses {', '.join(features)}, whose gradient depends on the batch "
            "composition by design (they are nonlinear in it; Megatron keeps them per "
            "micro-batch)"
        )
    return None


def _unshard(chunks: list) -> None:
    """Gather the distributed optimizer's shards into full ``main_grad``s (its own unchanged)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
            continue
        kinds = ("bucket_groups", "expert_parallel_bucket_groups")
        for bucket_group in (g for kind in kinds for g in getattr(chunk, kind, [])):
            group = bucket_group.intra_distributed_optimizer_instance_group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            for bucket in bucket_group.buckets:
                views = shard_buffer(bucket.grad_data, size)
                dist.all_gather(views, views[rank].clone(), group=group)


def _replica_spread(params: list, sketch: Sketch, groups: StepGroups) -> tuple:
    """Relative spread of dense gradients over DP x CP, and the index of the worst (-1: none)."""
    dense = [
        i for i, p in enumerate(params) if gradient(p) is not None and getattr(p, "allreduce", True)
    ]
    if group_size(groups.dp_cp) <= 1 or not dense:
        return 0.0, -1
    sums = sketch.sums[dense]
    both = max_over(torch.cat([sums, -sums], dim=1), sums.device, groups.dp_cp)  # max gives min too
    numel = sketch.numel[dense]
    square = both[:, 1].clamp(min=1e-300)
    sum_spread = (both[:, 0] + both[:, 2]) / (numel.sqrt() * square.sqrt())
    spread = torch.maximum(sum_spread, (both[:, 1] + both[:, 3]) / square)
    worst = int(spread.argmax())
    return float(spread[worst]), dense[worst]
