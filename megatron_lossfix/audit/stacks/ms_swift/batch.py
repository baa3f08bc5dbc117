"""``--stack ms-swift``: the step's data and ms-swift's settings, as its trainers' collators
hand micro-batches to ``train_step``.

The step holds ``case.global_batch_size`` units: SFT sequences, DPO pairs (a chosen and a
rejected response to one prompt) or KTO examples (one response, desirable or not, and its KL
completion: the prompt with another example's response). Prompts are 2-5 tokens, responses
1-8, a sequence 16 positions at most. Labels are ms-swift's: the token ids of the response,
-100 elsewhere, not yet shifted (ms-swift's ``get_batch_on_this_pp_rank`` rolls them).

Micro-batches: each data-parallel rank takes its contiguous slice of the units. Without
packing every micro-batch holds the same number of units, rows padded to 16 positions (a DPO
micro-batch is its chosen rows, then its rejected rows, as ms-swift's collator lays them out).
With packing (``padding_free``) a micro-batch is one row of whole sequences (each padded to a
multiple of 4, so that context parallelism can split it in 2 x CP chunks), and micro-batches
hold different numbers of units (the first one unit): as ms-swift's ``--packing`` bins them by
length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_lossfix.audit.matrix import MatrixLayout
from megatron_lossfix.audit.oracle import OracleCase
from megatron_lossfix.audit.stacks.modes import StackMode

__all__ = [
    "KINDS",
    "MODES",
    "SETTINGS",
    "Setting",
    "micro_batches",
    "stack_case",
    "step_units",
    "uneven_sizes",
]

#: A sequence's longest length (prompt and response) and a packed sequence's padding multiple.
SEQ_LEN, PACK_MULTIPLE = 16, 4


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One trainer setting the stack runs."""

    kind: str
    """``sft``, ``dpo``, ``kto`` or ``rm``: the trainer (``MegatronTrainer``,
    ``MegatronDPOTrainer``, ``MegatronKTOTrainer``, ``MegatronRewardTrainer``)."""
    packed: bool = False
    """ms-swift's ``--packing`` (``padding_free``): uneven micro-batches of whole sequences."""
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """ms-swift's arguments beyond the kind's defaults (``loss_type``, ``rpo_alpha``, ...)."""


def _both(name: str, kind: str, **args: Any) -> dict[str, Setting]:
    return {
        name: Setting(kind=kind, args=args),
        f"{name}-packed": Setting(kind=kind, packed=True, args=args),
    }


#: ms-swift's settings the stack audits, each unpacked and packed.
SETTINGS: dict[str, Setting] = {
    **_both("sft", "sft"),
    **_both("dpo", "dpo", loss_type="sigmoid"),
    **_both("dpo-hinge", "dpo", loss_type="hinge"),
    **_both("dpo-ipo", "dpo", loss_type="ipo"),
    **_both("dpo-rpo", "dpo", loss_type="sigmoid", rpo_alpha=1.0),
    **_both("kto", "kto", calculate_KL=False),
    **_both("kto-kl", "kto", calculate_KL=True),
    **_both("rm", "rm"),
    **_both("rm-center", "rm", center_rewards_coefficient=0.01),
}
KINDS: tuple[str, ...] = ("sft", "dpo", "kto", "rm")
#: ms-swift's normalizations and the plugin's modes: a token mean (SFT) and a unit mean (a DPO
#: pair, a KTO example).
MODES: dict[str, StackMode] = {
    "token_mean": StackMode(plugin_mode="token_mean"),
    "pair_mean": StackMode(plugin_mode="pair_mean"),
}


def stack_case(opts: Any, layout: MatrixLayout) -> OracleCase:
    """The audit's case for ``layout`` with the model ms-swift's micro-batches run on here: layers
    that mix no tokens and no position embedding (packed sequences and context-parallel chunks
    are then exact on Megatron's local attention), variable sequence lengths (packed
    micro-batches differ in length)."""
    case = opts.case(layout)
    model = dict(case.model_kwargs)
    model.update(no_attention=True, position_embedding_type="none", variable_seq_lengths=True)
    model.setdefault("moe_token_dispatcher_type", "alltoall")
    return dataclasses.replace(case, model_kwargs=model)


def step_units(case: OracleCase, vocab_size: int, kind: str) -> list[dict[str, Any]]:
    """The step's units in order: ``{"seqs": [(ids, labels), ...], ...}`` (one sequence for SFT,
    chosen and rejected for DPO, the completion and its KL completion and ``label`` for KTO)."""
    gen = torch.Generator().manual_seed(case.seed + {"sft": 0, "dpo": 1, "kto": 2, "rm": 3}[kind])
    n = case.global_batch_size

    def sequence(prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = int(torch.randint(1, SEQ_LEN - len(prompt) + 1, (1,), generator=gen))
        r = min(r, 8)
        response = torch.randint(0, vocab_size, (r,), generator=gen)
        ids = torch.cat([prompt, response])
        labels = torch.cat([torch.full_like(prompt, -100), response])
        return ids, labels

    if kind == "rm":  # whole multiples of the packing's padding: the last token is a real one
        return [{"seqs": [_rm_sequence(gen, vocab_size), _rm_sequence(gen, vocab_size)]}
                for _ in range(n)]  # fmt: skip
    units = []
    for _ in range(n):
        p = int(torch.randint(2, 6, (1,), generator=gen))
        prompt = torch.randint(0, vocab_size, (p,), generator=gen)
        if kind == "sft":
            units.append({"seqs": [sequence(prompt)]})
        elif kind == "dpo":
            units.append({"seqs": [sequence(prompt), sequence(prompt)], "prompt": p})
        else:
            desirable = bool(torch.rand((), generator=gen) < 0.6)
            units.append({"seqs": [sequence(prompt)], "prompt": p, "label": desirable})
    if kind == "kto":  # KL completions: the prompt with the next example's response
        for i, unit in enumerate(units):
            other_ids, other_labels = units[(i + 1) % n]["seqs"][0]
            o = units[(i + 1) % n]["prompt"]
            ids, _ = unit["seqs"][0]
            p = unit["prompt"]
            kl_ids = torch.cat([ids[:p], other_ids[o:]])[:SEQ_LEN]
            kl_labels = torch.cat([torch.full((p,), -100), other_labels[o:]])[:SEQ_LEN]
            unit["kl"] = (kl_ids, kl_labels)
    return units


def _rm_sequence(gen: torch.Generator, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reward model's sequence (no labels: the reward is read at its last token), of
    :data:`PACK_MULTIPLE` to :data:`SEQ_LEN` tokens in whole multiples of the packing's padding."""
    n = PACK_MULTIPLE * int(torch.randint(1, SEQ_LEN // PACK_MULTIPLE + 1, (1,), generator=gen))
    ids = torch.randint(0, vocab_size, (n,), generator=gen)
    return ids, torch.full_like(ids, -100)


def uneven_sizes(n: int, m: int) -> list[int]:
    """``n`` units in ``m`` micro-batches, the first holding one (packed micro-batches differ)."""
    if m > n:
        raise ValueError(f"{n} units do not fill {m} micro-batches")
    sizes = [n // m + (1 if k < n % m else 0) for k in range(m)]
    if m > 1:
        sizes[-1] += sizes[0] - 1
        sizes[0] = 1
    return sizes


def _rows(seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Unpacked rows, padded to :data:`SEQ_LEN` (ids 0, labels -100)."""
    b = len(seqs)
    ids = torch.zeros(b, SEQ_LEN, dtype=torch.long)
    labels = torch.full((b, SEQ_LEN), -100, dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)], labels[i, : len(y)] = x, y
    position_ids = torch.arange(SEQ_LEN).expand(b, SEQ_LEN).clone()
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


def _packed(seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """One packed row of whole sequences (each padded to a multiple of :data:`PACK_MULTIPLE`),
    its position ids restarting at 0 for each (how ms-swift finds the sequences)."""
    ids, labels, pos = [], [], []
    for x, y in seqs:
        n = -(-len(x) // PACK_MULTIPLE) * PACK_MULTIPLE
        ids.append(torch.cat([x, torch.zeros(n - len(x), dtype=torch.long)]))
        labels.append(torch.cat([y, torch.full((n - len(y),), -100, dtype=torch.long)]))
        pos.append(torch.arange(n))
    return {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
            "position_ids": torch.cat(pos)[None], "seq_lens": [len(p) for p in pos]}  # fmt: skip


def _micro_batch(units: list[dict[str, Any]], kind: str, packed: bool) -> dict[str, Any]:
    lay = _packed if packed else _rows
    if kind == "sft":
        return lay([u["seqs"][0] for u in units])
    if kind in ("dpo", "rm"):
        out = lay([u["seqs"][0] for u in units] + [u["seqs"][1] for u in units])
        if kind == "rm":  # a reward model's collator: no labels; rows carry their attention mask
            lengths = [len(u["seqs"][0][0]) for u in units] + [len(u["seqs"][1][0]) for u in units]
            del out["labels"]
            if not packed:
                out["attention_mask"] = torch.arange(SEQ_LEN)[None] < torch.tensor(lengths)[:, None]
        return out
    out: dict[str, Any] = {}
    for prefix, seqs in (("completion_", [u["seqs"][0] for u in units]),
                         ("KL_completion_", [u["kl"] for u in units])):  # fmt: skip
        out.update({prefix + k: v for k, v in lay(seqs).items()})
    out["label"] = [u["label"] for u in units]
    return out


def micro_batches(
    units: list[dict[str, Any]], kind: str, packed: bool, dp_rank: int, dp_size: int, m: int
) -> list[dict[str, Any]]:
    """DP rank ``dp_rank``'s ``m`` micro-batches of the step, as ms-swift's collator makes them."""
    if len(units) % dp_size:
        raise ValueError(f"{len(units)} units do not split over DP={dp_size}")
    per = len(units) // dp_size
    mine = units[dp_rank * per : (dp_rank + 1) * per]
    if packed:
        sizes = uneven_sizes(per, m)
    else:
        if per % m:
            raise ValueError(f"{per} units per DP rank do not split into {m} micro-batches")
        sizes = [per // m] * m
    out, start = [], 0
    for size in sizes:
        out.append(_micro_batch(mine[start : start + size], kind, packed))
        start += size
    return out
