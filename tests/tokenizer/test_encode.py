"""Encoded shards read back through the trainer's data loader as the same tokens; a shard made by
another tokenizer is refused with a clear error; the split is by whole documents."""

from __future__ import annotations

import json

import numpy as np
import pytest

from crucible.trainer.data import DataError, ShardSet, read_header
from crucible.trainer.tokenizer import trainers
from crucible.trainer.tokenizer.codec import open_codec
from crucible.trainer.tokenizer.documents import is_held_out
from crucible.trainer.tokenizer.encode import EncodeError, encode_to_shards
from crucible.trainer.tokenizer.vocabulary import EOT
from tests.support.text import pydoc_docs


def expected_streams(codec, docs, val_fraction, seed=0):
    """What the shards must hold: each document's ids then EOT, in order, per split."""
    streams = {"train": [], "val": []}
    for i, (text, ids) in enumerate(zip(docs, codec.encode_batch(docs))):
        split = "val" if is_held_out(i, text, val_fraction, seed) else "train"
        streams[split] += ids + [codec.eot_id]
    return streams


@pytest.mark.parametrize("kind", ["bpe", "spm_unigram"])
def test_shards_read_back_through_the_data_loader(trained, tmp_path, kind):
    path = getattr(trained, kind)
    docs = list(trained.docs)
    written = encode_to_shards(path, docs, tmp_path, val_fraction=0.1, shard_tokens=50_000,
                               batch_bytes=64 << 10)
    codec = open_codec(path)
    want = expected_streams(codec, docs, 0.1)
    for split in ("train", "val"):
        shards = ShardSet(tmp_path / split)
        assert shards.paths == written[split]
        assert shards.tokenizer_hash == codec.hash and shards.vocab_size == 2048
        assert shards.eot_id == codec.eot_id == 0
        got = shards.read(0, shards.num_tokens)
        assert got.tolist() == want[split]
    assert len(written["train"]) > 3  # the shard boundary was crossed several times
    train = ShardSet(tmp_path / "train")
    assert sum(h.num_docs for h in train.headers) + sum(
        h.num_docs for h in ShardSet(tmp_path / "val").headers) == len(docs)


def test_shards_end_at_document_boundaries_and_count_bytes(trained, tmp_path):
    docs = list(trained.docs)
    encode_to_shards(trained.bpe, docs, tmp_path, val_fraction=0.2, shard_tokens=20_000,
                     batch_bytes=256 << 10)
    total_bytes = 0
    for split in ("train", "val"):
        for shard in sorted((tmp_path / split).glob("*.bin")):
            header = read_header(shard)
            tokens = np.memmap(shard, dtype=header.dtype, mode="r", offset=4096)
            assert tokens[-1] == header.eot_id  # every shard ends with a whole document
            assert int((tokens == header.eot_id).sum()) == header.num_docs
            assert header.dtype == "uint16"
            total_bytes += header.num_bytes
    assert total_bytes == sum(len(t.encode()) for t in docs)
    summary = json.loads((tmp_path / "encode.json").read_text())
    assert summary["splits"]["train"]["bytes"] + summary["splits"]["val"]["bytes"] == total_bytes
    assert summary["tokenizer_hash"] == open_codec(trained.bpe).hash


def test_split_is_by_document_and_reproducible(trained, tmp_path):
    docs = list(trained.docs)
    encode_to_shards(trained.bpe, docs, tmp_path / "a", val_fraction=0.1, batch_bytes=32 << 10)
    encode_to_shards(trained.bpe, docs, tmp_path / "b", val_fraction=0.1, batch_bytes=1 << 20)
    for split in ("train", "val"):
        a = ShardSet(tmp_path / "a" / split)
        b = ShardSet(tmp_path / "b" / split)
        assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))  # batch-independent
    held = sum(is_held_out(i, t, 0.1) for i, t in enumerate(docs))
    assert ShardSet(tmp_path / "a" / "val").headers[0].num_docs == held
    assert 0.05 < held / len(docs) < 0.15


def test_a_tokenizer_hash_mismatch_is_refused(trained, tmp_path):
    """The trainer compares data.tokenizer's hash with the shard headers (loop.py)."""
    encode_to_shards(trained.bpe, list(trained.docs), tmp_path, val_fraction=0.1)
    shards = ShardSet(tmp_path / "train")
    other = open_codec(trained.spm_bpe).hash
    with pytest.raises(DataError, match=f"encoded with tokenizer {shards.tokenizer_hash[:12]} but "
                                        f"data.tokenizer is {other[:12]}; re-encode"):
        shards.check_compatible(2048, other)
    shards.check_compatible(2048, open_codec(trained.bpe).hash)


def test_shards_of_two_tokenizers_in_one_folder_are_refused(trained, tmp_path):
    docs = pydoc_docs()
    encode_to_shards(trained.bpe, docs, tmp_path / "a", val_fraction=0)
    encode_to_shards(trained.spm_bpe, docs, tmp_path / "b", val_fraction=0)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (tmp_path / "a" / "train" / "train_00000.bin").rename(mixed / "a.bin")
    (tmp_path / "b" / "train" / "train_00000.bin").rename(mixed / "b.bin")
    with pytest.raises(DataError, match="different tokenizer"):
        ShardSet(mixed)


def test_encode_refuses_to_mix_with_existing_shards(trained, tmp_path):
    docs = pydoc_docs()
    encode_to_shards(trained.bpe, docs, tmp_path)
    with pytest.raises(EncodeError, match="already holds"):
        encode_to_shards(trained.spm_bpe, docs, tmp_path)
    encode_to_shards(trained.spm_bpe, docs, tmp_path, overwrite=True)
    assert ShardSet(tmp_path / "train").tokenizer_hash == open_codec(trained.spm_bpe).hash


def test_quoted_end_of_text_does_not_split_a_document(trained, tmp_path):
    docs = [f"before {EOT} after", "second document"]
    encode_to_shards(trained.bpe, docs, tmp_path, val_fraction=0)
    shards = ShardSet(tmp_path / "train")
    assert shards.headers[0].num_docs == 2
    assert int((shards.read(0, shards.num_tokens) == shards.eot_id).sum()) == 2


def test_the_old_call_still_works(tmp_path):
    """tests/trainer and the demo call train_bpe(texts, V, path) and encode_to_shards(...)."""
    from crucible.trainer.tokenizer.bpe import tokenizer_hash, train_bpe

    docs = pydoc_docs()
    tok = train_bpe(docs, 2048, tmp_path / "tokenizer.json")
    written = encode_to_shards(tok, docs, tmp_path / "shards", val_fraction=0.1, seed=0)
    assert written["train"] and written["val"]
    assert ShardSet(tmp_path / "shards" / "train").tokenizer_hash == tokenizer_hash(tok)
    assert trainers.file_name("bpe") == tok.name
