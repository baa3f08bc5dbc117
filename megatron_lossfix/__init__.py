"""megatron_lossfix: exact, layout-invariant loss normalization for Megatron-Core.

Loss functions return plain weighted sums; the weights carry the step's normalization, built
from global token and sequence counts reduced once per step; the schedule hook undoes Megatron's
internal averaging. The same gradient results under any micro-batch size and parallel layout.

One layer per folder, dependencies pointing down: ``runtime`` (the config, the table of modes,
masks -> counts -> weights, the losses; no Megatron), ``step`` (the Megatron step) beside
``harness`` (Megatron-Core on CPU), the flags (``args``), ``integrations`` (Megatron-LM, Megatron
Bridge, the patch tool, the RL frameworks), ``rl`` (objective, policy losses, log-prob kernel)
and ``audit`` (what ``python -m megatron_lossfix audit`` runs). Importing the package does not
import Megatron: the modules imported here call it lazily, and the subpackages that import it at
module level are imported by name. docs/design.md §6 maps every module.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from megatron_lossfix.args import add_lossfix_args, schedule_from_args
from megatron_lossfix.harness.cpu_megatron import enable_cpu_megatron
from megatron_lossfix.rl.logprobs import vocab_parallel_logprobs_entropy
from megatron_lossfix.rl.objective import RLObjective, grpo_advantages, rl_objective
from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.losses import loss_weights, weighted_loss
from megatron_lossfix.runtime.mask_in_loss import kept_weights
from megatron_lossfix.runtime.modes import REDUCTIONS
from megatron_lossfix.runtime.pairs import pair_weights
from megatron_lossfix.step.agreement import StepRefused
from megatron_lossfix.step.megatron_compat import slice_batch_for_cp
from megatron_lossfix.step.schedule import LossFixSchedule
from megatron_lossfix.step.selfcheck.verdict import SelfCheckError

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
    "pair_weights",
    "rl_objective",
    "schedule_from_args",
    "slice_batch_for_cp",
    "vocab_parallel_logprobs_entropy",
    "weighted_loss",
]

__version__ = "0.1.0"

#: Modules that moved: those that stood at the package root before the runtime moved into layer
#: folders, and those of ``integrations/`` and ``audit/stacks/`` before each framework got a folder
#: of its own. Their old addresses keep working, with a DeprecationWarning, for one release
#: (CHANGELOG.md). (A framework's old module address, ``integrations.verl`` say, is its folder now,
#: which serves the adapter's names: it needs no entry here.)
MOVED_MODULES = {
    f"{__name__}.{old}": f"{__name__}.{new}"
    for old, new in {
        "agreement": "step.agreement",
        "counting_pass": "step.counting_pass",
        "cpu_compat": "harness.cpu_megatron",
        "group_ids": "runtime.prompt_groups",
        "groups": "runtime.process_groups",
        "kept": "runtime.mask_in_loss",
        "losses": "runtime.losses",
        "megatron_compat": "step.megatron_compat",
        "metrics": "step.metrics",
        "mtp": "step.mtp",
        "reduction": "runtime.weights",
        "schedule": "step.schedule",
        "selfcheck": "step.selfcheck",
        "wrappers": "step.wrappers",
        "audit.stacks.slime_batch": "audit.stacks.slime.batch",
        "audit.stacks.slime_objective": "audit.stacks.slime.objective",
        "audit.stacks.slime_ranks": "audit.stacks.slime.ranks",
        "integrations.cpu_megatron_bridge": "integrations.bridge.cpu",
        "integrations.cpu_megatron_lm": "integrations.megatron_lm.cpu",
        "integrations.install_bridge": "integrations.bridge.install",
        "integrations.megatron_lm_batches": "integrations.megatron_lm.batches",
        "integrations.megatron_lm_metrics": "integrations.megatron_lm.metrics",
        "integrations.megatron_lm_rl": "integrations.megatron_lm.rl",
        "integrations.megatron_lm_rl_compare": "integrations.megatron_lm.rl_compare",
        "integrations.megatron_lm_rl_groups": "integrations.megatron_lm.rl_groups",
        "integrations.megatron_lm_rl_plans": "integrations.megatron_lm.rl_plans",
        "integrations.megatron_lm_rl_records": "integrations.megatron_lm.rl_records",
        "integrations.megatron_lm_rl_replay": "integrations.megatron_lm.rl_replay",
        "integrations.megatron_lm_tiny_gpt": "integrations.megatron_lm.tiny_gpt",
        "integrations.patches": "integrations.megatron_lm.patches",
    }.items()
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a moved module's old address: the new module itself, after a warning."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):  # noqa: ANN001, ANN201
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old address goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:  # noqa: ANN001
        """The module was executed under its new name."""


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
