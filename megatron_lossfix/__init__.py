"""megatron_lossfix: exact, layout-invariant loss normalization for Megatron-Core.

Loss functions return plain weighted sums; the weights carry the step's normalization, built
from global token and sequence counts reduced once per step; the schedule hook undoes Megatron's
internal averaging. The same gradient results under any micro-batch size and parallel layout.
"""

from megatron_lossfix.config import MODES, LossFixConfig
from megatron_lossfix.losses import token_cross_entropy, weighted_loss, weighted_sum
from megatron_lossfix.reduction import REDUCTIONS, loss_weights
from megatron_lossfix.schedule import LossFixSchedule

__all__ = [
    "MODES",
    "REDUCTIONS",
    "LossFixConfig",
    "LossFixSchedule",
    "loss_weights",
    "token_cross_entropy",
    "weighted_loss",
    "weighted_sum",
]

__version__ = "0.1.0"
