"""The RL replay of Megatron-LM's ``train_rl.py`` for the tests.

The replay itself (plans, rollout sets, the rank side that ``torchrun -m`` runs) is part of the
package: :mod:`megatron_lossfix.integrations.megatron_lm.rl_replay` (and the modules of its
parts, ``rl_plans``, ``rl_records``, ``rl_compare``). This adds the tests' launch
of it (:func:`rl_launch`), its ranks forked from the tree's zygote.
"""

from __future__ import annotations

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
    "compare",
    "read_records",
    "rl_args",
    "rl_launch",
    "rollout_sets",
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
