"""AReaL (``areal`` on the package index) with exact, layout-invariant loss normalization.

The framework's one place in the integrations: the adapter (:mod:`.adapter`, re-exported here;
its switch is :func:`enable`), beside the stack audit that runs AReaL's own step
(``megatron_lossfix.audit.stacks.areal``). docs/areal.md says how to install and run both.
"""

from megatron_lossfix.integrations.areal.adapter import (
    AREAL_MODE,
    SELF_CHECK_ENV,
    LossFixForwardBackward,
    cp_local_tokens,
    disable,
    enable,
    lossfix_config,
    lossfix_train_batch,
    step_m2po_keep,
    weighted_loss,
)

__all__ = [
    "AREAL_MODE",
    "SELF_CHECK_ENV",
    "LossFixForwardBackward",
    "cp_local_tokens",
    "disable",
    "enable",
    "lossfix_config",
    "lossfix_train_batch",
    "step_m2po_keep",
    "weighted_loss",
]
