"""Unicode and whitespace normalisation: one canonical spelling of the same text.

Owns: `Normalise`, a formatter that puts text in NFC, turns every line break into "\\n" and every
Unicode space into " ", removes control characters and the invisible format characters that are
noise (`_NOISE`), trims trailing spaces on lines and collapses runs of blank lines. Must not: change
letters, case or punctuation (NFKC would turn "ﬁ" into "fi" and "²" into "2"; that is a tokenizer's
choice, not the corpus'), or remove a format character that a script needs to be spelled right.

Why: exact dedup hashes the text and the rules count lines and paragraphs, so "a\\r\\nb" and "a\\nb",
or a decomposed "é" and a composed one, must not count as different. Line structure is kept
(blank-line runs become one blank line, which Gopher's paragraph split treats the same), so the
rules after this step see the paragraphs the author wrote. The Unicode categories used are
Zs (spaces) and Cc (controls), Unicode Standard §4.5; the format characters (Cf) are chosen one by
one, because most of them are part of how a script is written (§23.2 "Layout Controls", UAX #9 for
the bidirectional ones, UTS #51 for emoji tag sequences).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

from crucible.trainer.corpus.step import Formatter

_LINE_BREAKS = re.compile(r"\r\n|[\r\u2028\u2029\x0b\x0c\x85]")
_TRAILING_SPACE = re.compile(r"[ \t]+\n")
_BLANK_RUN = re.compile(r"\n{3,}")

# Format characters (Cf) removed: none of them changes which letters are written or how they are
# shaped, and each is more often noise than intent in web text, so keeping them would make the same
# sentence hash differently. Every other Cf character is kept: deleting one of those corrupts a
# script, while keeping a rare invisible one costs at most a missed exact duplicate.
_NOISE = frozenset([
    0x00AD,     # SOFT HYPHEN: a hyphenation hint, invisible unless a line breaks there
    # ZERO WIDTH SPACE: a line-break hint. Thai, Khmer, Lao and Burmese text uses it to mark word
    # boundaries, but so inconsistently that the same sentence comes with and without it; the
    # letters read the same either way.
    0x200B,
    0x2060,     # WORD JOINER: forbids a line break, nothing else (U+FEFF's modern spelling)
    # BOM / ZERO WIDTH NO-BREAK SPACE: encoding residue at the start of a file or of a concatenated
    # part; its in-text use is deprecated in favour of U+2060.
    0xFEFF,
    # Explicit bidi formatting: embeddings and overrides (LRE RLE PDF LRO RLO) and isolates (LRI
    # RLI FSI PDI). They change display order only, never the logical order a model reads; they
    # are paired state, so a cut text with an unclosed one flips the rest of its paragraph; and an
    # override makes what is displayed differ from what is stored (the "Trojan Source" attack,
    # CVE-2021-42574). The implicit marks LRM, RLM and ALM (U+200E, U+200F, U+061C) are kept:
    # single characters with no state, typed by Persian, Arabic and Hebrew writers (the Persian and
    # Hebrew standard keyboard layouts have them) to place numbers and Latin words.
    *range(0x202A, 0x202F), *range(0x2066, 0x206A),
    # Deprecated since Unicode 3.0 (symmetric swapping, Arabic form shaping, digit shapes):
    # "strongly discouraged", and the shaping ones override what the letters say.
    *range(0x206A, 0x2070),
])
# Kept on purpose (all Cf):
# - U+200C ZERO WIDTH NON-JOINER and U+200D ZERO WIDTH JOINER: part of the spelling. Persian
#   writes "می‌خواهم" with a ZWNJ between the prefix and the verb; Indic scripts pick a conjunct,
#   half form or explicit virama with them ("क्‍ष" vs "क्ष"), Malayalam older chillu spellings use a
#   ZWJ, Sinhala forms ligatures with it; emoji ZWJ sequences ("👩‍💻") are one character to a reader.
# - U+0600-0605, U+0890-0891, U+06DD, U+08E2 (Arabic number, year, page and end-of-ayah signs),
#   U+070F (Syriac abbreviation), U+110BD/U+110CD (Kaithi number signs): visible marks that span
#   the digits after them.
# - U+180E MONGOLIAN VOWEL SEPARATOR: selects the final form of the vowel that follows.
# - U+2061-2064: invisible times, plus, separator and function application in mathematical text.
# - U+13430-13438 (Egyptian hieroglyph layout), U+1BCA0-1BCA3 (Duployan shorthand), U+1D173-1D17A
#   (musical beams, ties, slurs, phrases): they say how the signs around them are arranged.
# - U+FFF9-FFFB (interlinear annotation): removing them would run an annotation into its base text.
# - Tag characters (U+E0001-E007F) only inside an emoji tag sequence, see `_stray_tags`.

# An emoji tag sequence (UTS #51, "Emoji Tag Sequences"): a black flag, tag letters and a CANCEL
# TAG, e.g. the flag of Scotland 🏴 + "gbsct" in tags + U+E007F. Only the black flag has such
# sequences (the RGI flags of England, Scotland and Wales). Any other run of tag characters is
# invisible: the deprecated language tags (U+E0001), or text hidden from a reader ("ASCII
# smuggling" of instructions), so it goes.
_TAG_RUN = re.compile(r"[\U000E0000-\U000E007F]+")   # no optional flag group: ~9x faster search
_FLAG_TAGS = re.compile(r"[\U000E0020-\U000E007E]+\U000E007F")
_BLACK_FLAG = "\U0001F3F4"


def _stray_tags(match: re.Match) -> str:
    start = match.start()
    after_flag = start > 0 and match.string[start - 1] == _BLACK_FLAG
    return match.group() if after_flag and _FLAG_TAGS.fullmatch(match.group()) else ""


@cache
def _char_table() -> dict[int, str | None]:
    """Unicode spaces -> " ", controls and noise format characters -> removed (tab and newline
    kept)."""
    table: dict[int, str | None] = {}
    for code in range(sys.maxunicode + 1):
        category = unicodedata.category(chr(code))
        if category == "Zs" and code != 0x20:
            table[code] = " "
        elif category == "Cc" and chr(code) not in "\t\n":
            table[code] = None
    table.update(dict.fromkeys(_NOISE))
    return table


def normalise(text: str) -> str:
    text = _LINE_BREAKS.sub("\n", text)
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
        text = _TAG_RUN.sub(_stray_tags, text)
    text = text.translate(_char_table())
    text = _TRAILING_SPACE.sub("\n", text)
    return _BLANK_RUN.sub("\n\n", text).strip()


@dataclass
class Normalise(Formatter):
    name: ClassVar[str] = "normalise"
    why: ClassVar[str] = "one spelling for the same text (NFC, line breaks, spaces), so hashes and line rules agree"

    def format(self, text: str) -> str:
        return normalise(text)
