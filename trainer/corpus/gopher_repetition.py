"""Gopher's repetition rules (MassiveText, Rae et al. 2021, arXiv 2112.11446, Table A1).

Owns: `GopherRepetition`, a filter that drops documents with too many duplicated paragraphs or
lines (by count and by characters), a too-frequent top 2/3/4-gram, or too many characters inside
duplicated 5..10-grams. Must not: split words itself (words.py).

Table A1 thresholds (remove if above):
    duplicate line fraction 0.30            duplicate paragraph fraction 0.30
    duplicate line character fraction 0.20  duplicate paragraph character fraction 0.20
    top 2-gram / 3-gram / 4-gram character fraction 0.20 / 0.18 / 0.16
    duplicate 5..10-gram character fraction 0.15, 0.14, 0.13, 0.12, 0.11, 0.10

We measure exactly what datatrove's code measures (src/datatrove/pipeline/filters/
gopher_repetition_filter.py), so decisions agree. Where that code reads the paper narrowly:
  * every character fraction divides by len(text), whitespace included, not by the characters of
    the words; a top n-gram counts even when it occurs once;
  * the top n-gram's length counts the spaces between its words, while duplicated n-grams are
    measured with their words glued together (and, glued, "ab c" and "a bc" are the same n-gram);
  * duplicated n-grams are counted greedily: after a repeat, the scan jumps past it, so
    overlapping repeats are not counted twice.
Speed: n-grams are compared as 64-bit rolling hashes of word ids (numpy), never as joined strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.step import Filter, FilterResult

_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAK = re.compile(r"\n+")
# Odd 64-bit multiplier of the rolling n-gram hash (splitmix64's golden-ratio constant).
_ROLL = np.uint64(0x9E3779B97F4A7C15)


def duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items seen before, characters in them): the second "a" of [a, b, a] counts."""
    seen: set[str] = set()
    n_dup = chars_dup = 0
    for item in items:
        if item in seen:
            n_dup += 1
            chars_dup += len(item)
        else:
            seen.add(item)
    return n_dup, chars_dup


class WordNgrams:
    """Hashes and character lengths of a word sequence's n-grams, for any n."""

    def __init__(self, words: list[str]):
        vocab: dict[str, int] = {}
        ids = [vocab.setdefault(w, len(vocab)) for w in words]
        self.n_words = len(words)
        self._ids = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
        self._length_prefix = np.concatenate(([0], np.cumsum([len(w) for w in words])))
        self._hashes = {1: self._ids}

    def hashes(self, n: int) -> np.ndarray:
        """uint64 hash of each n-gram, shape (n_words - n + 1,)."""
        if n not in self._hashes:
            shorter = self.hashes(n - 1)
            with np.errstate(over="ignore"):   # uint64 wrap-around is the hash
                self._hashes[n] = shorter[:-1] * _ROLL + self._ids[n - 1:]
        return self._hashes[n]

    def glued_lengths(self, n: int) -> np.ndarray:
        """Characters of each n-gram with its words glued together, shape (n_words - n + 1,)."""
        return self._length_prefix[n:] - self._length_prefix[:-n]

    def top_ngram_chars(self, n: int) -> int:
        """Characters (spaces between words included) times count of the most frequent n-gram;
        ties go to the n-gram that appears first."""
        hashes = self.hashes(n)
        _, first, counts = np.unique(hashes, return_index=True, return_counts=True)
        top = np.flatnonzero(counts == counts.max())
        at = first[top].min()
        return int((self.glued_lengths(n)[at] + n - 1) * counts.max())

    def duplicated_ngram_chars(self, n: int) -> int:
        """Characters in n-grams already seen, scanning left to right and jumping past repeats."""
        hashes = self.hashes(n).tolist()
        lengths = self.glued_lengths(n).tolist()
        seen: set[int] = set()
        repeated = i = 0
        while i < len(hashes):
            if hashes[i] in seen:
                repeated += lengths[i]
                i += n
            else:
                seen.add(hashes[i])
                i += 1
        return repeated


@dataclass
class GopherRepetition(Filter):
    name: ClassVar[str] = "gopher_repetition"
    why: ClassVar[str] = "drop boilerplate and spam that repeats lines, paragraphs or phrases"

    dup_line_frac: float | None = 0.30        # Table A1
    dup_para_frac: float | None = 0.30        # Table A1
    dup_line_char_frac: float | None = 0.20   # Table A1
    dup_para_char_frac: float | None = 0.20   # Table A1
    top_n_grams: tuple[tuple[int, float], ...] = ((2, 0.20), (3, 0.18), (4, 0.16))  # Table A1
    dup_n_grams: tuple[tuple[int, float], ...] = (                                  # Table A1
        (5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))

    def filter(self, doc: Document) -> FilterResult:
        text = doc.text
        text_chars = len(text)
        paragraphs = _PARAGRAPH_BREAK.split(text.strip())
        n_dup, chars_dup = duplicates(paragraphs)
        if self.dup_para_frac is not None and n_dup / len(paragraphs) > self.dup_para_frac:
            return False, "dup_para_frac"
        if self.dup_para_char_frac is not None and chars_dup / text_chars > self.dup_para_char_frac:
            return False, "dup_para_char_frac"

        lines = _LINE_BREAK.split(text)
        n_dup, chars_dup = duplicates(lines)
        if self.dup_line_frac is not None and n_dup / len(lines) > self.dup_line_frac:
            return False, "dup_line_frac"
        if self.dup_line_char_frac is not None and chars_dup / text_chars > self.dup_line_char_frac:
            return False, "dup_line_char_frac"

        ngrams = WordNgrams(doc.view().words)
        for n, max_frac in self.top_n_grams:
            if ngrams.n_words >= n and ngrams.top_ngram_chars(n) / text_chars > max_frac:
                return False, f"top_{n}_gram"
        for n, max_frac in self.dup_n_grams:
            if ngrams.n_words >= n and ngrams.duplicated_ngram_chars(n) / text_chars > max_frac:
                return False, f"duplicated_{n}_n_grams"
        return True
