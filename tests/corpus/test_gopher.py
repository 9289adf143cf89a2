"""Every Gopher quality and repetition reason, on real text just inside and just outside its
default threshold (Rae et al. 2021, App. A.1.1 and Table A1).

Documents are assembled from Python's own documentation (pydoc topics): real words and sentences,
arranged so that one measure sits exactly at, or one step past, its threshold. Where the step is a
character fraction, the test measures it with a plain reference implementation of the definition
(strings, not our hashed n-grams) and searches for the boundary.
"""

from __future__ import annotations

import itertools
import re

import pytest

from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.gopher_quality import GopherQuality
from crucible.trainer.corpus.gopher_repetition import GopherRepetition
from crucible.trainer.corpus.words import split_words
from tests.corpus import realtext

# Words the splitter keeps whole: spaCy's English exceptions split a few letter-only words
# ("cannot" -> "can" "not", "id" -> "i" "d"), which would change the counts below.
STOP_FREE = [w for w in realtext.prose_words()
             if w not in ("the", "be", "to", "of", "and", "that", "have", "with")
             and split_words(w) == [w]]


def doc(text: str) -> Document:
    return Document(text=text, id="t", source="test", key=0)


def verdict(step, text: str) -> str:
    """The drop reason, or "keep"."""
    outcome = step.process(doc(text))
    return outcome if isinstance(outcome, str) else "keep"


def words_doc(n_words: int) -> str:
    """n real words (letters only), two of them stop words, no punctuation (the prose is read
    again from the start when n is larger than it)."""
    return " ".join(["the", "of", *itertools.islice(itertools.cycle(STOP_FREE), n_words - 2)])


def exact_mean_words(n_words: int, total_chars: int) -> list[str]:
    """n real words (including "the" and "of") whose lengths add up to total_chars."""
    pool = {length: [w for w in words if split_words(w) == [w]]
            for length, words in realtext.words_by_length().items()}
    rest_n, rest_chars = n_words - 2, total_chars - 5
    base, extra = divmod(rest_chars, rest_n)
    chosen = pool[base + 1][:extra] + pool[base][:rest_n - extra]
    assert len(chosen) == rest_n
    return ["the", "of", *chosen]


# ---- Gopher quality -----------------------------------------------------------------------
def test_min_words_50_kept_49_dropped():
    step = GopherQuality()
    assert verdict(step, words_doc(50)) == "keep"
    assert verdict(step, words_doc(49)) == "gopher_short_doc"


def test_max_words_100000_kept_100001_dropped():
    step = GopherQuality()
    assert verdict(step, words_doc(100_000)) == "keep"
    assert verdict(step, words_doc(100_001)) == "gopher_long_doc"


def test_mean_word_length_3_kept_just_below_dropped():
    step = GopherQuality()
    assert verdict(step, " ".join(exact_mean_words(100, 300))) == "keep"
    assert verdict(step, " ".join(exact_mean_words(100, 299))) == "gopher_below_avg_threshold"


def test_mean_word_length_10_kept_just_above_dropped():
    step = GopherQuality()
    assert verdict(step, " ".join(exact_mean_words(100, 1000))) == "keep"
    assert verdict(step, " ".join(exact_mean_words(100, 1001))) == "gopher_above_avg_threshold"


@pytest.mark.parametrize("symbol,reason", [("#", "gopher_too_many_hashes"),
                                           ("...", "gopher_too_many_ellipsis")])
def test_symbol_per_word_ratio_0_1(symbol, reason):
    # 90 words + 10 symbols: 10/100 = 0.1 (not above); one more symbol: 11/101 > 0.1. Each
    # symbol stands alone between words, as a marker in a list would.
    def text(n_symbols: int) -> str:
        words = words_doc(90).split()
        for i in range(n_symbols):
            words.insert(2 + 8 * i, symbol)
        return " ".join(words)

    step = GopherQuality()
    assert len(split_words(text(10))) == 100
    assert verdict(step, text(10)) == "keep"
    assert verdict(step, text(11)) == reason


def test_bullet_lines_90_percent_kept_all_dropped():
    # Plain sentences: quoted names and brackets are tokens of their own, and with the "-"
    # bullets they would push the share of words with a letter under 80%.
    sentences = [s for s in realtext.prose_sentences() if not any(c in s for c in "\"'()")][:10]
    nine = "\n".join(("- " + s) if i < 9 else s for i, s in enumerate(sentences))
    ten = "\n".join("• " + s for s in sentences)
    step = GopherQuality()
    assert verdict(step, nine) == "keep"
    assert verdict(step, ten) == "gopher_too_many_bullets"


def test_ellipsis_lines_30_percent_kept_40_dropped():
    sentences = [s.rstrip(".") for s in realtext.prose_sentences()[:10]]

    def text(n_ellipsis: int) -> str:
        return "\n".join(s + ("..." if i < n_ellipsis else ".") for i, s in enumerate(sentences))

    step = GopherQuality(max_symbol_word_ratio=None)   # this rule alone, not the per-word one
    assert verdict(step, text(3)) == "keep"
    assert verdict(step, text(4)) == "gopher_too_many_end_ellipsis"


def test_words_with_a_letter_80_percent_kept_below_dropped():
    # Numbers as they appear in the docs (versions, sizes): words without a letter.
    years = re.findall(r"(?<![\w.])\d+(?:\.\d+)*(?![\w.])", " ".join(realtext.pydoc_topics().values()))
    assert len(years) > 11

    def text(n_numbers: int) -> str:
        return " ".join(words_doc(40).split() + years[:n_numbers])

    step = GopherQuality()
    assert verdict(step, text(10)) == "keep"            # 40 / 50 = 0.8
    assert verdict(step, text(11)) == "gopher_below_alpha_threshold"   # 40 / 51


def test_two_stop_words_kept_one_dropped():
    body = STOP_FREE[:60]
    step = GopherQuality()
    assert verdict(step, " ".join(["the", "with", *body])) == "keep"
    assert verdict(step, " ".join(["the", "The", *body])) == "gopher_enough_stop_words"


# ---- Gopher repetition: reference measures -------------------------------------------------
def dup_chars(items: list[str]) -> int:
    seen, total = set(), 0
    for item in items:
        total += len(item) if item in seen else 0
        seen.add(item)
    return total


def reference_dup_ngram_chars(words: list[str], n: int) -> int:
    seen, total, i = set(), 0, 0
    while i < len(words) - n + 1:
        gram = "".join(words[i:i + n])
        if gram in seen:
            total += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return total


def boundary(make, measure, threshold: float, sizes: range):
    """The largest size whose measure is <= threshold, and the next one (> threshold)."""
    inside = max(s for s in sizes if measure(make(s)) <= threshold)
    assert measure(make(inside + 1)) > threshold
    return make(inside), make(inside + 1)


PARAGRAPHS = [" ".join(realtext.prose_sentences()[i * 4:(i + 1) * 4]) for i in range(40)]


@pytest.mark.parametrize("sep,reason", [("\n\n", "dup_para_frac"), ("\n", "dup_line_frac")])
def test_duplicate_paragraph_or_line_count_30_percent(sep, reason):
    # A short heading repeated: 3 repeats in 10 items is 0.3 (kept); 4 in 13 is 0.31 (dropped).
    def text(unique: int, copies: int) -> str:
        items = PARAGRAPHS[:unique] + ["Notes"] * copies
        return sep.join(items)

    step = GopherRepetition()
    assert verdict(step, text(6, 4)) == "keep"
    assert verdict(step, text(8, 5)) == reason


@pytest.mark.parametrize("sep,reason", [("\n\n", "dup_para_char_frac"),
                                        ("\n", "dup_line_char_frac")])
def test_duplicate_paragraph_or_line_characters_20_percent(sep, reason):
    words = " ".join(PARAGRAPHS[10:14]).split()

    def make(n_words: int) -> str:
        repeated = " ".join(words[:n_words])
        return sep.join(PARAGRAPHS[:6] + [repeated, PARAGRAPHS[6], repeated])

    def measure(text: str) -> float:
        return dup_chars(re.split(sep + "+" if sep == "\n" else r"\n{2,}", text)) / len(text)

    keep, drop = boundary(make, measure, 0.20, range(1, len(words)))
    # A repeated paragraph is also a run of repeated n-grams; those rules are tested on their own.
    step = GopherRepetition(top_n_grams=(), dup_n_grams=())
    assert verdict(step, keep) == "keep"
    assert verdict(step, drop) == reason


@pytest.mark.parametrize("phrase,n,threshold", [("standard input", 2, 0.20),
                                                ("the standard input", 3, 0.18),
                                                ("from the standard input", 4, 0.16)])
def test_top_ngram_character_fraction(phrase, n, threshold):
    prose = " ".join(PARAGRAPHS[:6]).split()

    def make(copies: int) -> str:
        words = list(prose)
        for i in range(copies):          # one copy every 8 words, as a refrain
            words.insert(8 * i + 3, phrase)
        return " ".join(words)

    def measure(text: str) -> float:
        toks = split_words(text)
        grams = [" ".join(toks[i:i + n]) for i in range(len(toks) - n + 1)]
        top = max(set(grams), key=grams.count)
        return len(top) * grams.count(top) / len(text)

    keep, drop = boundary(make, measure, threshold, range(1, 60))
    step = GopherRepetition()
    assert verdict(step, keep) == "keep"
    assert verdict(step, drop) == f"top_{n}_gram"


@pytest.mark.parametrize("n,threshold", [(5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11),
                                         (10, 0.10)])
def test_duplicated_ngram_character_fraction(n, threshold):
    # A passage quoted twice inside otherwise unique prose: every n-gram of the second copy is
    # a repeat. Its length is searched so the n-gram fraction sits just at / past the threshold.
    prose = " ".join(PARAGRAPHS[:12]).split()
    quote = " ".join(PARAGRAPHS[20:26]).split()

    def make(n_words: int) -> str:
        return " ".join(prose[:200] + quote[:n_words] + prose[200:] + quote[:n_words])

    def measure(text: str) -> float:
        return reference_dup_ngram_chars(split_words(text), n) / len(text)

    keep, drop = boundary(make, measure, threshold, range(n, len(quote) - 1))
    # A passage repeated enough for 5-grams repeats 10-grams too: each n is tested on its own.
    step = GopherRepetition(top_n_grams=(), dup_n_grams=((n, threshold),))
    assert verdict(step, keep) == "keep"
    assert verdict(step, drop) == f"duplicated_{n}_n_grams"


def test_numpy_ngram_measures_equal_the_string_reference():
    from crucible.trainer.corpus.gopher_repetition import WordNgrams

    words = split_words(" ".join(PARAGRAPHS[:8] + PARAGRAPHS[2:4]))
    grams = WordNgrams(words)
    for n in range(2, 11):
        assert grams.duplicated_ngram_chars(n) == reference_dup_ngram_chars(words, n)
