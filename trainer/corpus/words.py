"""Words, punctuation and the cached splits of one text that every rule reads.

Owns: the one word splitter all rules share, the punctuation and sentence-terminal character sets,
the text simplification used for dedup shingles, and `TextView` (a text's words and lines computed
once per document instead of once per filter). Must not: decide to keep or drop anything.

Why our own splitter: datatrove splits English with NLTK's `word_tokenize`, which needs the `punkt`
data downloaded at run time (src/datatrove/utils/word_tokenizers.py); that cannot run offline. This
regex reproduces what matters to the rules from NLTK's Treebank tokenizer (punctuation marks are
their own tokens, a sentence-final "." is split off, "..." is one token, "don't" -> "do" "n't",
"1,000", "3.14", "e.g" and hyphenated words stay whole); bench/corpus_bench.py measures how often
the two lead to different keep/drop decisions.
The terminal-punctuation set is Unicode's Sentence_Terminal property, the source of datatrove's
TERMINAL_PUNCTUATION list (src/datatrove/utils/text.py). `simplify` follows datatrove's
`TextNormConfig` defaults (lowercase, numbers -> 0, punctuation -> space, whitespace collapsed,
diacritics removed), which MinHash shingles are built from.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from functools import cache, cached_property

import regex

# Marks NLTK's Treebank tokenizer always separates from a word; "." ":" "'" are handled below.
_SPLIT = r",;@#$%&?!()\[\]{}<>\"“”«»|`"
_WORD_CHAR = rf"[^\s{_SPLIT}.:']"
_WORD_TOKEN = re.compile(
    rf"""
    \.\.\.+ | …                                    # an ellipsis is one token
    | {_WORD_CHAR}+?(?=n't(?!{_WORD_CHAR}))         # "do" of "don't"
    | n't(?!{_WORD_CHAR})                           # "n't" of "don't"
    | '(?:s|m|d|ll|re|ve|S|M|D|LL|RE|VE)(?!{_WORD_CHAR})   # "'s" of "it's"
    | {_WORD_CHAR}+(?:(?:[.:]|(?<=\d),(?=\d)|'(?!(?:s|m|d|ll|re|ve)(?!{_WORD_CHAR})))(?=\w)
                      {_WORD_CHAR}+)*               # a word; inner . : ' and digit,digit keep it
                                                    # whole (3.14, e.g, 1,000, o'clock)
    | \S                                            # any other mark on its own
    """,
    re.VERBOSE,
)

# Numbers in any script, with an optional decimal part (datatrove TextNormConfig.norm_numbers).
_NUMBER = re.compile(r"\d+(?:[.,،٫]\d+)?")
_WHITESPACE = re.compile(r"\s+")
_COMBINING_MARKS = regex.compile(r"\p{Mn}+")


def split_words(text: str) -> list[str]:
    """Word tokens of `text`, punctuation marks included as their own tokens (see module doc)."""
    return _WORD_TOKEN.findall(text)


@cache
def _char_classes() -> tuple[frozenset[str], frozenset[str], dict[int, str]]:
    """(terminal punctuation, punctuation, translate table punctuation -> space), built once.

    Punctuation means Unicode categories P* (punctuation), S* (symbols) and Cc (controls): the
    families datatrove's hand-written PUNCTUATION string is drawn from.
    """
    every_char = "".join(map(chr, range(sys.maxunicode + 1))).encode("utf-8", "surrogatepass") \
        .decode("utf-8", "ignore")
    terminal = frozenset(regex.findall(r"\p{Sentence_Terminal}", every_char))
    punct = frozenset(c for c in every_char if unicodedata.category(c)[0] in "PS"
                      or unicodedata.category(c) == "Cc") | terminal
    table = {ord(c): " " for c in punct}
    return terminal, punct, table


def terminal_punctuation() -> frozenset[str]:
    """Characters that end a sentence (Unicode Sentence_Terminal: . ! ? 。 ؟ ...)."""
    return _char_classes()[0]


def punctuation() -> frozenset[str]:
    return _char_classes()[1]


def is_symbol_word(word: str, punct: frozenset[str] | None = None) -> bool:
    """True when every character is punctuation: Gopher does not count such tokens as words."""
    punct = punct if punct is not None else punctuation()
    return all(c in punct for c in word)


def simplify(text: str) -> str:
    """Text as MinHash sees it: lowercase, numbers -> "0", punctuation -> " ", diacritics off,
    whitespace collapsed (datatrove TextNormConfig defaults, in datatrove's order)."""
    text = _NUMBER.sub("0", text.lower()).translate(_char_classes()[2])
    text = _WHITESPACE.sub(" ", text).strip()
    if not text.isascii():
        text = _COMBINING_MARKS.sub("", unicodedata.normalize("NFD", text))
    return text


class TextView:
    """Splits of one text, each computed on first use and shared by every rule that reads it."""

    def __init__(self, text: str):
        self.text = text

    @cached_property
    def size_bytes(self) -> int:
        return len(self.text.encode("utf-8"))

    @cached_property
    def words(self) -> list[str]:
        return split_words(self.text)

    @cached_property
    def lines(self) -> list[str]:
        """`str.splitlines()`: the line split of Gopher's bullet/ellipsis rules and of C4."""
        return self.text.splitlines()

    @cached_property
    def nonempty_lines(self) -> list[str]:
        """Lines split on "\\n" that hold more than whitespace (FineWeb's line rules)."""
        return [line for line in self.text.split("\n") if line.strip()]
