"""Which rows each optimizer step of a collection trains, in Megatron-LM's ``train_rl.py``.

A collection (one ``prepare_data_for_update`` call) can hold more rollouts than one step trains:
``--grpo-prompts-per-step`` x ``--grpo-group-size`` rollouts, ``--global-batch-size`` of them
per step, so ``S = prompts x group size // global batch size`` optimizer steps (four in
Megatron-LM's llama launch). Stock, ``prepare_data_for_update`` splits the rows into one
contiguous slice per DP rank and step ``i`` reads the ``i``-th part of every rank's slice; with
sequence packing the rows of the whole collection are packed into bins (longest first) that are
split the same way. Which rows step ``i`` trains then depends on the DP size.

With ``--loss-reduction`` the patched ``prepare_data_for_update`` lays the rows out so that
step ``i`` trains the rows of the collection's rollouts ``[i N / S, (i + 1) N / S)`` (``N``
rollouts; ``[i B, (i + 1) B)`` for ``B`` = ``--global-batch-size`` when Megatron-LM returns all
it asked for), whatever the layout: each step's rows are padded with Megatron-LM's own padding
rows to the same count ``R`` (a multiple of DP x micro-batch size), and rank ``r``'s slice
holds the ``r``-th part of every step in step order (:func:`plan_rows`). With packing, each
step's rows are packed into bins of their own (Megatron-LM's packer on that step's rows),
padded with empty bins to the same count and laid out the same way (:class:`StepPacker`).
Padding rows and empty bins have no loss token: the plugin weighs them 0.

Without ``--loss-reduction`` nothing changes (:func:`order_rows` returns its input).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from typing import Any

import torch

from megatron_lossfix.runtime.modes import mode_of

__all__ = [
    "StepRows",
    "current",
    "install",
    "order_rows",
    "pack_steps",
    "plan_rows",
    "reconfigure_bins",
    "reset",
    "step_of_rollouts",
    "step_rows",
    "steps_per_collection",
]


@dataclasses.dataclass(slots=True)
class StepRows:
    """The row layout of one collection under ``--loss-reduction``."""

    steps: int
    """Optimizer steps per collection (S)."""
    rows_per_step: int
    """Rows every step reads over the DP ranks (R, padding rows included)."""
    data_parallel_size: int
    order: list[int]
    """The original row at each position of the laid-out rows (``-1``: a padding row): rank r
    holds positions ``[r S R / DP, (r + 1) S R / DP)``, step by step."""
    row_rollouts: list[int]
    """The rollout (index in the collection) of each original row."""
    packing_algo: str = "fifo"
    bins_per_step: int = 0
    """With sequence packing: bins every step reads over the DP ranks (empty ones included)."""

    @property
    def chunk(self) -> int:
        """Rows of one step on one rank."""
        return self.rows_per_step // self.data_parallel_size

    def step_positions(self, step: int) -> list[int]:
        """The laid-out positions of ``step``'s rows, rank by rank."""
        per_rank = self.steps * self.chunk
        return [
            r * per_rank + step * self.chunk + j
            for r in range(self.data_parallel_size)
            for j in range(self.chunk)
        ]


def step_of_rollouts(num_rollouts: int, steps: int) -> list[int]:
    """The step of each of ``num_rollouts`` rollouts: step i trains ``[i N / S, (i+1) N / S)``."""
    bounds = [(i * num_rollouts) // steps for i in range(steps + 1)]
    out = []
    for i in range(steps):
        out.extend([i] * (bounds[i + 1] - bounds[i]))
    return out


def plan_rows(
    row_rollouts: Sequence[int],
    num_rollouts: int,
    *,
    steps: int,
    data_parallel_size: int,
    micro_batch_size: int,
) -> StepRows:
    """The layout of a collection's rows (``row_rollouts``: each row's rollout, in order)."""
    steps = max(int(steps), 1)
    size = max(int(data_parallel_size), 1)
    of_rollout = step_of_rollouts(num_rollouts, steps)
    per_step: list[list[int]] = [[] for _ in range(steps)]
    for row, rollout in enumerate(row_rollouts):
        per_step[of_rollout[rollout]].append(row)
    unit = size * max(int(micro_batch_size), 1)
    rows = max(max(len(p) for p in per_step), 1)
    rows += -rows % unit
    chunk = rows // size
    order: list[int] = []
    for r in range(size):
        for part in per_step:
            padded = part + [-1] * (rows - len(part))
            order.extend(padded[r * chunk : (r + 1) * chunk])
    return StepRows(steps=steps, rows_per_step=rows, data_parallel_size=size, order=order,
                    row_rollouts=list(row_rollouts))  # fmt: skip


_CURRENT: list[StepRows | None] = [None]


def current() -> StepRows | None:
    """The layout of the collection ``prepare_data_for_update`` is preparing (or last
    prepared) under ``--loss-reduction``; None stock."""
    return _CURRENT[0]


def reset() -> None:
    """Forget the last collection's layout (before ``prepare_data_for_update`` runs: a release
    whose patch does not call :func:`order_rows` keeps none)."""
    _CURRENT[0] = None


def steps_per_collection(args: Any) -> int:
    """S: ``--grpo-prompts-per-step`` x ``--grpo-group-size`` // ``--global-batch-size``."""
    shape = [getattr(args, k, None) for k in ("grpo_prompts_per_step", "grpo_group_size",
                                              "global_batch_size")]  # fmt: skip
    if None in shape:
        return 1
    return max(int(shape[0]) * int(shape[1]) // int(shape[2]), 1)


def order_rows(
    rollouts: Sequence[Any], rows: list, advantages: torch.Tensor, pad: Any
) -> tuple[list, torch.Tensor]:
    """What the patched ``prepare_data_for_update`` calls on its training rows before it pads
    and splits them: under ``--loss-reduction``, the rows laid out by :func:`plan_rows` (padding
    rows ``pad``, advantage 0) and their advantages; stock, ``(rows, advantages)`` unchanged.

    ``rollouts``: the collection's rollouts, flattened in order; ``rows``: one entry per row,
    ``(rollout, turn)`` or (main, a prefix chain) the rollout itself."""
    from megatron.core import mpu
    from megatron.training import get_args

    _CURRENT[0] = None
    args = get_args()
    mode = getattr(args, "loss_reduction", None)
    if mode is None or mode_of(mode).stock:
        return rows, advantages
    index = {id(r): k for k, r in enumerate(rollouts)}
    row_rollouts = [index[id(row[0] if isinstance(row, tuple) else row)] for row in rows]
    plan = plan_rows(
        row_rollouts,
        len(rollouts),
        steps=steps_per_collection(args),
        data_parallel_size=mpu.get_data_parallel_world_size(),
        micro_batch_size=args.micro_batch_size,
    )
    plan.packing_algo = getattr(args, "rl_sequence_packing_algo", "fifo") or "fifo"
    _CURRENT[0] = plan
    padded = torch.cat([advantages, advantages.new_zeros(1)])
    where = torch.tensor([len(rows) if o < 0 else o for o in plan.order], device=padded.device)
    return [pad if o < 0 else rows[o] for o in plan.order], padded[where]


def step_rows(default: int) -> int:
    """Rows per step for the micro-batch calculator: R under ``--loss-reduction``, else
    ``default`` (stock: ``ceil(global batch size / sampled x rows)``)."""
    plan = _CURRENT[0]
    return default if plan is None else plan.rows_per_step


# ---------------------------------------------------------------------------- packing
def pack_steps(
    pad_token: int,
    pack: Any,
    empty_bins: Any,
    trajs: torch.Tensor,
    masks: Any,
    plan: StepRows,
) -> tuple:
    """Each step's rows packed alone (``pack``: Megatron-LM's ``pack_sequences``), padded with
    empty bins (``empty_bins``: its ``create_empty_bins``) to the same count, and laid out so
    that Megatron-LM's bin split (``fifo``: contiguous shares, ``round-robin``: every DP-th bin)
    gives rank r the r-th part of every step, in step order. Returns what ``pack`` returns."""
    parts = []
    for step in range(plan.steps):
        positions = plan.step_positions(step)
        where = torch.tensor(positions, device=trajs.device)
        sub = (trajs[where], None if masks is None else masks[where])
        packed_trajs, position_ids, loss_mask, info = pack(*sub)
        parts.append((positions, packed_trajs, position_ids, loss_mask, info))
    size = plan.data_parallel_size
    bins = max(max(p[1].shape[0] for p in parts), 1)
    bins += -bins % size
    plan.bins_per_step = bins
    tokenizer = types.SimpleNamespace(pad=pad_token)
    total = len(plan.order)
    seq_lengths: list[int] = [0] * total
    seq_to_bin: list[int | None] = [None] * total
    steps = []  # per step: [(traj, pos ids, loss mask, global rows, starts)] of its bins
    for positions, packed_trajs, position_ids, loss_mask, info in parts:
        for j, length in enumerate(info.seq_lengths):
            seq_lengths[positions[j]] = int(length)
        made = [
            (packed_trajs[b], position_ids[b], loss_mask[b],
             [positions[j] for j in info.bin_seq_indices[b]], list(info.seq_starts[b]))
            for b in range(packed_trajs.shape[0])
        ]  # fmt: skip
        if len(made) < bins:
            empty = empty_bins(bins - len(made), packed_trajs.shape[1], packed_trajs,
                               position_ids, loss_mask, tokenizer)  # fmt: skip
            for k, entry in enumerate(empty[3]):
                made.append((empty[0][k], empty[1][k], empty[2][k], list(entry["bin_seq_indices"]),
                             list(entry["seq_starts"])))  # fmt: skip
        steps.append(made)
    share = bins // size
    per_rank = [[b for made in steps for b in made[r * share : (r + 1) * share]]
                for r in range(size)]  # fmt: skip
    if plan.packing_algo == "round-robin":  # rank r gets bins r, r + DP, ...
        laid = [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(size)]
    else:  # fifo: contiguous, equal shares
        laid = [b for mine in per_rank for b in mine]
    info = parts[0][4]
    for new, (_, _, _, rows, _) in enumerate(laid):
        for row in rows:
            seq_to_bin[row] = new
    merged = dataclasses.replace(
        info,
        bin_seq_indices=[b[3] for b in laid],
        seq_starts={k: b[4] for k, b in enumerate(laid)},
        seq_lengths=seq_lengths,
        seq_to_bin_idx=seq_to_bin,
    )
    stack = lambda k: torch.stack([b[k] for b in laid])  # noqa: E731
    return stack(0), stack(1), stack(2), merged


def install(sequence_packing_utils: Any) -> None:
    """Let Megatron-LM's ``SequencePacker`` pack each step's rows alone under
    ``--loss-reduction`` (:func:`order_rows` laid them out); stock packing otherwise."""
    base = sequence_packing_utils.SequencePacker
    if getattr(base, "_lossfix_steps", False):
        return
    empty_bins = sequence_packing_utils.create_empty_bins

    class StepPacker(base):  # type: ignore[misc, valid-type]
        """Megatron-LM's packer, one step of the collection at a time under the plugin."""

        _lossfix_steps = True

        def pack_sequences(self, trajs: torch.Tensor, generation_masks: Any = None) -> tuple:
            plan = _CURRENT[0]
            pack = super().pack_sequences
            if plan is None or trajs.shape[0] != len(plan.order):
                return pack(trajs, generation_masks)
            return pack_steps(self.pad_token, pack, empty_bins, trajs, generation_masks, plan)

    StepPacker.__name__ = StepPacker.__qualname__ = base.__name__
    StepPacker.__module__ = base.__module__
    sequence_packing_utils.SequencePacker = StepPacker


def reconfigure_bins(plan: StepRows, micro_batch_size: int) -> None:
    """Set the step's micro-batch count to the bins of one step (Megatron-LM derives it from a
    float ratio of the rank's bins, which may round up by one)."""
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
    from megatron.training import get_args

    args = get_args()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    reconfigure_num_microbatches_calculator(
        rank=rank,
        global_batch_size=plan.bins_per_step,
        micro_batch_size=micro_batch_size,
        data_parallel_size=mpu.get_data_parallel_world_size(),
        decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
    )
