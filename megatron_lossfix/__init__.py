"""megatron_lossfix: exact, layout-invariant loss normalization for Megatron-Core.

Loss functions return plain weighted sums; the weights carry the step's normalization, built
from global token and sequence counts reduced once per step; the schedule hook undoes Megatron's
internal averaging. The same gradient results under any micro-batch size and parallel layout.

The package's top level is the runtime (config, weights, losses, the Megatron step); below it sit
``integrations`` (Megatron-LM, Megatron Bridge, the patch tool), ``rl`` (objective, policy losses,
log-prob kernel) and ``audit`` (what ``python -m megatron_lossfix audit`` runs). Importing the
package does not import Megatron: the modules imported here call it lazily, and the subpackages
that import it at module level are imported by name. docs/design.md §6 maps every module.
"""

from megatron_lossfix.agreement import StepRefused
from megatron_lossfix.args import add_lossfix_args, schedule_from_args
from megatron_lossfix.config import LossFixConfig
from megatron_lossfix.cpu_compat import enable_cpu_megatron
from megatron_lossfix.kept import kept_weights
from megatron_lossfix.losses import loss_weights, weighted_loss
from megatron_lossfix.megatron_compat import slice_batch_for_cp
from megatron_lossfix.modes import REDUCTIONS
from megatron_lossfix.rl.logprobs import vocab_parallel_logprobs_entropy
from megatron_lossfix.rl.objective import RLObjective, grpo_advantages, rl_objective
from megatron_lossfix.schedule import LossFixSchedule
from megatron_lossfix.selfcheck import SelfCheckError

__all__ = [
    "REDUCTIONS",
    "LossFixConfig",
    "LossFixSchedule",
    "RLObjective",
    "SelfCheckError",
    "StepRefused",
    "add_lossfix_args",
    "enable_cpu_megatron",
    "grpo_advantages",
    "kept_weights",
    "loss_weights",
    "rl_objective",
    "schedule_from_args",
    "slice_batch_for_cp",
    "vocab_parallel_logprobs_entropy",
    "weighted_loss",
]

__version__ = "0.1.0"
