"""Command-line flags: ``add_lossfix_args`` adds them, ``from_args`` turns them into a config,
``schedule_from_args`` into the schedule a training loop calls.

Use as Megatron-LM's ``extra_args_provider``::

    pretrain(..., extra_args_provider=add_lossfix_args)
    lossfix_config = from_args(get_args())   # None when --loss-reduction was not given

or, in a loop of your own, where ``get_forward_backward_func()`` was called::

    schedule = schedule_from_args(args)     # stock Megatron when --loss-reduction was not given
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from megatron_lossfix.runtime.config import LossFixConfig
from megatron_lossfix.runtime.modes import ALIASES, MODE_RECORDS, MODES, STOCK, describe_modes
from megatron_lossfix.step.schedule import LossFixSchedule

__all__ = [
    "add_lossfix_args",
    "finite_float",
    "from_args",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "schedule_from_args",
]


# argparse types: a wrong value ends in argparse's one line, which names the flag.
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (seeds: numpy and Python's random refuse negatives)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (argparse names the flag in its error)."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


#: The modes that take ``--loss-norm-constant``.
CONSTANT_MODES = tuple(m for m in MODE_RECORDS if m.uses_constant)

#: The flags, in the order ``--help`` lists them: (flag, ``add_argument`` keywords).
_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--loss-reduction",
        dict(
            choices=(*MODES, *ALIASES),
            default=None,
            help=f"how the step's loss is normalized: {describe_modes()}.",
        ),
    ),
    (
        "--loss-norm-constant",
        dict(
            type=float,
            default=None,
            help="; ".join(f"C of {m.name}: {m.constant}" for m in CONSTANT_MODES)
            + ". Must be > 0.",
        ),
    ),
    (
        "--lossfix-check-finite",
        dict(
            action="store_true",
            help="raise, naming the micro-batch and tensor, when a micro-batch input "
            "(advantages, log-probs, ...), its loss or a report entry is NaN or Inf (device "
            "syncs per micro-batch: for debugging).",
        ),
    ),
    (
        "--lossfix-no-validate",
        dict(
            action="store_true",
            help="skip the per-step checks that loss masks hold only 0 and 1 and that all "
            "data-parallel ranks use the same reduction (saves one device sync per step).",
        ),
    ),
    (
        "--lossfix-mask-in-loss",
        dict(
            action="store_true",
            help="tokens the loss function drops (a mask it decides from the forward pass: "
            "kept_weights, weighted_loss(keep=), rl_objective's ratio band and off-policy "
            "masking) leave the normalization: the mode's counts are those of the kept tokens, "
            "exactly under every layout. Without it they are zeroed and still count.",
        ),
    ),
    (
        "--lossfix-counting-pass",
        dict(
            action="store_true",
            help="with --lossfix-mask-in-loss: learn the kept counts from a forward-only pass "
            "before each step (one extra forward) instead of scaling the gradients after "
            "Megatron's schedule; taken automatically where that scale cannot be exact (MoE "
            "auxiliary losses, multi-token prediction).",
        ),
    ),
    (
        "--lossfix-self-check",
        dict(
            action=argparse.BooleanOptionalAction,
            default=None,
            help="at the first training step, re-run the same data split into different "
            "micro-batches and raise if the gradient changes (catches a loss function that "
            "returns a mean instead of the weighted sum, or ignores the plugin's weights); "
            "costs one or two extra forward/backward passes, once. On by default with "
            "--loss-reduction (skipped silently where the step cannot be re-split); "
            "--lossfix-self-check also warns or refuses there; --no-lossfix-self-check "
            "skips it.",
        ),
    ),
    (
        "--lossfix-self-check-tolerance",
        dict(
            type=positive_float,
            default=1e-5,
            help="largest relative L2 gradient change --lossfix-self-check accepts (default "
            "1e-5 for fp32; use about 1e-2 with bf16/fp16 compute).",
        ),
    ),
)

#: Only in the patched Megatron-LM ``pretrain_gpt.py``: the example scripts have ``--metrics-out``.
_MEGATRON_LM_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--lossfix-metrics-out",
        dict(
            default=None,
            metavar="PATH",
            help="with --loss-reduction: write one JSON line per training iteration (last "
            "rank): iteration, loss (L, full precision), lm_loss (what Megatron-LM logs), "
            "grad_norm, num_tokens, num_sequences, step_time_s.",
        ),
    ),
)


def add_lossfix_args(
    parser: argparse.ArgumentParser,
    *,
    megatron_lm: bool = False,
    default_reduction: str | None = None,
) -> argparse.ArgumentParser:
    """Add the plugin's flags, in one group, to ``parser`` and return it.

    ``megatron_lm=True`` (the patched Megatron-LM ``pretrain_gpt.py``) also adds
    ``--lossfix-metrics-out``; the example scripts have their own ``--metrics-out``.
    ``default_reduction``: the mode a run without ``--loss-reduction`` takes (the examples:
    ``token_mean``); ``None``, the default, keeps the plugin out of such a run. ``--help``
    says which.
    """
    modes = (*MODES, *ALIASES)
    if default_reduction is not None and default_reduction not in modes:
        raise ValueError(f"default_reduction {default_reduction!r}: choose from {modes} or None")
    group = parser.add_argument_group(
        "megatron_lossfix", "exact, layout-invariant loss normalization"
    )
    for flag, options in _FLAGS + (_MEGATRON_LM_FLAGS if megatron_lm else ()):
        if flag == "--loss-reduction":
            said = f"{options['help']} {_reduction_default(default_reduction)}"
            options = {**options, "default": default_reduction, "help": said}
        group.add_argument(flag, **options)
    return parser


def _reduction_default(mode: str | None) -> str:
    """What ``--loss-reduction``'s help says a run without it does."""
    if mode is None:
        return "Not given: the plugin stays out (stock Megatron's own normalization)."
    return f"Not given: {mode} ({STOCK} for stock Megatron)."


def from_args(args: argparse.Namespace) -> LossFixConfig | None:
    """The plugin config from parsed flags; ``None`` when ``--loss-reduction`` was not given.

    Raises ``ValueError`` for combinations that would be silently ignored or wrong: the
    messages of :class:`LossFixConfig`, which validates the flags as it validates Python
    arguments.
    """
    reduction = getattr(args, "loss_reduction", None)
    norm_constant = getattr(args, "loss_norm_constant", None)
    self_check = getattr(args, "lossfix_self_check", None)
    if reduction is None:
        if norm_constant is not None:
            modes = " or ".join(m.name for m in CONSTANT_MODES)
            raise ValueError(f"--loss-norm-constant needs --loss-reduction {modes}")
        if self_check:  # asked for explicitly
            raise ValueError("--lossfix-self-check needs --loss-reduction (the plugin must be on)")
        for flag in ("mask_in_loss", "counting_pass"):
            if getattr(args, f"lossfix_{flag}", False):
                name = "--lossfix-" + flag.replace("_", "-")
                raise ValueError(f"{name} needs --loss-reduction (the plugin must be on)")
        return None
    # Every other check is LossFixConfig's own: the flags and the Python API refuse alike.
    return LossFixConfig(
        reduction=reduction,
        norm_constant=norm_constant,
        validate=not getattr(args, "lossfix_no_validate", False),
        check_finite=getattr(args, "lossfix_check_finite", False),
        self_check=self_check,
        mask_in_loss=getattr(args, "lossfix_mask_in_loss", False),
        counting_pass=getattr(args, "lossfix_counting_pass", False),
        self_check_tolerance=getattr(args, "lossfix_self_check_tolerance", 1e-5),
    )


def schedule_from_args(
    args: argparse.Namespace,
    forward_backward_func: Callable[..., Any] | None = None,
    *,
    pg_collection: Any = None,
) -> Callable[..., Any]:
    """The schedule to call where a training loop called ``get_forward_backward_func()``.

    A [`LossFixSchedule`][megatron_lossfix.LossFixSchedule] built from the flags; without
    ``--loss-reduction`` its mode is ``off``: a literal pass-through to Megatron's own schedule
    (no collective, nothing added to the batches, the loss tuples handed on unchanged), so a
    ``loss_func`` that falls back to the loss mask when ``batch`` has no ``"loss_weights"`` works
    with and without the flag. With ``--loss-reduction`` its first training step is checked
    unless ``--no-lossfix-self-check`` (``LossFixConfig.self_check``): one line with the
    measured gradient change when it passes, ``SelfCheckError`` when not.

    Raises ``ValueError`` for contradictory flags (see ``from_args``), and for
    ``--lossfix-self-check`` without ``--loss-reduction``.
    """
    config = from_args(args) or LossFixConfig(reduction=STOCK)
    return LossFixSchedule(config, forward_backward_func, pg_collection=pg_collection)
