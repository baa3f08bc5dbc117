"""The gradient oracle's inputs: a case (model, data, step settings), its deterministic global
batch of variable-length sequences, and how a layout cuts that batch into micro-batches.

Everything here is layout-independent, so a layout run and its one-rank reference see the same
data; :mod:`megatron_lossfix.audit.oracle` runs both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "COUNTED_BEFORE",
    "COUNTING_PASS",
    "PROMPT_GROUP_SIZES",
    "OracleCase",
    "id_ranges",
    "microbatch_ids",
    "make_global_batch",
    "microbatch_plan",
    "prompt_groups",
    "row_settings",
]

#: Row suffixes of a mask decided in the loss (docs/design.md §10): the mode through a counting
#: pass, and the mode with the mask zeroed but still counted (what counting before the forward
#: gives), compared with the same reference.
COUNTING_PASS = " (counting pass)"
COUNTED_BEFORE = " (counted before)"


def row_settings(row: str) -> tuple[str, dict[str, Any]]:
    """A matrix row's mode and the ``LossFixConfig`` fields its suffix sets."""
    if row.endswith(COUNTING_PASS):
        return row.removesuffix(COUNTING_PASS), {"counting_pass": True}
    if row.endswith(COUNTED_BEFORE):
        return row.removesuffix(COUNTED_BEFORE), {"mask_in_loss": False}
    return row, {}


#: Responses per prompt in the global batch, consecutive and repeated: under the matrix's
#: layouts groups straddle DP ranks and micro-batches (24 sequences: rows 0-4, 5-8, 9-14, 15-17,
#: 18-23; DP2 splits the third group, DP3 the second and the fourth).
PROMPT_GROUP_SIZES = (5, 4, 6, 3, 6)


@dataclass(kw_only=True, slots=True)
class OracleCase:
    """One data set and model, shared by a layout run and its reference."""

    global_batch_size: int = 24
    """Sequences per optimizer step."""
    seq_length: int = 16
    """Tokens per sequence (divisible by 2 x CP for load-balanced CP sharding)."""
    seed: int = 1234
    """Seed of the data and of the layout-independent weights."""
    norm_constant: float = 16.0
    """C of ``seq_mean_token_sum_norm``."""
    per_token: bool = False
    """Megatron's ``calculate_per_token_loss``."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra :class:`~megatron_lossfix.audit.tiny_gpt.TinyGPT` fields (experts,
    no_attention, ...) or TransformerConfig fields."""
    schedule_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``LossFixConfig`` fields."""
    microbatch_counts: Sequence[int] | None = None
    """Per-DP-rank micro-batch counts (uneven); None: the same count on every rank."""
    zero_sequences: Sequence[int] = ()
    """Global indices of sequences whose loss mask is zeroed (empty micro-batches or ranks)."""
    packed: bool = False
    """Feed each micro-batch as one packed ``[1, b*s]`` row with ``cu_seqlens`` (THD);
    needs ``no_attention`` so that packing mixes nothing across sequences."""
    optimizer: str | None = None
    """Also take one Megatron optimizer step ("adam") and return each weight's update."""
    clip_grad: float = 0.0
    """Gradient clipping norm of that step (0: none)."""
    lr: float = 0.1
    """Learning rate of that step."""
    trajectory_rows: int = 0
    """Rows per trajectory (consecutive): the batch carries ``trajectory_ids``, over which the
    sequence modes weigh (a trajectory split into rows counts once); 0: none."""
    objective: str = "sft"
    """``sft`` (per-token cross entropy) or the full RL objective with ``ppo`` or ``gspo``
    policy loss plus a k3 KL penalty and an entropy bonus."""
    rl_kwargs: dict[str, Any] = field(
        default_factory=lambda: {"kl_coef": 0.1, "entropy_coef": 0.01, "dual_clip_c": 1.5}
    )
    """Extra ``rl_objective`` arguments of the RL objectives."""
    sft_keep_below: float | None = None
    """With ``sft``: the loss keeps only tokens whose cross entropy is below this (a mask
    decided in the loss, ``weighted_loss(keep=)``)."""
    adam_eps: float = 1e-8
    """Adam's epsilon; a huge one makes the first Adam step linear in the (clipped) gradient,
    like SGD, which Megatron's optimizer factory refuses."""

    @property
    def masks_in_loss(self) -> bool:
        """Whether the loss decides a mask from the forward pass."""
        if self.objective == "sft":
            return self.sft_keep_below is not None
        return self.rl_objective().masks

    def rl_objective(self) -> Any:
        """The RL objective of an ``objective`` other than ``sft``."""
        from megatron_lossfix.rl.objective import RLObjective

        return RLObjective(policy_loss=self.objective, **self.rl_kwargs)

    def config_kwargs(self, row: str) -> dict[str, Any]:
        """``LossFixConfig`` arguments of a matrix row (:func:`row_settings`)."""
        mode, overrides = row_settings(row)
        kwargs = {**self.schedule_kwargs, **overrides, "reduction": mode}
        if mode == "off":  # stock Megatron: nothing of the plugin's applies
            kwargs.pop("mask_in_loss", None)
            kwargs.pop("counting_pass", None)
        return {**kwargs, "norm_constant": self.norm_for(mode)}

    def norm_for(self, mode: str) -> float | None:
        """The ``norm_constant`` to pass with ``mode``: C for a mode that takes it
        (``seq_mean_token_sum_norm``), None for every other mode (which refuses a constant it
        would ignore)."""
        from megatron_lossfix.runtime.modes import ALIASES, MODES, mode_of

        known = mode in MODES or mode in ALIASES
        return self.norm_constant if known and mode_of(mode).uses_constant else None


def make_global_batch(case: OracleCase, vocab_size: int) -> dict[str, torch.Tensor]:
    """Deterministic global batch of variable-length sequences: a prompt (no loss), a response
    (loss) and padding; some sequences hold no loss token at all."""
    gen = torch.Generator().manual_seed(case.seed)
    b, s = case.global_batch_size, case.seq_length
    tokens = torch.randint(0, vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, vocab_size, (b, s), generator=gen)
    prompt = torch.randint(0, s // 2, (b,), generator=gen)
    response = torch.randint(0, s, (b,), generator=gen)
    response[::7] = 0  # zero-token sequences
    response[list(case.zero_sequences)] = 0
    pos = torch.arange(s)
    mask = (pos[None, :] >= prompt[:, None]) & (pos[None, :] < (prompt + response)[:, None])
    batch = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": mask.float(),
        "position_ids": pos.expand(b, s).clone(),
        # One id per sequence (consecutive prompt groups, trajectories): the ranges are
        # ``id_ranges(case)``, put into each micro-batch beside its slice.
        "group_ids": prompt_groups(b)[0],
    }
    if case.trajectory_rows:
        batch["trajectory_ids"] = torch.arange(b) // case.trajectory_rows
    if case.objective != "sft":
        # Rollout data around the tiny model's own log-probs (about -log V), so that the PPO
        # ratio lands on both sides of the clip range; advantages are per sequence.
        base = -torch.log(torch.tensor(float(vocab_size)))
        batch["old_logprobs"] = base + 0.3 * torch.randn(b, s, generator=gen)
        batch["ref_logprobs"] = base + 0.3 * torch.randn(b, s, generator=gen)
        batch["advantages"] = torch.randn(b, 1, generator=gen).expand(b, s).clone()
    return batch


def prompt_groups(global_batch_size: int) -> tuple[torch.Tensor, int]:
    """Each sequence's prompt group (``group_ids``, consecutive blocks of
    :data:`PROMPT_GROUP_SIZES`) and the number of groups."""
    ids, group = [], 0
    while len(ids) < global_batch_size:
        ids.extend([group] * PROMPT_GROUP_SIZES[group % len(PROMPT_GROUP_SIZES)])
        group += 1
    return torch.tensor(ids[:global_batch_size]), group


def id_ranges(case: OracleCase) -> dict[str, int]:
    """The id ranges every micro-batch carries beside its slice of the batch's ids."""
    ranges = {"num_groups": prompt_groups(case.global_batch_size)[1]}
    if case.trajectory_rows:
        ranges["num_trajectories"] = -(-case.global_batch_size // case.trajectory_rows)
    return ranges


def microbatch_ids(case: OracleCase, rows: int, device: torch.device | None = None) -> dict:
    """What every micro-batch of ``rows`` sequences carries beside its slice of the batch's
    ids: the step's id ranges (:func:`id_ranges`) and its ``pair_ids``, each sequence a pair of
    its own (``pair_mean``; pairs of several sequences are the stacks' and
    tests/test_pair_mode.py's)."""
    return id_ranges(case) | {"pair_ids": torch.arange(rows, device=device)}


def microbatch_plan(case: OracleCase, dp: int, num_microbatches: int) -> list[list[int]]:
    """Micro-batch sizes of each DP rank: rank ``r`` takes the r-th contiguous slice of the
    global batch, cut into contiguous micro-batches as even as possible."""
    counts = list(case.microbatch_counts or [num_microbatches] * dp)
    if len(counts) != dp:
        raise ValueError(f"microbatch_counts has {len(counts)} entries for DP={dp}")
    if case.global_batch_size % dp:
        raise ValueError(f"global batch {case.global_batch_size} is not divisible by DP={dp}")
    per_rank = case.global_batch_size // dp
    plan = []
    for m in counts:
        bounds = [round(i * per_rank / m) for i in range(m + 1)]
        plan.append([b - a for a, b in zip(bounds, bounds[1:], strict=False)])
    return plan
