"""The plugin's configuration: one validated dataclass, built from flags by ``args.from_args``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lossfix.reduction import (
    REDUCTIONS,
    check_reduction,
    norm_constant_misplaced,
)

__all__ = ["MODES", "LossFixConfig"]

#: Every accepted ``--loss-reduction``: the plugin's modes, and ``off`` (stock Megatron).
MODES: tuple[str, ...] = (*REDUCTIONS, "off")

#: The boolean fields, each with the flag that sets it (for the error message).
_SWITCHES: tuple[tuple[str, str], ...] = (
    ("validate", "--lossfix-no-validate"),
    ("check_finite", "--lossfix-check-finite"),
    ("data_is_cp_sharded", "no flag"),
    ("self_check", "--lossfix-self-check"),
)


@dataclass(kw_only=True, slots=True)
class LossFixConfig:
    """How the plugin normalizes the loss of one optimizer step."""

    reduction: str = "token_mean"
    """One of :data:`MODES`. ``off`` leaves Megatron's per-micro-batch mean in place (stock
    behaviour, for comparisons)."""

    norm_constant: float | None = None
    """C of ``seq_mean_token_sum_norm`` (Dr. GRPO), e.g. the maximum response length; > 0."""

    loss_mask_key: str = "loss_mask"
    """Key of the ``[batch, seq]`` 0/1 loss mask in each micro-batch dict from the iterator."""

    weights_key: str = "loss_weights"
    """Key under which the plugin puts the float32 per-token weights into each micro-batch."""

    cu_seqlens_key: str = "cu_seqlens"
    """Key of a packed micro-batch's cumulative sequence lengths (THD format, as in
    ``PackedSeqParams.cu_seqlens_q``): a ``[1, T]`` mask holding several sequences, each
    counted as its own sequence. Micro-batches without the key are one sequence per row."""

    data_is_cp_sharded: bool = False
    """True when the data iterator already yields this rank's context-parallel shard of each
    sequence; False (Megatron-LM's convention) when it yields whole sequences that
    ``forward_step`` slices with ``megatron_compat.slice_batch_for_cp`` (the weights are sliced
    along)."""

    validate: bool = True
    """Refuse loss masks holding values other than 0 and 1, and ranks that disagree on the
    reduction, on every rank at once (the checks ride on the step's one count all-reduce and
    cost one device sync per step, before the forward pass)."""

    check_finite: bool = False
    """Raise, naming the micro-batch and the tensor, when a floating-point input of a
    micro-batch (advantages, old or reference log-probs, ...), its loss or a report entry is
    NaN or Inf (device syncs per micro-batch: for debugging runs, off by default). Plugin modes
    only: ``off`` looks at nothing of the step."""

    self_check: bool = False
    """At the first training step, re-run the same data split into other micro-batches and
    raise ``SelfCheckError`` when the gradient changes (a loss normalized twice, or not through
    the weights); one or two extra forward/backward passes, once (``selfcheck``)."""

    self_check_tolerance: float = 1e-5
    """The largest relative L2 gradient change the self-check accepts (1e-5 suits fp32; about
    1e-2 with bf16/fp16 compute)."""

    def __post_init__(self) -> None:
        # The one validation of the settings: the flags (``args.from_args``) come through here
        # too, so Python and the command line refuse the same values with the same messages.
        if not isinstance(self.reduction, str) or self.reduction not in MODES:
            raise ValueError(
                f"unknown loss reduction {self.reduction!r} (--loss-reduction); choose one of "
                f"{MODES}"
            )
        if self.reduction == "off":
            if self.norm_constant is not None:
                raise ValueError(norm_constant_misplaced(self.reduction))
        else:
            check_reduction(self.reduction, self.norm_constant)
        for name, flag in _SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} ({flag}) must be True or False, got {value!r}")
        for name in ("loss_mask_key", "weights_key", "cu_seqlens_key"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string (a batch key), got {value!r}")
        tolerance = self.self_check_tolerance
        if (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, (int, float))
            or not (math.isfinite(tolerance) and tolerance > 0)
        ):
            raise ValueError(
                "self_check_tolerance (--lossfix-self-check-tolerance) must be a finite number "
                f"> 0, got {tolerance!r}"
            )
        if self.loss_mask_key == self.weights_key:
            raise ValueError("loss_mask_key and weights_key must differ")

    @property
    def enabled(self) -> bool:
        """Whether the plugin changes the loss (any mode but ``off``)."""
        return self.reduction != "off"
