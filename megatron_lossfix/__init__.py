"""megatron_lossfix: exact, layout-invariant loss normalization for Megatron-Core.

Loss functions return plain weighted sums; the weights carry the step's normalization, built
from global token and sequence counts reduced once per step; the schedule hook undoes Megatron's
internal averaging. The same gradient results under any micro-batch size and parallel layout.

Importing the package does not import Megatron: the modules imported here call it lazily, and
the ones that import it at module level or build on it (``lora``, ``megatron_lm``, ``bridge``,
``audit``) are imported by name. ``enable_cpu_megatron`` (the CPU bridge) is exported here: its
module imports Megatron only when the bridge is switched on. The layers and what each module is
for: docs/design.md §6.
"""

from megatron_lossfix.args import add_lossfix_args, from_args, schedule_from_args
from megatron_lossfix.config import MODES, LossFixConfig
from megatron_lossfix.cpu_compat import enable_cpu_megatron
from megatron_lossfix.logprobs import vocab_parallel_logprobs_entropy
from megatron_lossfix.losses import weighted_loss, weighted_sum
from megatron_lossfix.megatron_compat import slice_batch_for_cp
from megatron_lossfix.reduction import REDUCTIONS, loss_weights
from megatron_lossfix.rl_losses import (
    RLObjective,
    grpo_advantages,
    rl_objective,
    scale_advantages,
)
from megatron_lossfix.schedule import LossFixSchedule, StepRefused
from megatron_lossfix.selfcheck import SelfCheckError

__all__ = [
    "MODES",
    "REDUCTIONS",
    "LossFixConfig",
    "LossFixSchedule",
    "RLObjective",
    "SelfCheckError",
    "StepRefused",
    "add_lossfix_args",
    "enable_cpu_megatron",
    "from_args",
    "grpo_advantages",
    "loss_weights",
    "rl_objective",
    "scale_advantages",
    "schedule_from_args",
    "slice_batch_for_cp",
    "vocab_parallel_logprobs_entropy",
    "weighted_loss",
    "weighted_sum",
]

__version__ = "0.1.0"
