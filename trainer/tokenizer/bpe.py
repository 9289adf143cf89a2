"""Byte-level BPE training with HF `tokenizers`, saved as a standard tokenizer.json.

Owns: `train_bpe` (the trainer call, the size rule, the metadata file) and the HF loader. Must
not: encode corpora (`encode`) or measure vocabularies (`sweep`).

Byte-level (GPT-2, Radford et al. 2019 §2.2): the base alphabet is the 256 byte values, so any
input round-trips and nothing maps to an unknown token. The GPT-2 pre-tokenizer regex splits
words, numbers and punctuation first (`pre_tokenizers.ByteLevel`, use_regex=True). Special
tokens come first, so their ids are stable whatever the corpus: 0 = `<|endoftext|>`, 1 =
`<|pad|>` (`vocabulary`). Settings follow the library's own `ByteLevelBPETokenizer.train`
(tokenizers implementations/byte_level_bpe.py: `min_frequency=2`, `initial_alphabet=
ByteLevel.alphabet()`; without the alphabet, bytes unseen in training would have no token).
The tokenizer's identity is the SHA-256 of its tokenizer.json (`tokenizer_hash`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Iterator

from crucible.trainer.tokenizer.metadata import CorpusTally, tokenizer_hash, write_metadata
from crucible.trainer.tokenizer.vocabulary import (EOT, EOT_ID, PAD, PAD_ID, SPECIAL_TOKENS,
                                                   VOCAB_MULTIPLE, VocabError, VocabSize,
                                                   reserved_tokens, round_vocab)

__all__ = ["EOT", "PAD", "SPECIAL_TOKENS", "train_bpe", "tokenizer_hash", "load", "vocab_info",
           "batched"]

MIN_FREQUENCY = 2  # ByteLevelBPETokenizer.train's default (tokenizers byte_level_bpe.py)


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | Path, *,
              min_frequency: int = MIN_FREQUENCY, length: int | None = None,
              multiple: int = VOCAB_MULTIPLE, max_token_length: int | None = None,
              sources: Iterable[str] = (), show_progress: bool = False) -> Path:
    """Train on `texts`, write tokenizer.json to `out_path` and tokenizer.meta.json beside it.

    The vocabulary is `vocab_size` rounded up to a multiple of `multiple`; if the trainer stops
    short it is padded with reserved tokens (see `vocabulary`), and the realised size is checked
    before saving. Returns the path of tokenizer.json; the metadata file holds the sizes.
    """
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    target = round_vocab(vocab_size, multiple)
    tally = CorpusTally(texts, sources)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=show_progress, max_token_length=max_token_length,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    start = time.perf_counter()
    tok.train_from_iterator(tally, trainer=trainer, length=length)
    train_s = time.perf_counter() - start
    learned = tok.get_vocab_size()
    reserved = reserved_tokens(learned, multiple) if learned < target else []
    if reserved:
        tok.add_special_tokens(reserved)
    size = VocabSize(vocab_size, target, learned, len(reserved), multiple)
    size.check(tok.get_vocab_size())
    if (tok.token_to_id(EOT), tok.token_to_id(PAD)) != (EOT_ID, PAD_ID):
        raise VocabError(f"special tokens landed at ids {tok.token_to_id(EOT)}, "
                         f"{tok.token_to_id(PAD)} instead of {EOT_ID}, {PAD_ID}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    write_metadata(out_path, family="hf-bpe", vocab=size.to_dict(), corpus=tally.stats(),
                   settings={"model": "BPE", "pre_tokenizer": "ByteLevel(add_prefix_space=False)",
                             "min_frequency": min_frequency, "max_token_length": max_token_length,
                             "special_tokens": {EOT: EOT_ID, PAD: PAD_ID}},
                   library={"tokenizers": tokenizers.__version__}, train_s=train_s)
    return out_path


def load(path: str | Path):
    """The HF `Tokenizer` in a tokenizer.json (for encoding through Crucible, use `codec`)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def vocab_info(path: str | Path) -> dict:
    """Size, special ids, hash and family of a tokenizer file (tokenizer.json or .model)."""
    from crucible.trainer.tokenizer.codec import open_codec

    codec = open_codec(path)
    return {"vocab_size": codec.vocab_size, "eot_id": codec.eot_id, "pad_id": codec.pad_id,
            "hash": codec.hash, "model": codec.family}
