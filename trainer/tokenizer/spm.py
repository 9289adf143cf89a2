"""SentencePiece BPE or unigram training with byte fallback, saved as a standard `.model`.

Owns: `train_sentencepiece` (the trainer call with Crucible's special-token ids, the size rule,
the metadata file). Must not: encode corpora (`encode`) or measure vocabularies (`sweep`).

Settings are Llama 2's (Touvron et al. 2023, arXiv 2307.09288 §2.2: SentencePiece BPE, "split
all numbers into individual digits and use bytes to decompose unknown UTF-8 characters"), that
is `split_digits=True, byte_fallback=True`, plus what exact round trips need: the `identity`
normalisation instead of the default `nmt_nfkc`, no dummy prefix and no whitespace collapsing
(sentencepiece doc/options.md lists the defaults). Special ids match the HF tokenizer's:
0 = `<|endoftext|>` (SentencePiece's eos), 1 = `<|pad|>`, 2 = `<unk>` (never produced: byte
fallback covers every character), no bos; the 256 byte pieces follow at ids 3..258.

SentencePiece learns from sentences, so documents are fed line by line; a newline is then encoded
by byte fallback (`<0x0A>`), as in Llama 2's tokenizer. One known limit: SentencePiece writes a
space as U+2581 ("▁") internally, so a literal U+2581 in the text decodes as a space; the
round-trip test pins this as the only exception.

Size. SentencePiece hits the target exactly or fails ("Vocabulary size too high ... <= N") when
the corpus cannot fill it; Crucible then retrains once at N rounded down to a multiple of 128 and
reports that it stopped short.
"""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path
from typing import Iterable, Iterator, Literal

from crucible.trainer.tokenizer.metadata import CorpusTally, write_metadata
from crucible.trainer.tokenizer.vocabulary import (EOT, EOT_ID, PAD, PAD_ID, SPM_UNK_ID, UNK,
                                                   VOCAB_MULTIPLE, VocabError, VocabSize,
                                                   min_vocab, round_vocab)

ModelType = Literal["bpe", "unigram"]
CHARACTER_COVERAGE = 0.9995  # spm_train's default (doc/options.md); byte fallback covers the rest
MAX_SENTENCE_BYTES = 1 << 16  # the default 4192 would silently skip longer lines (options.md)
_TOO_HIGH = re.compile(r"Vocabulary size too high.*<= (\d+)")


def sentences(docs: Iterable[str]) -> Iterator[str]:
    """The non-blank lines of each document: SentencePiece's unit of training text."""
    for text in docs:
        for line in text.split("\n"):
            if line.strip():
                yield line


def _train(lines: list[str], vocab_size: int, model_type: ModelType, threads: int,
           character_coverage: float, split_digits: bool) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type=model_type,
        vocab_size=vocab_size, byte_fallback=True, split_digits=split_digits,
        character_coverage=character_coverage, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        eos_id=EOT_ID, eos_piece=EOT, pad_id=PAD_ID, pad_piece=PAD, unk_id=SPM_UNK_ID,
        unk_piece=UNK, bos_id=-1, max_sentence_length=MAX_SENTENCE_BYTES, num_threads=threads,
        minloglevel=2)
    return model.getvalue()


def train_sentencepiece(texts: Iterable[str], vocab_size: int, out_path: str | Path, *,
                        model_type: ModelType = "bpe", multiple: int = VOCAB_MULTIPLE,
                        character_coverage: float = CHARACTER_COVERAGE, split_digits: bool = True,
                        threads: int | None = None, sources: Iterable[str] = ()) -> Path:
    """Train on `texts`, write the `.model` to `out_path` and tokenizer.meta.json beside it."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise VocabError(f"SentencePiece model type must be bpe or unigram, got {model_type!r}")
    target = round_vocab(vocab_size, multiple)
    tally = CorpusTally(texts, sources)
    lines = list(sentences(tally))
    if not lines:
        raise VocabError("no text to train on: every document is blank")
    threads = threads or os.cpu_count() or 1
    start = time.perf_counter()
    trained = target
    try:
        proto = _train(lines, target, model_type, threads, character_coverage, split_digits)
    except RuntimeError as err:
        found = _TOO_HIGH.search(str(err))
        if not found:
            raise
        trained = int(found.group(1)) // multiple * multiple
        if trained < min_vocab(multiple):
            raise VocabError(f"the corpus supports only {found.group(1)} SentencePiece pieces; "
                             "give it more text") from None
        proto = _train(lines, trained, model_type, threads, character_coverage, split_digits)
    train_s = time.perf_counter() - start
    processor = spm.SentencePieceProcessor(model_proto=proto)
    size = VocabSize(vocab_size, target, trained, 0, multiple)
    size.check(processor.get_piece_size())
    if (processor.eos_id(), processor.pad_id()) != (EOT_ID, PAD_ID):
        raise VocabError(f"special tokens landed at ids {processor.eos_id()}, "
                         f"{processor.pad_id()} instead of {EOT_ID}, {PAD_ID}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(proto)
    write_metadata(out_path, family=f"spm-{model_type}", vocab=size.to_dict(),
                   corpus=tally.stats(),
                   settings={"model_type": model_type, "byte_fallback": True,
                             "split_digits": split_digits, "normalization": "identity",
                             "add_dummy_prefix": False, "remove_extra_whitespaces": False,
                             "character_coverage": character_coverage,
                             "training_sentences": len(lines),
                             "special_tokens": {EOT: EOT_ID, PAD: PAD_ID, UNK: SPM_UNK_ID}},
                   library={"sentencepiece": spm.__version__}, train_s=train_s)
    return out_path
