"""The check of one step: :class:`SelfCheck`, whose ``run`` calls the phases in their order (read,
plan, re-run, normal run, verdict), and whether a step is checked at all
(:func:`first_step_check`), with the line that says it is not (:func:`left_out`,
:func:`switched_on`): never a silent skip (docs/design.md §9)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.modes import mode_of
from megatron_lossfix.runtime.process_groups import ModelParallelGroups, StepGroups
from megatron_lossfix.step.driver import Step
from megatron_lossfix.step.megatron_compat import model_parallel_groups
from megatron_lossfix.step.selfcheck.gradient_sketch import Sketch
from megatron_lossfix.step.selfcheck.model import CheckedModel, model_chunks
from megatron_lossfix.step.selfcheck.plan import choose_plan, why_not_checkable
from megatron_lossfix.step.selfcheck.reads import read_step, replays
from megatron_lossfix.step.selfcheck.runs import normal_run, resplit_runs
from megatron_lossfix.step.selfcheck.verdict import (
    replica_spread,
    replicas_differ,
    report,
    resplit_error,
)

__all__ = ["SelfCheck", "first_step_check", "left_out", "switched_on"]


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
        chunks, model_config = model_chunks(call["model"])
        reason = why_not_checkable(self.config.reduction, model_config, chunks)
        if reason:
            self._skipped(reason)
            return run(**call)
        model = CheckedModel.at_entry(chunks, model_config)
        # 1. What forward_step reads from each data iterator; the step's record names its groups.
        reads, record = read_step(step, call, via, len(chunks))
        groups, shards = record.groups, model_parallel_groups(record.pg_collection)
        normal = replays(call, reads)
        # 2. The re-split every rank of the model agrees on (or why none), run and sketched.
        choice = choose_plan(self.config, self.explicit, step, call, model, reads, groups, shards)
        if choice.plan is None:
            self._skipped(choice.skipped)
            result = run(**normal)
            if choice.replicas:
                self._replicas(model, groups, shards)
            return result
        self.last_plan = choice.plan
        resplit = resplit_runs(run, step, call, reads, choice, model, shards, normal)
        # 3. The normal run, last: training goes on from it, as without the check; 4. every
        # DP x CP replica must hold the same reduced gradient.
        result = normal_run(run, step, normal, model, resplit.tokens)
        sketch = self._replicas(model, groups, shards)
        # 5. The re-split runs' gradient against the normal run's.
        self.last_error = resplit_error(resplit, sketch, model, groups, shards)
        m, reduction = call["num_microbatches"], self.config.reduction
        report(self.last_error, self.tolerance, reduction, m, choice.plan)
        return result

    def _replicas(
        self, model: CheckedModel, groups: StepGroups, shards: ModelParallelGroups
    ) -> Sketch:
        """The sketch of the gradient now held (the distributed optimizer's shards gathered
        first); raises ``SelfCheckError`` when the DP x CP replicas do not hold the same."""
        sketch = model.sketch(shards)
        spread, mine, worst = replica_spread(model, sketch, groups, shards)
        self.last_replica_spread = spread
        if not spread <= self.tolerance:
            raise replicas_differ(spread, self.tolerance, mine, worst, model, groups)
        return sketch

    def _skipped(self, why: str) -> None:
        """A step that cannot be checked: a warning when the check was asked for, else one
        line (rank 0): never a silent skip."""
        if self.explicit:
            warnings.warn(f"megatron_lossfix self-check skipped: {why}", stacklevel=4)
        elif not dist.is_initialized() or dist.get_rank() == 0:
            print(f"megatron_lossfix self-check: not run on the first step: {why}", flush=True)
