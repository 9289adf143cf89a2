"""decode(encode(x)) == x for arbitrary code points, Unicode text, code and whitespace runs.

Byte-level BPE is exact for every string. SentencePiece (identity normalisation, byte fallback)
is exact except for U+2581, the character it uses for a space internally: that one decodes as a
space, and the test pins it as the only difference.
"""

from __future__ import annotations

import random

import pytest

from crucible.trainer.tokenizer.codec import open_codec
from crucible.trainer.tokenizer.vocabulary import EOT, EOT_ID, PAD, PAD_ID
from tests.support.text import man_pages_non_latin, stdlib_sources

SPM_SPACE = "\u2581"


def random_code_points(rng: random.Random, n: int) -> str:
    """Any Unicode scalar value (all planes, controls and NUL included; surrogates cannot be
    UTF-8 and so cannot be text)."""
    out = []
    while len(out) < n:
        cp = rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0x800),
                         rng.randrange(0x800, 0x10000), rng.randrange(0x10000, 0x110000)])
        if not 0xD800 <= cp <= 0xDFFF:
            out.append(chr(cp))
    return "".join(out)


def random_byte_strings(rng: random.Random) -> list[str]:
    """Random bytes read as text the two ways text arrives: UTF-8 with replacement characters,
    and Latin-1 (every byte value 0-255 becomes one character)."""
    blobs = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(40)]
    return [b.decode("utf-8", "replace") for b in blobs] + [b.decode("latin-1") for b in blobs]


WHITESPACE = [" " * 1000, "\t" * 64, "\n" * 50, "\r\n" * 20, " \t \n\t\t  \r\n   ", "  lead",
              "trail   ", "a  b   c    d", "\u00a0\u00a0nbsp\u00a0",
              "\u3000ideographic\u3000\u3000",
              "\u2028\u2029\u200b\ufeff", "\x0b\x0c\x1c\x1d\x1e\x1f\x85", ""]

EDGE = ["\x00", "\x00" * 10 + "nul", "\U0010ffff\uffff\ufffe", "e\u0301\u0301\u0301",
        "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
        "\u05e9\u05dc\u05d5\u05dd abc", "\ufdfd", "\U0001d54f\U0001d554\U0001d563",
        "ǅǈǋ ﬁ ﬀ ½ ²", f"quoted {EOT} and {PAD} tokens"]


def cases() -> list[str]:
    rng = random.Random(1234)
    return ([random_code_points(rng, rng.randrange(1, 400)) for _ in range(60)]
            + random_byte_strings(rng) + WHITESPACE + EDGE + stdlib_sources()
            + man_pages_non_latin())


@pytest.fixture(scope="module")
def all_cases() -> list[str]:
    return cases()


def test_bpe_round_trips_everything(trained, all_cases):
    codec = open_codec(trained.bpe)
    encoded = codec.encode_batch(all_cases)
    for text, ids in zip(all_cases, encoded):
        assert codec.decode(ids) == text, repr(text[:80])
    # the batch path and the single path agree
    assert [codec.encode(t) for t in all_cases[:20]] == encoded[:20]


@pytest.mark.parametrize("kind", ["spm_bpe", "spm_unigram"])
def test_sentencepiece_round_trips_all_but_its_space_symbol(trained, all_cases, kind):
    codec = open_codec(getattr(trained, kind))
    for text, ids in zip(all_cases, codec.encode_batch(all_cases)):
        assert codec.decode(ids) == text.replace(SPM_SPACE, " "), repr(text[:80])
    assert codec.decode(codec.encode(f"a{SPM_SPACE}b")) == "a b"  # the documented exception


@pytest.mark.parametrize("kind", ["bpe", "spm_bpe", "spm_unigram"])
def test_special_tokens_written_in_text_are_ordinary_text(trained, kind):
    """A document quoting "<|endoftext|>" must not inject a document boundary."""
    codec = open_codec(getattr(trained, kind))
    ids = codec.encode(f"see {EOT} here {PAD}")
    assert EOT_ID not in ids and PAD_ID not in ids
    assert codec.decode(ids) == f"see {EOT} here {PAD}"


def test_bpe_training_text_round_trips(trained):
    codec = open_codec(trained.bpe)
    docs = list(trained.docs)
    for text, ids in zip(docs, codec.encode_batch(docs)):
        assert codec.decode(ids) == text
