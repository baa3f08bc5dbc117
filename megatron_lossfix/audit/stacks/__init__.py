"""Stack audits: an RL framework's own Megatron loss path under the audit's layouts
(``python -m megatron_lossfix audit --stack NAME``).

A stack runs the framework's released code for one training step (its loss aggregation, its
micro-batch post-processing, its token count, the Megatron schedule call it makes) on the
audit's tiny GPT, once as released and once through this project's adapter, and compares each
full gradient with the one-rank, one-micro-batch reference. ``STACKS`` maps each stack's name to
a function importing its module: the framework is imported only when its stack runs.

A stack module provides:

* ``MODES``: ``{framework mode name: StackMode}`` (``stacks.modes``), the framework's loss
  aggregation modes that have a counterpart among the plugin's;
* ``LAYOUTS``: the layouts it runs without ``--layouts``;
* ``DISTRIBUTION``: the framework's package name (``importlib.metadata``), to say what is
  missing; ``MIN_VERSION`` (optional): the oldest release the stack runs;
* ``TERMS`` (optional): ``{--terms value: the modes it allows}``, where the stack audits more
  than its whole objective (SkyRL: KL and entropy alone, its SFT path);
* ``run_stack(opts, options, *, pool, progress, worker=...) -> AuditReport`` (``options``: the
  run's settings for ``audit.json``; ``worker``: what every rank runs, which tests replace to
  bypass the adapter): the rows ``NAME`` (as released) and ``NAME+lossfix`` (through the
  adapter), worst mode per layout, plus one row per mode (``NAME:mode``,
  ``NAME+lossfix:mode``) where the run checks more than one mode (``stacks.modes.mode_rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

__all__ = ["STACKS", "load_stack"]


def _areal() -> ModuleType:
    from megatron_lossfix.audit.stacks.areal import stack as areal

    return areal


def _ms_swift() -> ModuleType:
    from megatron_lossfix.audit.stacks.ms_swift import stack as ms_swift

    return ms_swift


def _verl() -> ModuleType:
    from megatron_lossfix.audit.stacks.verl import stack as verl

    return verl


def _nemo_rl() -> ModuleType:
    from megatron_lossfix.audit.stacks.nemo_rl import stack as nemo_rl

    return nemo_rl


def _slime() -> ModuleType:
    from megatron_lossfix.audit.stacks.slime import stack as slime

    return slime


def _roll() -> ModuleType:
    from megatron_lossfix.audit.stacks.roll import stack as roll

    return roll


def _skyrl() -> ModuleType:
    from megatron_lossfix.audit.stacks.skyrl import stack as skyrl

    return skyrl


#: Stack name -> a function returning the module that runs it.
STACKS: dict[str, Callable[[], ModuleType]] = {
    "areal": _areal,
    "roll": _roll,
    "ms-swift": _ms_swift,
    "nemo-rl": _nemo_rl,
    "skyrl": _skyrl,
    "slime": _slime,
    "verl": _verl,
}


def load_stack(name: str) -> ModuleType:
    """The stack's module (it imports the framework only when run); ``ValueError`` naming the
    choices for an unknown name."""
    if name not in STACKS:
        raise ValueError(f"unknown stack {name!r}; choose from {', '.join(sorted(STACKS))}")
    return STACKS[name]()
