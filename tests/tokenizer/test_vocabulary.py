"""Realised vocabulary size and special-token ids are as configured, and the metadata says so."""

from __future__ import annotations

import json

import pytest

from crucible.trainer.tokenizer import trainers
from crucible.trainer.tokenizer.codec import CodecError, open_codec
from crucible.trainer.tokenizer.metadata import metadata_path, read_metadata, tokenizer_hash
from crucible.trainer.tokenizer.vocabulary import (EOT, EOT_ID, PAD, PAD_ID, RESERVED,
                                                   VocabError, VocabSize, min_vocab, round_vocab)
from tests.support.text import pydoc_docs


def test_round_vocab_is_the_next_multiple_of_128():
    assert round_vocab(50257) == 50304  # GPT-2's vocabulary, as nanoGPT pads it
    assert round_vocab(32000) == 32000  # Llama 2's is already a multiple
    assert round_vocab(128256) == 128256  # Llama 3's 128,000 + 256 reserved
    assert round_vocab(4097) == 4224
    assert min_vocab() == 384  # 256 bytes + 2 specials + unk, rounded up
    with pytest.raises(VocabError, match="byte tokens"):
        round_vocab(300)


@pytest.mark.parametrize("kind", trainers.KINDS)
def test_realised_size_and_special_ids(trained, kind):
    path = getattr(trained, kind.replace("-", "_"))
    codec = open_codec(path)
    assert codec.vocab_size == 2048
    assert (codec.eot_id, codec.pad_id) == (EOT_ID, PAD_ID) == (0, 1)
    meta = read_metadata(path)
    assert meta["vocab"] == {"requested": 2048, "target": 2048, "learned": 2048, "reserved": 0,
                             "realised": 2048, "multiple": 128, "stopped_short": False}
    assert meta["hash"] == tokenizer_hash(path) == codec.hash
    assert meta["corpus"]["documents"] == len(trained.docs)
    assert meta["corpus"]["bytes"] == sum(len(t.encode()) for t in trained.docs)


def test_hf_bpe_special_tokens_and_bytes(trained):
    tok = json.loads(trained.bpe.read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert added == {EOT: 0, PAD: 1}
    assert len(tok["model"]["vocab"]) == 2048  # specials + 256 bytes + 1,790 merges
    assert len(tok["model"]["merges"]) == 2048 - 256 - 2


def test_requested_size_rounds_up(tmp_path):
    path = trainers.train("bpe", pydoc_docs(), 1000, tmp_path)
    meta = read_metadata(path)["vocab"]
    assert (meta["requested"], meta["target"], meta["realised"]) == (1000, 1024, 1024)
    assert open_codec(path).vocab_size == 1024


def test_bpe_that_stops_short_is_padded_to_a_multiple_of_128_and_says_so(tmp_path):
    """pydoc's 0.47 MB cannot fill 20,000 tokens at min_frequency 2: the trainer stops early."""
    path = trainers.train("bpe", pydoc_docs(), 20000, tmp_path)
    vocab = read_metadata(path)["vocab"]
    codec = open_codec(path)
    assert vocab["stopped_short"] and vocab["target"] == 20096
    assert vocab["learned"] < vocab["target"]
    assert vocab["realised"] == codec.vocab_size and codec.vocab_size % 128 == 0
    assert vocab["reserved"] == codec.vocab_size - vocab["learned"] < 128
    assert codec.tok.token_to_id(RESERVED.format(0)) == vocab["learned"]
    size = VocabSize(**{k: vocab[k] for k in ("requested", "target", "learned", "reserved")})
    assert "stopped at" in size.describe() and "reserved" in size.describe()


def test_sentencepiece_that_cannot_fill_the_target_retrains_at_a_multiple_of_128(tmp_path):
    docs = pydoc_docs()[:10]
    path = trainers.train("spm-bpe", docs, 65536, tmp_path)
    vocab = read_metadata(path)["vocab"]
    assert vocab["stopped_short"] and vocab["realised"] % 128 == 0
    assert open_codec(path).vocab_size == vocab["realised"] < 65536


def test_vocab_size_check_refuses_a_mismatch():
    size = VocabSize(requested=1000, target=1024, learned=1000, reserved=24)
    size.check(1024)
    with pytest.raises(VocabError, match="expected 1024"):
        size.check(1000)
    with pytest.raises(VocabError, match="multiple of 128"):
        VocabSize(1000, 1024, 1000, 0).check(1000)


def test_metadata_fingerprint_follows_the_text(tmp_path):
    docs = pydoc_docs()
    a = read_metadata(trainers.train("bpe", docs, 512, tmp_path / "a"))
    b = read_metadata(trainers.train("bpe", docs, 512, tmp_path / "b"))
    c = read_metadata(trainers.train("bpe", docs[:-1], 512, tmp_path / "c"))
    assert a["corpus"]["fingerprint"] == b["corpus"]["fingerprint"] != c["corpus"]["fingerprint"]
    assert a["hash"] == b["hash"]  # training is deterministic: same text, same tokenizer
    assert metadata_path(tmp_path / "a" / "tokenizer.json").name == "tokenizer.meta.json"
    assert a["settings"]["min_frequency"] == 2 and a["library"]["tokenizers"]


def test_a_file_that_is_not_a_tokenizer_is_refused(tmp_path):
    bogus = tmp_path / "tokenizer.json"
    bogus.write_text('{"not": "a tokenizer"}')
    with pytest.raises(CodecError, match="not a HF tokenizer.json"):
        open_codec(bogus)
    with pytest.raises(CodecError, match="does not exist"):
        open_codec(tmp_path / "missing.json")
