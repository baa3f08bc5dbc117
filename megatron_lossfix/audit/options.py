"""The audit's options: the run's settings (:class:`AuditOptions`), their checks, and the
command-line flags that set them (``python -m megatron_lossfix audit --help``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from megatron_lossfix.audit.matrix import (
    AUDIT_LAYOUTS,
    LAYOUT_PRESETS,
    MatrixLayout,
    parse_layout,
)
from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.oracle_case import COUNTED_BEFORE, COUNTING_PASS
from megatron_lossfix.audit.stacks import STACKS, load_stack
from megatron_lossfix.runtime.weights import ALIASES, MODES

__all__ = [
    "DEFAULT_LAYOUTS",
    "MODEL_SIZES",
    "TOLERANCE",
    "AuditLayout",
    "AuditOptions",
    "add_audit_args",
    "default_out",
    "options_from_args",
    "options_json",
    "validate_options",
]

#: The audit's names for the shared matrix's layout and default layouts.
AuditLayout = MatrixLayout
DEFAULT_LAYOUTS = AUDIT_LAYOUTS

TOLERANCE = 1e-5

#: Where the audit writes without ``--out`` (:func:`default_out`).
OUT = "audit-out"

#: ``--terms``: what a stack audit covers (a stack offers those in its ``TERMS``).
TERMS = ("all", "kl_entropy", "sft")

#: Experts per layer of the MoE model that EP layouts run (divisible by every EP size allowed).
MOE_EXPERTS = 4

#: ``--mask-in-loss``: the RL objective (PPO, KL, entropy) with the two masks it decides from
#: the current log-probs: an importance-ratio band per token against the fixed old log-probs,
#: and off-policy sequence masking (docs/design.md §10).
MASKED_OBJECTIVE: dict[str, Any] = {
    "kl_coef": 0.1,
    "entropy_coef": 0.01,
    "ratio_band": (0.75, 1.3),
    "offpolicy_kl_threshold": 0.05,
}

#: ``build_tiny_gpt`` arguments of each ``--model-size``.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 4, "hidden": 32, "heads": 4},
    "small": {"num_layers": 8, "hidden": 128, "heads": 8},
}


@dataclass
class AuditOptions:
    """Everything a run depends on (the parsed command line)."""

    modes: tuple[str, ...] = MODES
    layouts: tuple[AuditLayout, ...] = ()
    num_layers: int = 4
    hidden: int = 32
    heads: int = 4
    global_batch_size: int = 24
    seq_length: int = 16
    seed: int = 1234
    per_token_loss: bool = False
    tolerance: float = TOLERANCE
    timeout_s: float = 300.0
    stack: str | None = None
    """An RL framework whose own loss path is audited (``--stack``); its modes are then the
    framework's names."""
    terms: str = "all"
    """With ``stack``: the loss terms audited (:data:`TERMS`), where the stack offers a choice
    (its ``TERMS``)."""
    mask_in_loss: bool = False
    """The objective decides a mask inside the loss (:data:`MASKED_OBJECTIVE`), and every mode
    runs with ``mask_in_loss`` (rows :attr:`rows`)."""

    @property
    def rows(self) -> tuple[str, ...]:
        """The matrix's rows: the modes; with :attr:`mask_in_loss` each plugin mode also
        through the counting pass, and counted before the forward (zeroed, still counted: the
        baseline that shows what excluding the dropped tokens changes)."""
        if not self.mask_in_loss:
            return self.modes
        rows = []
        for mode in self.modes:
            rows += [mode] if mode == "off" else [mode, mode + COUNTING_PASS, mode + COUNTED_BEFORE]
        return tuple(rows)

    def case(self, layout: AuditLayout) -> OracleCase:
        """The oracle's model and data for ``layout``."""
        model: dict[str, Any] = {
            "num_layers": self.num_layers,
            "hidden": self.hidden,
            "heads": self.heads,
        }
        # Without Transformer Engine, context parallelism needs layers that mix no tokens
        # (docs/design.md §7): CP layouts use the same model with attention replaced by identity.
        if layout.cp > 1:
            model["no_attention"] = True
        if layout.ep > 1:
            model["num_experts"] = MOE_EXPERTS
        masked: dict[str, Any] = {}
        if self.mask_in_loss:
            masked = {
                "objective": "ppo",
                "rl_kwargs": dict(MASKED_OBJECTIVE),
                "schedule_kwargs": {"mask_in_loss": True},
            }
        return OracleCase(
            global_batch_size=self.global_batch_size,
            seq_length=self.seq_length,
            seed=self.seed,
            per_token=self.per_token_loss,
            model_kwargs=model,
            **masked,
        )


def _allowed_modes(stack: str | None, terms: str) -> tuple[str, ...]:
    """The modes a run may check: the plugin's, or the stack's own for ``terms``."""
    if stack is None:
        if terms != "all":
            raise ValueError(f"--terms {terms} needs --stack")
        return (*MODES, *ALIASES)
    module = load_stack(stack)
    offered = getattr(module, "TERMS", {"all": tuple(module.MODES)})
    if terms not in offered:
        raise ValueError(f"--stack {stack} audits --terms {', '.join(offered)}, not {terms}")
    return tuple(offered[terms])


def validate_options(opts: AuditOptions) -> None:
    """Raise ``ValueError``, naming the layout and the flag, for a matrix that cannot run."""
    if opts.mask_in_loss and opts.stack is not None:
        raise ValueError("--mask-in-loss audits the plugin's own modes: drop --stack")
    allowed = _allowed_modes(opts.stack, opts.terms)
    bad = [m for m in opts.modes if m not in allowed]
    if bad:
        raise ValueError(f"--modes: unknown {bad}; choose from {', '.join(allowed)}")
    for lay in opts.layouts:
        if lay.world_size > 8:
            raise ValueError(f"layout {lay.name} needs {lay.world_size} ranks; at most 8")
        if opts.global_batch_size % lay.dp:
            raise ValueError(
                f"layout {lay.name}: --global-batch-size {opts.global_batch_size} is not "
                f"divisible by dp={lay.dp}"
            )
        if lay.num_microbatches > opts.global_batch_size // lay.dp:
            raise ValueError(
                f"layout {lay.name}: {lay.num_microbatches} micro-batches but only "
                f"{opts.global_batch_size // lay.dp} sequences per DP rank"
            )
        stages = lay.pp * (lay.vpp or 1)
        if opts.num_layers % stages:
            raise ValueError(
                f"layout {lay.name}: --num-layers {opts.num_layers} is not divisible by "
                f"pp x vpp = {stages}"
            )
        if opts.heads % lay.tp or opts.hidden % opts.heads:
            raise ValueError(
                f"layout {lay.name}: attention heads ({opts.heads}) must divide the hidden size "
                f"({opts.hidden}) and be divisible by tp={lay.tp}"
            )
        if MOE_EXPERTS % lay.ep:
            raise ValueError(f"layout {lay.name}: ep must divide the {MOE_EXPERTS} experts")
        if lay.ep > 1 and lay.tp > 1:
            # Megatron requires sequence parallelism for MoE with TP, which needs Apex/TE.
            raise ValueError(f"layout {lay.name}: ep with tp > 1 needs Transformer Engine")
        if opts.stack and (opts.global_batch_size // lay.dp) % lay.num_microbatches:
            raise ValueError(
                f"layout {lay.name}: --stack cuts each DP rank's "
                f"{opts.global_batch_size // lay.dp} sequences into micro-batches of one size; "
                f"m{lay.num_microbatches} must divide that number"
            )
        if opts.seq_length % (2 * lay.cp):
            raise ValueError(f"layout {lay.name}: --seq-length must be divisible by 2 x cp")


def default_out(opts: AuditOptions) -> str:
    """Where a run writes without ``--out``: ``audit-out`` for the plugin's own audit; a folder
    of its own inside it for a stack audit (``audit-out/<stack>``, ``audit-out/<stack>-<terms>``
    for ``--terms`` other than ``all``) and for ``--mask-in-loss`` (``audit-out/mask-in-loss``),
    so that no kind of audit overwrites another's ``audit.json``."""
    if opts.stack is not None:
        name = opts.stack if opts.terms == "all" else f"{opts.stack}-{opts.terms}"
        return f"{OUT}/{name}"
    return f"{OUT}/mask-in-loss" if opts.mask_in_loss else OUT


def options_json(opts: AuditOptions) -> dict[str, Any]:
    out = asdict(opts)
    out["layouts"] = [lay.name for lay in opts.layouts]
    out["modes"] = list(opts.modes)
    return out


# ------------------------------------------------------------------------------ command line


def _csv(choices: Sequence[str] | None) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        if not items:
            raise argparse.ArgumentTypeError("give at least one name")
        bad = [s for s in items if choices is not None and s not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items

    return parse


def _layouts(text: str) -> tuple[AuditLayout, ...]:
    try:
        return tuple(parse_layout(name) for name in _csv(None)(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_audit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the audit's flags to ``parser`` (the ``audit`` subcommand) and return it."""
    _add_matrix_args(parser)
    _add_model_args(parser)
    _add_run_args(parser)
    return parser


def _add_matrix_args(parser: argparse.ArgumentParser) -> None:
    """What to check and where the files go."""
    parser.add_argument(
        "--modes",
        type=_csv(None),
        help=f"comma-separated reduction modes to check (default: all: {','.join(MODES)}); "
        "`off` is stock Megatron, the baseline, allowed to miss; prompt_mean is group_mean "
        "(the data's prompt groups straddle ranks and micro-batches). With --stack, the "
        "framework's own loss modes (default: all that have a counterpart here)",
    )
    parser.add_argument(
        "--layouts",
        type=_layouts,
        # None: the audit's defaults, or with --stack that stack's own (its LAYOUTS).
        help=f"comma-separated layouts (default: {','.join(DEFAULT_LAYOUTS)}; with --stack, "
        "the layouts the stack was measured on). A layout joins "
        "tp<N>, pp<N>, vpp<N>, cp<N>, ep<N>, dp<N> and m<N> (micro-batches per DP rank, "
        "required) "
        f"with '-', at most 8 ranks; e.g. {', '.join(LAYOUT_PRESETS)}. CP layouts replace "
        "attention by identity (no Transformer Engine on CPU)",
    )
    parser.add_argument(
        "--mask-in-loss",
        action="store_true",
        help="the objective decides inside the loss which tokens count (PPO with an "
        "importance-ratio band per token against fixed old log-probs and off-policy sequence "
        "masking, from the current log-probs); every mode runs with --lossfix-mask-in-loss, "
        "as is and through the counting pass, against a one-rank reference that applies the "
        "same mask, and must pass. Rows '<mode> (counted before)' zero the dropped tokens but "
        "keep counting them (allowed to miss, by about the dropped fraction)",
    )
    parser.add_argument(
        "--stack",
        choices=sorted(STACKS),
        help="audit an RL framework's own Megatron loss path instead of the plugin alone: rows "
        "<stack> (as released, allowed to miss) and <stack>+lossfix (through the adapter); the "
        "framework must be installed, as the install line of its page (docs/<stack>.md) "
        "does. Default modes and layouts are the stack's own",
    )
    parser.add_argument(
        "--terms",
        choices=TERMS,
        default="all",
        help="with --stack skyrl: which loss terms to audit: all (policy, KL, entropy; "
        "default), kl_entropy (zero advantages: KL and entropy alone) or sft (the framework's "
        "SFT cross-entropy path, token_mean)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"directory for audit.json and audit.png (created; default: ./{OUT}, with "
        f"--stack ./{OUT}/<stack> (./{OUT}/<stack>-<terms> with --terms other than all), with "
        f"--mask-in-loss ./{OUT}/mask-in-loss)",
    )


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model and the data of the step."""
    parser.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default="tiny",
        help="GPT size: "
        + "; ".join(
            f"{k}: {v['num_layers']} layers, hidden {v['hidden']}, {v['heads']} heads"
            for k, v in MODEL_SIZES.items()
        )
        + " (default: tiny)",
    )
    parser.add_argument("--num-layers", type=int, help="override the model size's layer count")
    parser.add_argument("--hidden-size", type=int, help="override the model size's hidden size")
    parser.add_argument(
        "--num-attention-heads", type=int, help="override the model size's attention heads"
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=24,
        help="sequences in the step (default 24; variable lengths, some with no loss tokens)",
    )
    parser.add_argument(
        "--seq-length", type=int, default=16, help="tokens per sequence (default 16)"
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="seed of data and weights (default 1234)"
    )
    parser.add_argument(
        "--per-token-loss",
        action="store_true",
        help="run Megatron's calculate_per_token_loss=True path instead of the default one",
    )


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    """The verdict's tolerance and how the run behaves."""
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"largest relative L2 gradient (and loss) error a plugin mode may have "
        f"(default {TOLERANCE:.0e}, fp32)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a rank may wait in a collective before the run is declared hung "
        "(default 300)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    parser.add_argument(
        "--no-plot",
        action="store_true",
        help="skip audit.png (also skipped, with a note, when matplotlib is not installed)",
    )


def options_from_args(args: argparse.Namespace) -> AuditOptions:
    """The run's options from parsed flags (model size first, explicit sizes override it)."""
    size = MODEL_SIZES[args.model_size]
    modes = args.modes
    if modes is None:  # the plugin's modes once each: an alias only when asked for by name
        modes = _allowed_modes(args.stack, args.terms)
        modes = [m for m in modes if args.stack is not None or m not in ALIASES]
    layouts = args.layouts
    if layouts is None:
        names = DEFAULT_LAYOUTS if args.stack is None else load_stack(args.stack).LAYOUTS
        layouts = tuple(parse_layout(n) for n in names)
    return AuditOptions(
        modes=tuple(modes),
        layouts=tuple(layouts),
        num_layers=args.num_layers or size["num_layers"],
        hidden=args.hidden_size or size["hidden"],
        heads=args.num_attention_heads or size["heads"],
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        seed=args.seed,
        per_token_loss=args.per_token_loss,
        tolerance=args.tolerance,
        timeout_s=args.timeout,
        stack=args.stack,
        terms=args.terms,
        mask_in_loss=args.mask_in_loss,
    )
