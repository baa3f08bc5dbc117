"""Byte-level data for the example scripts: JSONL records, loss masks, layout-free global batches.

A record is ``{"prompt": str, "response": str}`` (loss on the response only) or ``{"text": str}``
(loss on every byte). Without a file, an embedded corpus of real English text
(``data/default_corpus.jsonl``) whose records vary a lot in length: sequences carry very
different numbers of loss tokens, exactly where per-micro-batch averaging goes wrong.

The global batch of an iteration depends only on the records, the iteration, the global batch
size and the seed; a layout only cuts it: DP rank ``r`` takes the ``r``-th contiguous slice, and
micro-batches are contiguous slices of that.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["DEFAULT_SEQ_LENGTH", "ByteTokenizer", "DataStats", "encode_record", "global_batch",
           "iter_jsonl", "load_records", "microbatches"]  # fmt: skip

DEFAULT_SEQ_LENGTH = 128

_DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "default_corpus.jsonl"


class ByteTokenizer:
    """Bytes as tokens: ids 0..255 are UTF-8 bytes, then three special tokens."""

    pad_id = 256
    eos_id = 257
    bos_id = 258
    vocab_size = 259

    def padded_vocab_size(self, multiple: int = 8) -> int:
        """``vocab_size`` rounded up to ``multiple`` (Megatron splits the vocabulary over TP)."""
        if multiple < 1:
            raise ValueError(f"multiple must be a positive integer, got {multiple}")
        return -(-self.vocab_size // multiple) * multiple

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``; no special tokens are added."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        """Text of the byte ids; special and out-of-range ids (padded vocab) are dropped."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _record_kind(record: object) -> str | None:
    """``"pair"``, ``"text"`` or ``None`` when the record is neither form."""
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        return "pair"
    return "text" if isinstance(record, dict) and "text" in record else None


def _check_record(record: object, where: str) -> None:
    kind = _record_kind(record)
    if kind is None:
        raise ValueError(
            f'{where}: expected {{"prompt": str, "response": str}} or {{"text": str}}, '
            f"got {record!r:.200}"
        )
    for key in ("prompt", "response") if kind == "pair" else ("text",):
        if not isinstance(record[key], str):
            raise ValueError(
                f"{where}: field {key!r} must be a string, got {type(record[key]).__name__}"
            )


def load_records(path: str | None) -> list[dict]:
    """Records of a JSONL file (blank lines skipped), or of the embedded corpus for ``None``;
    ``ValueError`` naming the file and line for anything else."""
    name = "examples/data/default_corpus.jsonl" if path is None else str(path)
    text = _decode_utf8((_DEFAULT_CORPUS if path is None else Path(path)).read_bytes(), name)
    records = []
    for record, where in iter_jsonl(text, name):
        _check_record(record, where)
        records.append(record)
    if not records:
        raise ValueError(f"{name}: no records (the file is empty)")
    return records


def _decode_utf8(data: bytes, name: str) -> str:
    """``data`` as UTF-8 text; ``ValueError`` naming the file, line and byte that are not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"{name}, line {line}: not UTF-8 (byte 0x{data[exc.start]:02x} at column {column}); "
            "save the file as UTF-8"
        ) from None


def iter_jsonl(text: str, name: str) -> Iterator[tuple[Any, str]]:
    """``(record, "NAME, line N")`` for each non-blank JSONL line; ``ValueError`` naming the
    line for malformed JSON."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}, line {lineno}"
        try:
            yield json.loads(line), where
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: malformed JSON ({e.msg})") from e


@dataclass
class DataStats:
    """What encoding records at a fixed ``seq_length`` cut or left without loss: a sample that
    loses tokens trains on less than its record says, one without loss tokens on nothing."""

    samples: int = 0
    truncated: int = 0  # longer than seq_length + 1 tokens (bos + bytes + eos): cut at the end
    cut_loss_tokens: int = 0  # loss tokens (response or text bytes, eos) that truncation removed
    no_loss_tokens: int = 0  # the prompt alone fills seq_length
    eos_only: int = 0  # an empty response: the only loss token is the eos
    empty_text: int = 0  # {"text": ""}: the only loss token is the eos

    def add(self, other: DataStats) -> None:
        """Accumulate ``other`` into this one (a run's total from its steps)."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_record(self) -> dict[str, int]:
        """The counts as metrics fields (``samples`` excluded: it is the global batch size)."""
        return dict(truncated_samples=self.truncated, cut_loss_tokens=self.cut_loss_tokens,
                    no_loss_token_samples=self.no_loss_tokens, eos_only_samples=self.eos_only,
                    empty_text_samples=self.empty_text)  # fmt: skip

    def log_items(self) -> list[tuple[str, str]]:
        """Log-line items, ``(label, value)``, for the counts that are not zero."""
        counts = [("truncated", self.truncated, f" ({self.cut_loss_tokens} loss tokens cut)"),
                  ("no loss tokens", self.no_loss_tokens, ""), ("eos only", self.eos_only, ""),
                  ("empty text", self.empty_text, "")]  # fmt: skip
        return [(label, f"{count}{more}") for label, count, more in counts if count]


def encode_record(
    record: dict, tokenizer: ByteTokenizer, seq_length: int, stats: DataStats | None = None
) -> dict[str, Tensor]:
    """One sample for next-token prediction, cut or padded to ``seq_length``: ``tokens`` =
    ``ids[:-1]``, ``labels`` = ``ids[1:]`` of ``[bos] + prompt + response + [eos]``; the loss
    mask is 1 on response (or text) labels and the eos. A long prompt can leave no loss token.
    ``stats``, when given, counts what was cut."""
    if seq_length < 1:
        raise ValueError(f"seq_length must be a positive integer, got {seq_length}")
    _check_record(record, "record")
    pair = _record_kind(record) == "pair"
    prompt = tokenizer.encode(record["prompt"]) if pair else []
    target = tokenizer.encode(record["response"] if pair else record["text"])
    ids = [tokenizer.bos_id, *prompt, *target, tokenizer.eos_id]
    # Label j is ids[j + 1]: the prompt bytes are labels 0..len(prompt)-1, the rest is target.
    mask = [0.0] * len(prompt) + [1.0] * (len(target) + 1)
    tokens, labels = ids[:-1][:seq_length], ids[1:][:seq_length]
    kept = mask[:seq_length]
    if stats is not None:
        stats.samples += 1
        stats.truncated += len(mask) > seq_length
        stats.cut_loss_tokens += int(sum(mask) - sum(kept))
        stats.no_loss_tokens += not any(kept)
        empty = not target and any(kept)
        stats.eos_only += empty and pair
        stats.empty_text += empty and not pair
    pad = seq_length - len(tokens)
    return {
        "tokens": torch.tensor(tokens + [tokenizer.pad_id] * pad, dtype=torch.int64),
        "labels": torch.tensor(labels + [tokenizer.pad_id] * pad, dtype=torch.int64),
        "loss_mask": torch.tensor(kept + [0.0] * pad, dtype=torch.float32),
        "position_ids": torch.arange(seq_length, dtype=torch.int64),
    }


def _epoch_permutation(num_records: int, seed: int, epoch: int) -> Tensor:
    # One generator per (seed, epoch): any sample's position is computable without replaying
    # earlier iterations, and no global RNG state (which layouts may consume) is touched.
    generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + epoch) % 2**64)
    return torch.randperm(num_records, generator=generator)


def global_batch(records: Sequence[dict], iteration: int, *, global_batch_size: int,
                 seq_length: int, seed: int, tokenizer: ByteTokenizer,
                 stats: DataStats | None = None) -> dict[str, Tensor]:  # fmt: skip
    """The whole global batch of ``iteration``, each tensor ``[global_batch_size, seq_length]``,
    and ``group_ids`` ``[global_batch_size]``: samples of the same prompt share a group (numbered
    in order of appearance), each text sample is a group of its own. Samples
    ``iteration * global_batch_size`` onward of an endless walk over the records, in a fresh
    seeded permutation each epoch. Nothing here depends on the parallel layout."""
    if not records:
        raise ValueError("records is empty")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size}")

    perms: dict[int, Tensor] = {}
    samples, groups, group_ids = [], {}, []
    for k in range(iteration * global_batch_size, (iteration + 1) * global_batch_size):
        epoch, pos = divmod(k, len(records))
        if epoch not in perms:
            perms[epoch] = _epoch_permutation(len(records), seed, epoch)
        index = int(perms[epoch][pos])
        record = records[index]
        samples.append(encode_record(record, tokenizer, seq_length, stats))
        key = ("prompt", record["prompt"]) if "prompt" in record else ("record", index)
        group_ids.append(groups.setdefault(key, len(groups)))
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    batch["group_ids"] = torch.tensor(group_ids, dtype=torch.int64)
    return batch


def microbatches(
    batch: dict[str, Tensor], *, dp_rank: int, dp_size: int, micro_batch_size: int
) -> list[dict[str, Tensor]]:
    """DP rank ``dp_rank``'s micro-batches: contiguous slices of its contiguous share of
    ``batch`` (every rank's, in rank order, give back ``batch``)."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    sizes = {t.shape[0] for t in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors must share one batch dimension, got {sorted(sizes)}")
    (global_batch_size,) = sizes
    step = dp_size * micro_batch_size
    if global_batch_size % step:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by data-parallel size "
            f"{dp_size} x micro-batch size {micro_batch_size} = {step}; use a multiple of {step}"
        )
    per_rank = global_batch_size // dp_size
    start = dp_rank * per_rank
    # The step's group count goes with every micro-batch (the plugin's group modes read it).
    ranges = {"num_groups": int(batch["group_ids"].max()) + 1} if "group_ids" in batch else {}
    return [
        {key: t[i : i + micro_batch_size] for key, t in batch.items()} | ranges
        for i in range(start, start + per_rank, micro_batch_size)
    ]
