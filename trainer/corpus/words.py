"""Words, punctuation and the cached splits of one text that every rule reads.

Owns: the one word splitter all rules share, the punctuation and sentence-terminal character sets,
the text simplification used for dedup shingles, and `TextView` (a text's words and lines computed
once per document instead of once per filter). Must not: decide to keep or drop anything.

The word splitter reproduces what datatrove 0.10 splits English with by default: spaCy's
`blank("en")` tokenizer (src/datatrove/utils/word_tokenizers.py, SpaCyTokenizer; datatrove then
drops whitespace tokens). spaCy's algorithm (spacy/tokenizer.pyx, MIT) per whitespace-separated
chunk: a whole-chunk exception ("e.g.", "don't" -> "do" "n't", "cannot" -> "can" "not"; the table
is word_exceptions.py) wins; otherwise prefixes are cut from the left and suffixes from the right
one at a time until none matches or the rest is an exception; what is left is kept whole if it
looks like a URL, else split at infixes (a hyphen or "/" between letters, "." before a capital,
"," between letters ...). The prefix, suffix and infix rules below are spaCy's English ones
(spacy/lang/punctuation.py, spacy/lang/en/punctuation.py, spacy/lang/char_classes.py) with its
explicit letter ranges written as Unicode letter categories. spaCy's second pass, which puts
back together an exception the affix rules cut ("above):" -> "above" "):"), is done within each
chunk. Speed: a chunk's tokens are cached (the same chunks recur), all-letter chunks skip the
rules, and only other first-seen chunks run them. On the HTML corpus of bench/corpus_bench.py
every document's tokens equal spaCy's (docs/corpus.md, "Measured").

Punctuation is datatrove's own set (src/datatrove/utils/text.py: its PUNCTUATION string, ASCII
controls, and TERMINAL_PUNCTUATION), not Unicode's P/S/Cc categories (about 30 times wider), so a
token like "©" or "→" counts as a word in Gopher's rules on both sides; `simplify` replaces
only the PUNCTUATION string, as datatrove's `simplify_text` does. The terminal-punctuation set is
Unicode's Sentence_Terminal property, which datatrove's TERMINAL_PUNCTUATION list was drawn from
(this Unicode version adds 16 characters, e.g. vertical presentation forms, Old Nubian marks and
the one-dot leader "․", and lacks 3 Khmer signs of its 159).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from functools import cache, cached_property

import regex

from crucible.trainer.corpus.word_exceptions import TABLE

# ---- spaCy's English tokenizer rules ---------------------------------------------------------
_A, _AL, _AU = r"\p{L}", r"\p{Ll}\p{Lo}", r"\p{Lu}\p{Lt}\p{Lo}"   # ALPHA, ALPHA_LOWER, _UPPER
_PUNCT = r"…|……|,|:|;|\!|\?|¿|؟|¡|\(|\)|\[|\]|\{|\}|<|>|_|#|\*|&|。|？|！|，|、|；|：|～|·|।|،|۔|؛|٪"
_LIST_PUNCT = _PUNCT.split("|")
_LIST_ELLIPSES = [r"\.\.+", "…"]
_LIST_QUOTES = [r"\'", '"', "”", "“", "`", "‘", "´", "’", "‚", ",", "„", "»", "«", "「", "」",
                "『", "』", "（", "）", "〔", "〕", "【", "】", "《", "》", "〈", "〉", "〈", "〉",
                "⟦", "⟧"]
_CONCAT_QUOTES = "".join(_LIST_QUOTES)
_CURRENCY = (r"\$|£|€|¥|฿|US\$|C\$|A\$|₽|﷼|₴|₠|₡|₢|₣|₤|₥|₦|₧|₨|₩|₪|₫|€|₭|₮|₯|₰|₱|₲|₳|₴|₵|₶|₷|"
             r"₸|₹|₺|₻|₼|₽|₾|₿")
_LIST_ICONS = [r"\p{So}"]      # spaCy lists the So (other symbol) characters explicitly
_HYPHENS = r"-|–|—|--|---|——|~"
_UNITS = ("km|km²|km³|m|m²|m³|dm|dm²|dm³|cm|cm²|cm³|mm|mm²|mm³|ha|µm|nm|yd|in|ft|kg|g|mg|µg|t|lb|"
          "oz|m/s|km/h|kmh|mph|hPa|Pa|mbar|mb|MB|kb|KB|gb|GB|tb|TB|T|G|M|K|%")

_PREFIXES = (["§", "%", "=", "—", "–", r"\+(?![0-9])"] + _LIST_PUNCT + _LIST_ELLIPSES
             + _LIST_QUOTES + _CURRENCY.split("|") + _LIST_ICONS)
_SUFFIXES = (_LIST_PUNCT + _LIST_ELLIPSES + _LIST_QUOTES + _LIST_ICONS
             + ["'s", "'S", "’s", "’S", "—", "–"]
             + [r"(?<=[0-9])\+", r"(?<=°[FfCcKk])\.", rf"(?<=[0-9])(?:{_CURRENCY})",
                rf"(?<=[0-9])(?:{_UNITS})",
                rf"(?<=[0-9{_AL}%²\-\+{_PUNCT}(?:{_CONCAT_QUOTES})])\.",
                rf"(?<=[{_AU}][{_AU}])\."])
_INFIXES = (_LIST_ELLIPSES + _LIST_ICONS
            + [r"(?<=[0-9])[+\-\*^](?=[0-9-])",
               rf"(?<=[{_AL}{_CONCAT_QUOTES}])\.(?=[{_AU}{_CONCAT_QUOTES}])",
               rf"(?<=[{_A}]),(?=[{_A}])",
               rf"(?<=[{_A}0-9])(?:{_HYPHENS})(?=[{_A}])",
               rf"(?<=[{_A}0-9])[:<>=/](?=[{_A}])"])
_PREFIX = regex.compile("|".join("^" + p for p in _PREFIXES))     # first alternative wins
_SUFFIX = regex.compile("|".join(p + "$" for p in _SUFFIXES))     # leftmost match wins
_INFIX = regex.compile("|".join(_INFIXES))
# spaCy's URL_MATCH (spacy/lang/tokenizer_exceptions.py, after Diego Perini's URL regex), with the
# top-level domain's explicit lowercase ranges written as a letter category.
_URL = regex.compile(
    r"^(?:(?:[\w\+\-\.]{2,})://)?(?:\S+(?::\S*)?@)?(?:"
    r"(?!(?:10|127)(?:\.\d{1,3}){3})(?!(?:169\.254|192\.168)(?:\.\d{1,3}){2})"
    r"(?!172\.(?:1[6-9]|2\d|3[0-1])(?:\.\d{1,3}){2})"
    r"(?:[1-9]\d?|1\d\d|2[01]\d|22[0-3])(?:\.(?:1?\d{1,2}|2[0-4]\d|25[0-5])){2}"
    r"(?:\.(?:[1-9]\d?|1\d\d|2[0-4]\d|25[0-4]))"
    r"|(?:(?:[A-Za-z0-9\u00a1-\uffff][A-Za-z0-9\u00a1-\uffff_-]{0,62})?[A-Za-z0-9\u00a1-\uffff]\.)+"
    r"(?:[\p{Ll}\p{Lo}]{2,63}))(?::\d{2,5})?(?:[/?#]\S*)?$")

_EXCEPTIONS: dict[str, tuple[str, ...]] = {}
for _entry in TABLE.split("  "):
    if _entry:
        _text, *_tokens = _entry.split(" ")
        _EXCEPTIONS[_text] = tuple(_tokens) or (_text,)
_CACHE: dict[str, tuple[str, ...]] = dict(_EXCEPTIONS)   # chunk -> tokens; exceptions preloaded
_CACHE_MAX = 1 << 18        # chunks; past this, new chunks are split but not remembered


def _split_chunk(chunk: str, exceptions: dict[str, tuple[str, ...]] = _EXCEPTIONS) \
        -> tuple[str, ...]:
    """spaCy's affix loop and infix split for one whitespace-free chunk (spacy/tokenizer.pyx,
    Tokenizer._split_affixes and _attach_tokens), then its second pass: a run of tokens that
    spells an exception the rules split (":)" cut as ")" ":" ...) becomes that exception."""
    if chunk in exceptions:
        return exceptions[chunk]
    if chunk.isalpha():
        return (chunk,)
    tokens = _affix_split(chunk, exceptions)
    if len(tokens) > 1 and exceptions:
        merged: list[str] = []
        i = 0
        while i < len(tokens):
            for width in range(min(_MERGE_WIDTH, len(tokens) - i), 1, -1):
                run = _MERGE.get(tokens[i:i + width])
                if run is not None:
                    merged += run
                    i += width
                    break
            else:
                merged.append(tokens[i])
                i += 1
        tokens = tuple(merged)
    return tokens


def _suffix_length(string: str) -> int:
    """Length of spaCy's suffix of `string` (the leftmost suffix rule that matches up to the
    end), searched in the last 12 characters only: every rule but the ellipsis matches at most 6
    characters after a 2-character lookbehind, and a longer run of dots is measured here."""
    if not string:
        return 0
    last = string[-1]
    if last.isascii() and last.isalnum() and (last.isdigit() or not (
            string.endswith(("'s", "'S", "’s", "’S")) or any(c.isdigit() for c in string[-7:-1]))):
        return 0                # a letter ends a suffix only as a unit after a digit, or 's
    window = string[-12:]
    match = _SUFFIX.search(window)
    if match is None:
        return 0
    if match.start() == 0 and len(string) > 12 and window[0] == ".":
        return len(string) - len(string.rstrip("."))
    return match.end() - match.start()


def _affix_split(chunk: str, exceptions: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    prefixes: list[str] = []
    suffixes: list[str] = []
    string, last_size = chunk, -1
    while string and len(string) != last_size:
        if string in exceptions:
            break
        last_size = len(string)
        if string[0].isascii() and string[0].isalnum() and string[0] not in "UCA":
            pre_len = 0         # no prefix rule starts with an ASCII letter or digit but US$ C$ A$
        else:
            match = _PREFIX.match(string)
            pre_len = match.end() if match else 0
        if pre_len and string[pre_len:] in exceptions:
            prefixes.append(string[:pre_len])
            string = string[pre_len:]
            break
        suf_len = _suffix_length(string[pre_len:])
        if suf_len and string[:-suf_len] in exceptions:
            suffixes.append(string[-suf_len:])
            string = string[:-suf_len]
            break
        if pre_len and suf_len and pre_len + suf_len <= len(string):
            prefixes.append(string[:pre_len])
            suffixes.append(string[-suf_len:])
            string = string[pre_len:-suf_len]
        elif pre_len:
            prefixes.append(string[:pre_len])
            string = string[pre_len:]
        elif suf_len:
            suffixes.append(string[-suf_len:])
            string = string[:-suf_len]
    tokens = prefixes
    if string in exceptions:
        tokens.extend(exceptions[string])
    elif string and _URL.match(string):
        tokens.append(string)
    elif string:
        start = 0
        for match in _INFIX.finditer(string):
            infix_start, infix_end = match.span()
            if infix_start == 0:        # spaCy skips an infix at the very start
                continue
            if infix_start != start:
                tokens.append(string[start:infix_start])
            if infix_start != infix_end:
                tokens.append(string[infix_start:infix_end])
            start = infix_end
        if string[start:]:
            tokens.append(string[start:])
    tokens.extend(reversed(suffixes))
    return tuple(tokens)


# The second pass's table: an exception's tokens as the rules alone cut it -> the exception's.
_MERGE = {cut: _EXCEPTIONS[text] for text in _EXCEPTIONS
          if len(cut := _split_chunk(text, {})) > 1}
_MERGE_WIDTH = max(map(len, _MERGE))


def split_words(text: str) -> list[str]:
    """Word tokens of `text` as spaCy's English tokenizer splits them, whitespace dropped
    (punctuation marks are tokens of their own: see the module doc)."""
    out: list[str] = []
    cached = _CACHE
    for chunk in text.split():
        tokens = cached.get(chunk)
        if tokens is None:
            tokens = _split_chunk(chunk)
            if len(cached) < _CACHE_MAX:
                cached[chunk] = tokens
        out += tokens
    return out


# datatrove's PUNCTUATION string (src/datatrove/utils/text.py), ASCII controls but \t \n \r
# excluded as there: "１" (fullwidth one) and "━" are in it, "‘", "§" and "©" are not.
_DATATROVE_PUNCTUATION = (
    "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»"
    + "".join(map(chr, (x for a, b in ((0, 9), (11, 13), (13, 32), (127, 160))
                        for x in range(a, b)))))
# Numbers in any script, with an optional decimal part (datatrove NUMBERS_PATTERN).
_NUMBER = re.compile(r"\d+(?:[.,،٫⎖⎗⎘]\d+)?")
_WHITESPACE = re.compile(r"\s+")
_COMBINING_MARKS = regex.compile(r"\p{Mn}+")


@cache
def _char_classes() -> tuple[frozenset[str], frozenset[str], dict[int, str]]:
    """(terminal punctuation, punctuation, translate table punctuation -> space), built once."""
    every_char = "".join(map(chr, range(sys.maxunicode + 1))).encode("utf-8", "surrogatepass") \
        .decode("utf-8", "ignore")
    terminal = frozenset(regex.findall(r"\p{Sentence_Terminal}", every_char))
    punct = frozenset(_DATATROVE_PUNCTUATION) | terminal
    table = {ord(c): " " for c in _DATATROVE_PUNCTUATION}
    return terminal, punct, table


def terminal_punctuation() -> frozenset[str]:
    """Characters that end a sentence (Unicode Sentence_Terminal: . ! ? 。 ؟ ...)."""
    return _char_classes()[0]


def punctuation() -> frozenset[str]:
    """datatrove's PUNCTUATION_SET: its punctuation string plus the terminal punctuation."""
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
        text = _COMBINING_MARKS.sub("", unicodedata.normalize("NFD", text)).strip()
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
