"""The RL replay of Megatron-LM's ``train_rl.py`` for the tests.

The replay itself (plans, rollout sets, the rank side that ``torchrun -m`` runs) is part of the
package: :mod:`megatron_lossfix.integrations.megatron_lm.rl_replay` (and the modules of its
parts, ``rl_plans``, ``rl_records``, ``rl_compare``). This adds the tests' launch
of it (:func:`rl_launch`), its ranks forked from the tree's zygote, and the one plan-launch-read
loop of the tests' launches (:func:`run_waves`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_lossfix.integrations.megatron_lm.rl_compare import compare
from megatron_lossfix.integrations.megatron_lm.rl_plans import (
    MODULE,
    PLAN_ENV,
    SEQ_LENGTH,
    rl_args,
    rollout_sets,
    write_plan,
)
from megatron_lossfix.integrations.megatron_lm.rl_records import read_records
from megatron_lossfix.integrations.megatron_lm.rl_replay import MockTokenizer

__all__ = [
    "PLAN_ENV",
    "SEQ_LENGTH",
    "MockTokenizer",
    "RLRun",
    "compare",
    "read_records",
    "rl_args",
    "rl_launch",
    "rollout_sets",
    "run_waves",
    "write_plan",
]


def rl_launch(
    megatron_lm_path: str | os.PathLike, plan: str | os.PathLike, args: Sequence[str], nproc: int
) -> Any:
    """The launch of the replay in place of ``train_rl.py`` with ``plan``."""
    from helpers.megatron_lm_run import Launch

    # Its ranks fork from a zygote that imported train_rl.py's modules from the tree once.
    return Launch(megatron_lm_path=megatron_lm_path, args=list(args), nproc=nproc,
                  script=MODULE, module=True, preload=["train_rl"],
                  env={PLAN_ENV: str(Path(plan).resolve())})  # fmt: skip


@dataclasses.dataclass
class RLRun:
    """One launch of the replay: ``nproc`` ranks train ``plan`` (one entry per iteration) with
    :func:`rl_args` of that length (``per_token``, ``rollout_set``), learning rate ``lr``, and
    ``flags`` after them."""

    nproc: int
    plan: list[dict]
    flags: list[str] = dataclasses.field(default_factory=list)
    per_token: bool = True
    rollout_set: str | None = None
    lr: str = "0"

    def args(self) -> list[str]:
        args = rl_args(train_iters=len(self.plan), per_token=self.per_token,
                       rollout_set=self.rollout_set)  # fmt: skip
        args[args.index("--lr") + 1] = self.lr
        return args + self.flags


def run_waves(
    tree: str | os.PathLike,
    folder: str | os.PathLike,
    prefix: str,
    waves: Sequence[dict[Any, RLRun]],
    timeout: float = 3000,
) -> dict[Any, list[dict]]:
    """Each wave's runs side by side, the waves one after another (a later wave may load what
    an earlier one saved), on the patched checkout ``tree``: each run's plan written to
    ``folder/<prefix>-<n>.plan.json``, its records to ``<prefix>-<n>.jsonl``. Every launch must
    exit 0 and record one line per iteration of its plan. Returns each run's records."""
    from helpers.megatron_lm_run import run_pretrain_gpts

    records: dict[Any, list[dict]] = {}
    for wave in waves:
        launches, outs = [], []
        for run in wave.values():
            out = Path(folder) / f"{prefix}-{len(records) + len(outs)}.jsonl"
            path = write_plan(out.with_suffix(".plan.json"), tree, run.plan, out=out)
            launches.append(rl_launch(tree, path, run.args(), run.nproc))
            outs.append(out)
        results = run_pretrain_gpts(launches, timeout=timeout)
        for (name, run), out, result in zip(wave.items(), outs, results, strict=True):
            assert result.returncode == 0, (name, result.output[-6000:])
            records[name] = read_records(out)
            assert len(records[name]) == len(run.plan), (name, result.output[-6000:])
    return records
