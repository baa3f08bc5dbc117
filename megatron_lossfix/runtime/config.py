"""The plugin's settings for one training step: :class:`LossFixConfig` (docs/flags.md).

Every setting is validated once, here: the flags (``args.from_args``) and the Python API refuse
alike. The modes themselves are the records of :mod:`megatron_lossfix.runtime.modes`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from megatron_lossfix.runtime.modes import (
    ALIASES,
    DEFAULT_MODE,
    MODE_RECORDS,
    MODES,
    canonical_mode,
    mode_of,
)

__all__ = ["LossFixConfig", "check_mode"]


def check_mode(reduction: object, norm_constant: object, modes: tuple[str, ...]) -> None:
    """Raise ``ValueError`` for an unknown mode or a bad, missing or misplaced constant.

    ``modes`` lists the accepted names; an alias of one of them is accepted too."""
    if isinstance(reduction, str) and ALIASES.get(reduction) in modes:
        reduction = ALIASES[reduction]
    if not isinstance(reduction, str) or reduction not in modes:
        aliases = ", ".join(f"{a} = {m}" for a, m in ALIASES.items() if m in modes)
        raise ValueError(
            f"unknown loss reduction {reduction!r} (--loss-reduction); choose one of {modes}"
            + (f" (aliases: {aliases})" if aliases else "")
        )
    if norm_constant is None:
        if mode_of(reduction).uses_constant:
            raise ValueError(
                f"reduction {reduction!r} needs norm_constant (e.g. the maximum "
                "response length); pass --loss-norm-constant"
            )
        return
    if not mode_of(reduction).uses_constant:
        users = ", ".join(m.name for m in MODE_RECORDS if m.uses_constant)
        raise ValueError(
            "norm_constant (--loss-norm-constant) applies only to reduction "
            f"{users}, not {reduction}; drop it or change the reduction"
        )
    if isinstance(norm_constant, bool) or not isinstance(norm_constant, numbers.Real):
        raise ValueError(
            f"norm_constant (--loss-norm-constant) must be a number, got {norm_constant!r}"
        )
    if not (math.isfinite(norm_constant) and norm_constant > 0):
        raise ValueError(
            f"norm_constant (--loss-norm-constant) must be > 0 and finite, got {norm_constant!r}"
        )


@dataclass(kw_only=True, slots=True)
class LossFixConfig:
    """How the plugin normalizes the loss of one optimizer step (flags: ``args.from_args``)."""

    reduction: str = DEFAULT_MODE
    """One of ``MODES``; ``off`` leaves Megatron's per-micro-batch mean (stock)."""

    norm_constant: float | None = None
    """C of ``seq_mean_token_sum_norm`` (Dr. GRPO), e.g. the maximum response length; > 0."""

    loss_mask_key: str = "loss_mask"
    """Key of the ``[batch, seq]`` 0/1 loss mask in each micro-batch dict from the iterator."""

    weights_key: str = "loss_weights"
    """Key under which the plugin puts the float32 per-token weights into each micro-batch."""

    cu_seqlens_key: str = "cu_seqlens"
    """Key of a packed (THD) micro-batch's cumulative sequence lengths: its ``[1, T]`` mask
    holds several sequences, each counted as its own. Without it each row is a sequence."""

    group_ids_key: str = "group_ids"
    """Key of each sequence's group id (``group_mean``: a prompt's id, the same for all its
    responses), an integer tensor with one entry per row (packed: per ``cu_seqlens`` sequence),
    in ``[0, batch[num_groups_key])`` and global over the step."""

    num_groups_key: str = "num_groups"
    """Key of the step's group id range (an int, the same in every micro-batch and on every
    rank); groups without a loss token in the step neither contribute nor count."""

    trajectory_ids_key: str = "trajectory_ids"
    """Key of each sequence's trajectory id, like ``group_ids_key``: where given, the sequence
    modes weight trajectories (a trajectory split into several rows counts once)."""

    num_trajectories_key: str = "num_trajectories"
    """Key of the step's trajectory id range, like ``num_groups_key``."""

    pair_ids_key: str = "pair_ids"
    """Key of each sequence's pair (``pair_mean``): an integer tensor with one entry per row
    (packed: per ``cu_seqlens`` sequence), in ``[0, the micro-batch's sequences)``; the sequences
    of a micro-batch that share an id are one pair (a preference pair, a KTO example). Each
    micro-batch's own ids: no range key."""

    data_is_cp_sharded: bool = False
    """True when the iterator yields this rank's context-parallel shard of each sequence; False
    (Megatron-LM's convention) when ``forward_step`` slices whole sequences with
    ``slice_batch_for_cp`` (the weights are sliced along)."""

    validate: bool = True
    """Refuse masks holding values other than 0 and 1, and ranks that disagree on the mode, on
    every rank at once (rides on the step's count all-reduce; one device sync per step)."""

    check_finite: bool = False
    """Raise, naming micro-batch and tensor, on a NaN/Inf floating input, loss or report entry
    (device syncs per micro-batch: for debugging). Plugin modes only."""

    mask_in_loss: bool = False
    """What a token the loss drops (``kept_weights``, ``weighted_loss(keep=)``, ``rl_objective``'s
    masks) means: False, its loss is zeroed and it still counts in the normalization; True, it
    leaves every count of the mode, exactly under every layout (docs/design.md §10)."""

    counting_pass: bool = False
    """With ``mask_in_loss``: always learn the kept counts from a forward-only pass before the
    step (one extra forward), instead of scaling the gradients once after Megatron's schedule.
    The step takes that path by itself where the scale would be wrong (MoE auxiliary losses,
    multi-token prediction)."""

    self_check: bool | None = None
    """At the first training step, re-run its data split into other micro-batches and raise
    ``SelfCheckError`` when the gradient changes (a forward-only pass and one or two extra
    passes, once, no copy of the gradient): it catches a loss function that returns a mean
    instead of the weighted sum. ``None`` (the default): on
    in every mode but ``off`` and ``token_mean_legacy``, skipped silently where the step
    cannot be re-split or an integration cannot run it; ``True``: on, and refused (or warned
    about) where it cannot run; ``False``: off (``--no-lossfix-self-check``)."""

    self_check_tolerance: float = 1e-5
    """The largest relative L2 gradient change the self-check accepts (about 1e-2 with bf16)."""

    def ids_keys(self, kind: str) -> tuple[str, str | None]:
        """The batch keys of the ids of ``kind`` (``prompt_groups.ids_for_mode``) and of their
        range (None: pair ids, each micro-batch's own)."""
        keys = {
            "group": (self.group_ids_key, self.num_groups_key),
            "trajectory": (self.trajectory_ids_key, self.num_trajectories_key),
            "pair": (self.pair_ids_key, None),
        }
        return keys[kind]

    def __post_init__(self) -> None:
        # The one validation: the flags (``args.from_args``) come through here too.
        check_mode(self.reduction, self.norm_constant, MODES)
        self.reduction = canonical_mode(self.reduction)
        switches = {
            "validate": "--lossfix-no-validate",
            "check_finite": "--lossfix-check-finite",
            "data_is_cp_sharded": "no flag",
            "self_check": "--[no-]lossfix-self-check",
            "mask_in_loss": "--lossfix-mask-in-loss",
            "counting_pass": "--lossfix-counting-pass",
        }
        for name, flag in switches.items():
            value, default = getattr(self, name), " or None (the default)" * (name == "self_check")
            if not isinstance(value, bool) and not (default and value is None):
                raise ValueError(f"{name} ({flag}) must be True or False{default}, got {value!r}")
        keys = (
            "loss_mask_key",
            "weights_key",
            "cu_seqlens_key",
            "group_ids_key",
            "num_groups_key",
            "trajectory_ids_key",
            "num_trajectories_key",
            "pair_ids_key",
        )
        for name in keys:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string (a batch key), got {value!r}")
        tol = self.self_check_tolerance
        if (
            isinstance(tol, bool)
            or not isinstance(tol, (int, float))
            or not (math.isfinite(tol) and tol > 0)
        ):
            raise ValueError(
                "self_check_tolerance (--lossfix-self-check-tolerance) must be a finite number "
                f"> 0, got {tol!r}"
            )
        if self.loss_mask_key == self.weights_key:
            raise ValueError("loss_mask_key and weights_key must differ")
        if self.mask_in_loss and mode_of(self.reduction).stock:
            raise ValueError(
                "mask_in_loss (--lossfix-mask-in-loss) needs a plugin mode: with "
                "--loss-reduction off Megatron normalizes as stock; pick a mode or drop the flag"
            )
        if self.counting_pass and not self.mask_in_loss:
            raise ValueError(
                "counting_pass (--lossfix-counting-pass) applies only with mask_in_loss "
                "(--lossfix-mask-in-loss); add that flag or drop this one"
            )
