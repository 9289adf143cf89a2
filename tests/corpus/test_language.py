"""Language ID (py3langid, shipped in its wheel): accuracy on real text in several languages, and
the filter's two reasons at their boundaries.

Text: fortunes in English, German, Italian and Spanish (prose cookies of 150+ characters) and
man-db's own man pages in French, Polish and Russian (1,500 characters of each). The accuracy floor
asserted here is below what was measured (docs/corpus.md gives the figures) so that a different
sample of the same packages does not flake, while a broken model or wiring would still fail.
"""

from __future__ import annotations

import pytest

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.language import LanguageId, identify
from tests.corpus import realtext

MAX_CHARS = LanguageId().max_chars


def samples() -> dict[str, list[str]]:
    texts = {lang: [t for t in realtext.fortunes(lang) if len(t) >= 150 and realtext.is_prose(t)][:60]
             for lang in ("en", "de", "it", "es")}
    for lang in ("fr", "pl", "ru"):
        # Past the title block (page name, section header in English letters), 1,500 characters.
        texts[lang] = [page[200:1700] for page in realtext.man_pages(lang)]
    return texts


@pytest.fixture(scope="module")
def accuracy() -> dict[str, float]:
    return {lang: sum(identify(t, MAX_CHARS)[0] == lang for t in texts) / len(texts)
            for lang, texts in samples().items()}


def test_accuracy_per_language(accuracy):
    print("language-ID accuracy:", {k: round(v, 3) for k, v in accuracy.items()})
    for lang, value in accuracy.items():
        assert value >= 0.7, (lang, value)
    assert sum(accuracy.values()) / len(accuracy) >= 0.9


def test_keeps_configured_languages_and_names_the_others():
    german = next(t for t in realtext.fortunes("de") if len(t) > 300)
    d = Document(text=german, id="t", source="fortunes", key=0)
    assert LanguageId(languages=("en",)).process(d) == "language_de"
    assert d.metadata["language"] == "de"
    assert LanguageId(languages=("en", "de")).process(d) is d
    assert LanguageId(languages=None).process(d) is d


def test_score_at_threshold_kept_just_above_dropped():
    # A short cookie: the model is unsure, which is what the score threshold is for.
    text = next(t for t in realtext.fortunes("en") if 20 < len(t) < 60 and
                0.3 < identify(t, MAX_CHARS)[1] < 0.99)
    _, score = identify(text, MAX_CHARS)
    d = Document(text=text, id="t", source="fortunes", key=0)
    assert LanguageId(languages=None, min_score=score).process(d) is d
    assert LanguageId(languages=None, min_score=score + 1e-3).process(d) == "language_low_score"
