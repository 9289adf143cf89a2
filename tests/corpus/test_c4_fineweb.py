"""C4 and FineWeb reasons on real text, just inside and just outside their thresholds.

Sentences come from Python's pydoc topics; the placeholder line from pip's documentation; the
code line from libffi's HTML manual is replaced by one from the same pydoc text that has a brace.
"""

from __future__ import annotations

import pytest

from crucible.trainer.corpus.c4 import C4Quality, count_sentences
from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.fineweb import FineWebQuality
from tests.corpus import realtext

SENTENCES = realtext.prose_sentences()


def run(step, text: str) -> tuple[str, str]:
    d = Document(text=text, id="t", source="test", key=0)
    outcome = step.process(d)
    return (outcome if isinstance(outcome, str) else "keep"), d.text


# ---- C4 ---------------------------------------------------------------------------------------
def test_five_sentences_kept_four_dropped():
    step = C4Quality()
    assert run(step, "\n".join(SENTENCES[:5]))[0] == "keep"
    assert run(step, "\n".join(SENTENCES[:4]))[0] == "too_few_sentences"


def test_sentences_are_counted_inside_a_line():
    assert count_sentences(" ".join(SENTENCES[:3])) == 3


def test_lorem_ipsum_page_dropped_and_kept_without_it():
    step = C4Quality()
    page = list(SENTENCES[:6])
    assert run(step, "\n".join(page))[0] == "keep"
    placeholder = realtext.lorem_ipsum_line()
    assert run(step, "\n".join(page + [placeholder]))[0] == "lorem_ipsum"


def test_curly_bracket_page_dropped_and_kept_without_it():
    code = next(line.strip() for text in realtext.pydoc_topics().values()
                for line in text.splitlines() if "{" in line and len(line.split()) >= 3
                and line.strip().endswith("."))
    step = C4Quality()
    assert run(step, "\n".join(SENTENCES[:6]))[0] == "keep"
    assert run(step, "\n".join([*SENTENCES[:6], code]))[0] == "curly_bracket"


def test_line_rules_remove_lines_and_count_them():
    step = C4Quality()
    lines = [*SENTENCES[:6],
             "Enable JavaScript in your browser to see the examples.",      # javascript
             "By using this site you agree to the terms of use.",            # policy
             "See also.",                                                    # too few words
             SENTENCES[7].rstrip("."),                                       # no terminal mark
             "x" * 1001 + " is one word that is far too long."]             # too long a word
    verdict, text = run(step, "\n".join(lines))
    assert verdict == "keep"
    assert text.split("\n") == list(SENTENCES[:6])
    assert step.counters == {"line-total": 11, "line-kept": 6, "line-filter-javascript": 1,
                             "line-filter-policy": 1, "line-filter-too_few_words": 1,
                             "line-filter-no_terminal_punc": 1, "line-filter-too_long_word": 1}


def test_fineweb_setting_keeps_lines_without_terminal_punctuation():
    step = C4Quality(filter_no_terminal_punct=False)
    lines = [s.rstrip(".") for s in SENTENCES[:5]]
    verdict, text = run(step, "\n".join(lines))
    assert verdict == "keep" and text == "\n".join(lines)


def test_three_words_per_line_kept_two_removed():
    step = C4Quality(min_num_sentences=1)
    verdict, text = run(step, "\n".join([SENTENCES[0], "Return value.", "Return the value."]))
    assert verdict == "keep"
    assert text.split("\n") == [SENTENCES[0], "Return the value."]


# ---- FineWeb ----------------------------------------------------------------------------------
def test_blank_text_is_empty():
    assert run(FineWebQuality(), " \n \n")[0] == "empty"


def test_line_punctuation_ratio_12_percent():
    short = [s.rstrip(".") for s in SENTENCES[20:60]]

    def text(n_lines: int) -> str:   # 3 lines end in "."; the rest have no final mark
        return "\n".join([*SENTENCES[:3], *short[:n_lines - 3]])

    step = FineWebQuality(char_duplicates_ratio=1, new_line_ratio=1)
    assert run(step, text(25))[0] == "keep"                       # 3/25 = 0.12
    assert run(step, text(26))[0] == "line_punct_ratio"           # 3/26 = 0.115


def test_short_line_ratio_67_percent():
    short = [w for w in dict.fromkeys(realtext.prose_words()) if 5 < len(w) <= 30][:200]
    long_lines = [s for s in SENTENCES if len(s) > 30]

    def text(n_short: int, n_long: int) -> str:
        return "\n".join([*long_lines[:n_long], *(w + "." for w in short[:n_short])])

    step = FineWebQuality(new_line_ratio=1)
    assert run(step, text(67, 33))[0] == "keep"                   # 0.67
    assert run(step, text(68, 32))[0] == "short_line_ratio"       # 0.68


def test_duplicated_line_characters_1_percent():
    repeated = SENTENCES[100]

    def make(n_unique: int) -> str:
        return "\n".join([repeated, *SENTENCES[:n_unique], repeated])

    def ratio(text: str) -> float:
        return len(repeated) / len(text.replace("\n", ""))

    n = next(n for n in range(10, 1000) if ratio(make(n)) <= 0.01)
    step = FineWebQuality()
    assert ratio(make(n - 1)) > 0.01
    assert run(step, make(n))[0] == "keep"
    assert run(step, make(n - 1))[0] == "char_dup_ratio"


def test_newlines_per_word_30_percent():
    # Lines of 2 real words and a final mark ("a b." is 3 tokens, 1 newline): the ratio climbs
    # towards 1/3 as lines are added, crossing 0.3 at a known count.
    from crucible.trainer.corpus.words import split_words

    # Words the splitter keeps whole ("cannot" would be two tokens).
    words = [w for w in realtext.prose_words() if len(w) > 3 and split_words(w) == [w]]
    lines = [" ".join(words[2 * i:2 * i + 2]) + "." for i in range(400)]

    def text(n_plain: int, n_list: int) -> str:
        return "\n".join([" ".join(SENTENCES[:n_plain]), *lines[:n_list]])

    def ratio(t: str) -> float:
        return t.count("\n") / len(split_words(t))

    step = FineWebQuality(short_line_thr=1, char_duplicates_ratio=1)   # this rule alone
    n_plain = 5
    n_list = max(n for n in range(1, 400) if ratio(text(n_plain, n)) <= 0.3)
    assert run(step, text(n_plain, n_list))[0] == "keep"
    assert run(step, text(n_plain, n_list + 1))[0] == "list_ratio"
