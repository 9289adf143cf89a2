"""The kinds of tokenizer Crucible trains, and one call that trains any of them.

Owns: the kind names the CLI and the sweep accept (`bpe`: HF byte-level BPE, the default;
`spm-bpe` and `spm-unigram`: SentencePiece with byte fallback) and the file each one writes.
Must not: hold training logic (`bpe`, `spm` do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

KINDS = ("bpe", "spm-bpe", "spm-unigram")
DEFAULT_KIND = "bpe"


def file_name(kind: str) -> str:
    """tokenizer.json for HF BPE, tokenizer.model for SentencePiece."""
    _check(kind)
    return "tokenizer.json" if kind == "bpe" else "tokenizer.model"


def train(kind: str, docs: Iterable[str], vocab_size: int, out_dir: str | Path, *,
          min_frequency: int | None = None, sources: Iterable[str] = (),
          show_progress: bool = False) -> Path:
    """Train a tokenizer of `kind` into `out_dir`; returns the tokenizer file's path."""
    _check(kind)
    out = Path(out_dir) / file_name(kind)
    if kind == "bpe":
        from crucible.trainer.tokenizer.bpe import MIN_FREQUENCY, train_bpe

        return train_bpe(docs, vocab_size, out, sources=sources, show_progress=show_progress,
                         min_frequency=MIN_FREQUENCY if min_frequency is None else min_frequency)
    from crucible.trainer.tokenizer.spm import train_sentencepiece

    return train_sentencepiece(docs, vocab_size, out, model_type=kind.removeprefix("spm-"),
                               sources=sources)


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(KINDS)}")
