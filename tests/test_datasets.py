"""Tests of the example scripts' data: tokenizer, JSONL loading, masks, global batches, splits."""

from __future__ import annotations

import json

import pytest
import torch
from byte_data import (
    DEFAULT_SEQ_LENGTH,
    ByteTokenizer,
    DataStats,
    encode_record,
    global_batch,
    load_records,
    microbatches,
)

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()


def _write(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _masked_labels(sample) -> list[int]:
    return sample["labels"][sample["loss_mask"].bool()].tolist()


# --- tokenizer -----------------------------------------------------------------------------


def test_tokenizer_ids_and_vocab():
    assert (TOK.pad_id, TOK.eos_id, TOK.bos_id, TOK.vocab_size) == (256, 257, 258, 259)
    assert TOK.padded_vocab_size() == 264
    assert TOK.padded_vocab_size(1) == 259
    assert TOK.padded_vocab_size(4) == 260
    assert TOK.padded_vocab_size(128) == 384
    with pytest.raises(ValueError, match="multiple"):
        TOK.padded_vocab_size(0)


def test_tokenizer_round_trip_skips_specials():
    text = "Hello, caf\u00e9!"
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode([TOK.bos_id, *ids, TOK.eos_id, TOK.pad_id, 263]) == text
    assert TOK.decode(torch.tensor(ids)) == text
    assert TOK.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


# --- encode_record -------------------------------------------------------------------------


def test_prompt_record_masks_exactly_the_response_and_eos():
    record = {"prompt": "Q: 2+2?\n", "response": "4, of course."}
    sample = encode_record(record, TOK, 64)
    masked = _masked_labels(sample)
    assert masked[-1] == TOK.eos_id
    assert TOK.decode(masked[:-1]) == record["response"]
    assert masked[:-1] == TOK.encode(record["response"])
    # Tokens are the labels shifted right by one, starting from bos.
    n = len(record["prompt"]) + len(record["response"]) + 1
    assert sample["tokens"][0] == TOK.bos_id
    assert torch.equal(sample["tokens"][1:n], sample["labels"][: n - 1])


def test_text_record_masks_every_byte_and_eos():
    sample = encode_record({"text": "All is well.", "source": "ignored"}, TOK, 32)
    masked = _masked_labels(sample)
    assert TOK.decode(masked[:-1]) == "All is well." and masked[-1] == TOK.eos_id
    assert int(sample["loss_mask"].sum()) == len("All is well.") + 1


def test_padding_shapes_and_dtypes():
    sample = encode_record({"prompt": "ab", "response": "c"}, TOK, 10)
    assert sample["tokens"].tolist() == [TOK.bos_id, 97, 98, 99] + [TOK.pad_id] * 6
    assert sample["labels"].tolist() == [97, 98, 99, TOK.eos_id] + [TOK.pad_id] * 6
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1] + [0] * 6
    assert sample["position_ids"].tolist() == list(range(10))
    for key, dtype in [
        ("tokens", torch.int64),
        ("labels", torch.int64),
        ("position_ids", torch.int64),
        ("loss_mask", torch.float32),
    ]:
        assert sample[key].dtype == dtype and sample[key].shape == (10,)


def test_truncation_keeps_the_start():
    record = {"prompt": "abc", "response": "defghij"}
    sample = encode_record(record, TOK, 5)
    assert sample["tokens"].tolist() == [TOK.bos_id, *b"abcd"]
    assert sample["labels"].tolist() == list(b"abcde")
    assert sample["loss_mask"].tolist() == [0, 0, 0, 1, 1]  # eos was cut off
    # A prompt longer than the sequence leaves no loss token at all.
    assert encode_record({"prompt": "x" * 20, "response": "y"}, TOK, 8)["loss_mask"].sum() == 0
    # Exactly fitting: the eos label is the last position.
    fit = encode_record({"text": "abcd"}, TOK, 5)
    assert fit["labels"][-1] == TOK.eos_id and fit["loss_mask"].tolist() == [1] * 5


def test_empty_response_still_has_the_eos_loss_token():
    sample = encode_record({"prompt": "Say nothing.", "response": ""}, TOK, 32)
    assert _masked_labels(sample) == [TOK.eos_id]


def test_stats_count_what_encoding_cuts():
    stats = DataStats()
    encode_record({"prompt": "abc", "response": "defghij"}, TOK, 5, stats)  # 8 loss tokens, 2 kept
    encode_record({"prompt": "x" * 20, "response": "y"}, TOK, 8, stats)  # prompt fills the window
    encode_record({"prompt": "Say nothing.", "response": ""}, TOK, 32, stats)  # eos alone
    encode_record({"text": "abcd"}, TOK, 5, stats)  # fits exactly: nothing lost
    assert stats == DataStats(
        samples=4, truncated=2, cut_loss_tokens=6 + 2, no_loss_tokens=1, eos_only=1
    )
    assert stats.as_record() == {
        "truncated_samples": 2,
        "cut_loss_tokens": 8,
        "no_loss_token_samples": 1,
        "eos_only_samples": 1,
        "empty_text_samples": 0,
    }


def test_global_batch_stats_match_the_masks():
    # At seq_length 24: the prompt record loses both loss tokens (response byte and eos) and has
    # none left; the long text keeps 24 of its 51; the short text fits.
    records = [{"prompt": "p" * 30, "response": "r"}, {"text": "t" * 50}, {"text": "short"}]
    stats = DataStats()
    batch = global_batch(
        records, 0, global_batch_size=6, seq_length=24, seed=3, tokenizer=TOK, stats=stats
    )
    first = [chr(c) for c in batch["labels"][:, 0].tolist()]
    assert stats.samples == 6 and stats.eos_only == 0
    assert stats.no_loss_tokens == first.count("p") == int((batch["loss_mask"].sum(1) == 0).sum())
    assert stats.truncated == first.count("p") + first.count("t")
    assert stats.cut_loss_tokens == 2 * first.count("p") + 27 * first.count("t")
    total = DataStats()
    total.add(stats)
    total.add(stats)
    assert total.truncated == 2 * stats.truncated and total.samples == 12


def test_encode_record_errors():
    with pytest.raises(ValueError, match="seq_length"):
        encode_record({"text": "a"}, TOK, 0)
    with pytest.raises(ValueError, match="expected"):
        encode_record({"prompt": "only a prompt"}, TOK, 8)
    with pytest.raises(ValueError, match="'text' must be a string"):
        encode_record({"text": 3}, TOK, 8)


# --- load_records --------------------------------------------------------------------------


def test_load_records_reads_both_forms_and_skips_blank_lines(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "p", "response": "r", "id": 7}),
            "",
            json.dumps({"text": "t"}),
        ],
    )
    assert load_records(path) == [{"prompt": "p", "response": "r", "id": 7}, {"text": "t"}]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "ok"}', '{"text": "unterminated'], r"data\.jsonl, line 2: malformed JSON"),
        (['{"text": "ok"}', "", '{"prompt": "p"}'], r"data\.jsonl, line 3: expected"),
        (['{"question": "q", "answer": "a"}'], r"line 1: expected"),
        (['["not", "an", "object"]'], r"line 1: expected"),
        (['{"prompt": "p", "response": 5}'], r"line 1: field 'response' must be a string"),
        (['{"prompt": null, "response": "r"}'], r"line 1: field 'prompt' must be a string"),
        (['{"text": ["a"]}'], r"line 1: field 'text' must be a string"),
        ([], r"data\.jsonl: no records"),
        (["", "   "], r"data\.jsonl: no records"),
    ],
)
def test_load_records_errors(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        load_records(_write(tmp_path, lines))


def test_default_corpus_is_varied_real_text():
    records = load_records(None)
    assert len(records) >= 150
    kinds = {"prompt" in r for r in records}
    assert kinds == {True, False}  # both record forms are present
    for r in records:
        for value in r.values():
            assert value.isascii()
    counts = torch.tensor(
        [encode_record(r, TOK, DEFAULT_SEQ_LENGTH)["loss_mask"].sum() for r in records]
    )
    assert counts.min() >= 1 and counts.float().std() > 10
    assert counts.max() == DEFAULT_SEQ_LENGTH  # some records fill the whole sequence
    assert (counts < 10).any()  # and some have only a few loss tokens


# --- global_batch and microbatches ---------------------------------------------------------

RECORDS = [{"prompt": f"q{i}?", "response": "a" * i} for i in range(7)] + [{"text": "plain"}]


def _batch(iteration, gbs=6, seed=1234, records=RECORDS):
    return global_batch(
        records, iteration, global_batch_size=gbs, seq_length=16, seed=seed, tokenizer=TOK
    )


def test_global_batch_shapes_and_determinism():
    batch = _batch(3)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "group_ids"}
    for key, t in batch.items():
        assert t.shape == ((6,) if key == "group_ids" else (6, 16))
    again = _batch(3)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert not torch.equal(batch["tokens"], _batch(4)["tokens"])
    assert not torch.equal(_batch(0, seed=1)["tokens"], _batch(0, seed=2)["tokens"])


def test_global_batch_is_a_seeded_walk_over_epochs():
    n = len(RECORDS)
    # Consecutive iterations tile the walk: iterations of size 2 reproduce one of size 4.
    small = [_batch(i, gbs=2) for i in range(4)]
    big = [_batch(i, gbs=4) for i in range(2)]
    small_tokens = torch.cat([b["tokens"] for b in small])
    assert torch.equal(small_tokens, torch.cat([b["tokens"] for b in big]))
    # Each epoch visits every record once; the order changes between epochs.
    walk = torch.cat([_batch(i, gbs=n)["tokens"] for i in range(3)])
    epochs = walk.view(3, n, -1)
    expected = sorted(encode_record(r, TOK, 16)["tokens"].tolist() for r in RECORDS)
    for e in range(3):
        assert sorted(epochs[e].tolist()) == expected
    assert not torch.equal(epochs[0], epochs[1])


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_splits_reassemble_the_global_batch(dp_size, micro_batch_size):
    gbs = 12
    batch = _batch(5, gbs=gbs)
    if gbs % (dp_size * micro_batch_size):
        with pytest.raises(ValueError, match="multiple of"):
            microbatches(batch, dp_rank=0, dp_size=dp_size, micro_batch_size=micro_batch_size)
        return
    parts = []
    for rank in range(dp_size):
        mbs = microbatches(batch, dp_rank=rank, dp_size=dp_size, micro_batch_size=micro_batch_size)
        assert len(mbs) == gbs // (dp_size * micro_batch_size)
        assert all(mb["tokens"].shape == (micro_batch_size, 16) for mb in mbs)
        parts.extend(mbs)
    for key in batch:
        assert torch.equal(torch.cat([mb[key] for mb in parts]), batch[key])


def test_samples_of_one_prompt_share_a_group():
    """Samples of the same prompt share a group id, each text sample's record is a group of its
    own (ids numbered in order of appearance); every micro-batch carries the step's group
    count."""
    records = [{"prompt": "same", "response": "a"}, {"prompt": "same", "response": "bb"},
               {"prompt": "other", "response": "c"}, {"text": "t1"}, {"text": "t2"}]  # fmt: skip
    encoded = [encode_record(r, TOK, 16)["tokens"].tolist() for r in records]
    batch = _batch(0, gbs=10, records=records)
    rows = [encoded.index(t) for t in batch["tokens"].tolist()]
    keys = [records[i].get("prompt", f"record {i}") for i in rows]
    ids = batch["group_ids"].tolist()
    assert ids[0] == 0 and sorted(set(ids)) == list(range(len(set(keys))))
    assert all((ids[a] == ids[b]) == (keys[a] == keys[b]) for a in range(10) for b in range(10))
    mbs = microbatches(batch, dp_rank=1, dp_size=2, micro_batch_size=5)
    assert mbs[0]["num_groups"] == len(set(keys)) == 4


def test_rank_slices_are_contiguous():
    batch = _batch(0, gbs=8)
    (rank1,) = microbatches(batch, dp_rank=1, dp_size=2, micro_batch_size=4)
    assert torch.equal(rank1["labels"], batch["labels"][4:8])


def test_global_batch_errors():
    with pytest.raises(ValueError, match="records is empty"):
        _batch(0, records=[])
    with pytest.raises(ValueError, match="iteration"):
        _batch(-1)
    with pytest.raises(ValueError, match="global_batch_size"):
        _batch(0, gbs=0)


def test_microbatches_errors():
    batch = _batch(0, gbs=10)
    with pytest.raises(ValueError, match=r"10 is not divisible .* 2 x micro-batch size 3 = 6"):
        microbatches(batch, dp_rank=0, dp_size=2, micro_batch_size=3)
    with pytest.raises(ValueError, match="dp_rank"):
        microbatches(batch, dp_rank=2, dp_size=2, micro_batch_size=1)
    with pytest.raises(ValueError, match="dp_rank"):
        microbatches(batch, dp_rank=0, dp_size=0, micro_batch_size=1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        microbatches(batch, dp_rank=0, dp_size=1, micro_batch_size=0)
    with pytest.raises(ValueError, match="share one batch dimension"):
        microbatches(
            {"tokens": torch.zeros(4, 2), "labels": torch.zeros(2, 2)},
            dp_rank=0,
            dp_size=1,
            micro_batch_size=1,
        )
    with pytest.raises(ValueError, match="share one batch dimension"):
        microbatches({}, dp_rank=0, dp_size=1, micro_batch_size=1)


@pytest.mark.unit
def test_empty_text_has_its_own_count():
    stats = DataStats()
    encode_record({"text": ""}, TOK, 8, stats)
    encode_record({"prompt": "p", "response": ""}, TOK, 8, stats)
    assert (stats.empty_text, stats.eos_only) == (1, 1)
    assert stats.as_record()["empty_text_samples"] == 1


@pytest.mark.unit
def test_a_non_utf8_file_is_refused_naming_file_line_and_byte(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xff"}\n')
    with pytest.raises(
        ValueError, match=r"data.jsonl, line 3: not UTF-8 \(byte 0xff at column 14\)"
    ):
        load_records(str(path))
