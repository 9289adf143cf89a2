"""Unicode and whitespace normalisation: one canonical spelling of the same text.

Owns: `Normalise`, a formatter that puts text in NFC, turns every line break into "\\n" and every
Unicode space into " ", removes control and zero-width characters, trims trailing spaces on lines
and collapses runs of blank lines. Must not: change letters, case or punctuation (NFKC would turn
"ﬁ" into "fi" and "²" into "2"; that is a tokenizer's choice, not the corpus').

Why: exact dedup hashes the text and the rules count lines and paragraphs, so "a\\r\\nb" and "a\\nb",
or a decomposed "é" and a composed one, must not count as different. Line structure is kept
(blank-line runs become one blank line, which Gopher's paragraph split treats the same), so the
rules after this step see the paragraphs the author wrote. The Unicode categories used are
Zs (spaces), Cc (controls), Cf (format, e.g. zero-width space, BOM): Unicode Standard §4.5.
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


@cache
def _char_table() -> dict[int, str | None]:
    """Unicode spaces -> " ", controls and format characters -> removed (tab and newline kept)."""
    table: dict[int, str | None] = {}
    for code in range(sys.maxunicode + 1):
        category = unicodedata.category(chr(code))
        if category == "Zs" and code != 0x20:
            table[code] = " "
        elif category in ("Cc", "Cf") and chr(code) not in "\t\n":
            table[code] = None
    return table


def normalise(text: str) -> str:
    text = _LINE_BREAKS.sub("\n", text)
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    text = text.translate(_char_table())
    text = _TRAILING_SPACE.sub("\n", text)
    return _BLANK_RUN.sub("\n\n", text).strip()


@dataclass
class Normalise(Formatter):
    name: ClassVar[str] = "normalise"
    why: ClassVar[str] = "one spelling for the same text (NFC, line breaks, spaces), so hashes and line rules agree"

    def format(self, text: str) -> str:
        return normalise(text)
