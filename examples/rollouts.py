"""Rollouts as training data for ``grpo_gpt.py``: the ``--rollouts`` JSONL file, checked line by
line, and rollouts as next-token batches.

A record is ``{"prompt_ids": [int], "response_ids": [int], "advantage": float}``, optionally with
``"old_logprobs"`` and ``"ref_logprobs"`` (one float per response token). Iteration i trains on
records ``i*B .. i*B+B-1`` (B = ``--global-batch-size``, wrapping around the file), the same
sequences in the same order under every layout. Consecutive records with the same
``prompt_ids`` form a prompt group (``--loss-reduction group_mean``).
"""

from __future__ import annotations

import math

import torch
from byte_data import iter_jsonl

__all__ = ["encode_rollouts", "load_rollouts", "prompt_groups", "replay_batch", "with_group_range"]


def _ids(record: dict, key: str, where: str, vocab: int) -> list[int]:
    value = record.get(key)
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"{where}: {key!r} must be a list of token ids")
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"{where}: {key!r} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        )
    return value


def _logprobs(record: dict, key: str, where: str, length: int) -> list[float] | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in value
    ):
        raise ValueError(f"{where}: {key!r} must be a list of numbers")
    if len(value) != length:
        raise ValueError(
            f"{where}: {key!r} has {len(value)} entries but there are {length} response tokens "
            "(one log-prob per response token)"
        )
    return [float(x) for x in value]


def load_rollouts(path: str, *, vocab: int, seq_length: int, need_ref: bool) -> list[dict]:
    """The rollouts of a JSONL file; ``ValueError`` naming the line for anything malformed, a
    sequence longer than ``seq_length + 1`` tokens, or (``need_ref``) no ``ref_logprobs``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    records = []
    for record, where in iter_jsonl(text, path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {record!r:.100}")
        prompt = _ids(record, "prompt_ids", where, vocab)
        response = _ids(record, "response_ids", where, vocab)
        if not prompt:
            raise ValueError(
                f"{where}: 'prompt_ids' is empty (the first response token is predicted from "
                "the prompt's last token)"
            )
        advantage = record.get("advantage")
        if not isinstance(advantage, (int, float)) or isinstance(advantage, bool):
            raise ValueError(f"{where}: 'advantage' must be a finite number, got {advantage!r}")
        if not math.isfinite(advantage):
            raise ValueError(f"{where}: 'advantage' must be a finite number, got {advantage!r}")
        # The model reads prompt + response minus the last token; cutting would drop loss tokens.
        if len(prompt) + len(response) - 1 > seq_length:
            raise ValueError(
                f"{where}: prompt + response is {len(prompt) + len(response)} tokens, longer "
                f"than --seq-length {seq_length} + 1"
            )
        ref = _logprobs(record, "ref_logprobs", where, len(response))
        if need_ref and ref is None:
            raise ValueError(
                f'{where}: --kl-coef > 0 needs "ref_logprobs" on every rollout (or set --kl-coef 0)'
            )
        old = _logprobs(record, "old_logprobs", where, len(response))
        records.append(
            dict(prompt_ids=prompt, response_ids=response, advantage=float(advantage),
                 old_logprobs=old, ref_logprobs=ref)
        )  # fmt: skip
    if not records:
        raise ValueError(f"{path}: no rollouts (the file is empty)")
    return records


def encode_rollouts(
    records: list[dict], seq_length: int, pad_id: int, *, with_ref: bool
) -> dict[str, torch.Tensor]:
    """Rollouts as one batch of ``[len(records), seq_length]`` tensors.

    Row = prompt + response, cut by one (``tokens``) and shifted by one (``labels``), so response
    token k is predicted at position ``len(prompt) - 1 + k``: there the loss mask is 1 and the
    advantage and the record's log-probs sit. ``has_old_logprobs`` is 1 where a recorded
    ``old_logprobs`` value is (elsewhere the ratio is 1): a flag, not NaN, because
    ``--lossfix-check-finite`` refuses non-finite inputs.
    """
    n = len(records)
    tokens = torch.full((n, seq_length), pad_id, dtype=torch.int64)
    labels = torch.full_like(tokens, pad_id)
    mask, advantages, old, has_old, ref = (torch.zeros(n, seq_length) for _ in range(5))
    for i, rec in enumerate(records):
        ids = rec["prompt_ids"] + rec["response_ids"]
        tokens[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        labels[i, : len(ids) - 1] = torch.tensor(ids[1:])
        span = slice(len(rec["prompt_ids"]) - 1, len(ids) - 1)
        mask[i, span] = 1.0
        advantages[i, span] = rec["advantage"]
        if rec.get("old_logprobs") is not None:
            old[i, span] = torch.tensor(rec["old_logprobs"])
            has_old[i, span] = 1.0
        if with_ref and rec.get("ref_logprobs") is not None:
            ref[i, span] = torch.tensor(rec["ref_logprobs"])
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(seq_length).expand(n, -1).contiguous(),
        "loss_mask": mask,
        "advantages": advantages,
        "old_logprobs": old,
        "has_old_logprobs": has_old,
    }
    if with_ref:
        batch["ref_logprobs"] = ref
    return batch


def replay_batch(records: list[dict], iteration: int, global_batch_size: int) -> list[dict]:
    """The records of ``iteration`` (0-based): the next ``global_batch_size`` in file order."""
    start = iteration * global_batch_size
    return [records[(start + k) % len(records)] for k in range(global_batch_size)]


def prompt_groups(records: list[dict]) -> tuple[torch.Tensor, int]:
    """Each record's prompt group in a global batch, for ``--loss-reduction group_mean``: runs
    of consecutive records with the same ``prompt_ids`` (a prompt's responses, as GRPO writes
    them), numbered from 0; and their number."""
    ids, group = [], -1
    for k, rec in enumerate(records):
        if k == 0 or rec["prompt_ids"] != records[k - 1]["prompt_ids"]:
            group += 1
        ids.append(group)
    return torch.tensor(ids), group + 1


def with_group_range(mbs: list[dict], num_groups: int) -> list[dict]:
    """The micro-batches with the step's group count, which the plugin's group modes read
    beside each micro-batch's ``group_ids``."""
    return [{**mb, "num_groups": num_groups} for mb in mbs]
