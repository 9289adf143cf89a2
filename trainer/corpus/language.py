"""Language identification with a model that ships inside a PyPI wheel (py3langid).

Owns: `LanguageId`, a filter that labels each document with its language and score
(`metadata["language"]`, `metadata["language_score"]`) and keeps the configured languages above a
minimum score. Must not: download anything.

Model: py3langid 0.4.0 (BSD-3-Clause), a fork of langid.py (Lui & Baldwin 2012, "langid.py: An
Off-the-shelf Language Identification Tool", ACL demo track): a naive Bayes model over byte
n-grams, 97 languages, stored in the wheel (py3langid/data/model.npz.xz). Its accuracy on this
machine's package text is measured by tests/corpus/test_language.py (fortunes in en/de/it/es and
man pages in fr/pl/ru) and reported in docs/corpus.md.

Differences from FineWeb/datatrove: FineWeb used fastText lid.176 and kept English with score
>= 0.65 (paper §3.3; datatrove LanguageFilter downloads lid.176.bin at run time). langid's
normalised probability is a different calibration: on real prose it is near 1.0, so 0.65 only
drops genuinely mixed or too-short texts. datatrove's default `languages` changed from English to
"any language" in its commit 4fa87f78; we keep the paper's English default, configurable.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import ClassVar

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.step import Filter, FilterResult


@cache
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def identify(text: str, max_chars: int) -> tuple[str, float]:
    """(ISO 639-1 code, probability) of the language of the first `max_chars` characters."""
    label, score = _identifier().classify(text[:max_chars].replace("\n", " "))
    return label, float(score)


@dataclass
class LanguageId(Filter):
    name: ClassVar[str] = "language"
    why: ClassVar[str] = "keep the languages the model is for; the quality rules after this are English-tuned"
    requires: ClassVar[tuple[str, ...]] = ("py3langid",)

    languages: tuple[str, ...] | None = ("en",)  # FineWeb §3.3: English. None keeps any language
    min_score: float = 0.65                       # FineWeb §3.3 (fastText score; see module doc)
    # langid's cost is linear in length; accuracy on our test languages is flat above ~1,000
    # characters (tests/corpus/test_language.py measures it), so long documents are sampled.
    max_chars: int = 4000

    def filter(self, doc: Document) -> FilterResult:
        label, score = identify(doc.text, self.max_chars)
        doc.metadata["language"] = label
        doc.metadata["language_score"] = round(score, 4)
        if score < self.min_score:
            return False, "language_low_score"
        if self.languages is not None and label not in self.languages:
            return False, f"language_{label}"
        return True
