"""The word splitter and the C4 sentence count against what datatrove's default English splitter
(spaCy 3.8.18 `blank("en")` + sentencizer) returns for the same strings.

The strings are of the kinds found in the Node.js, npm and Nettle manuals that
bench/corpus_bench.py reads, where the earlier splitter (which imitated NLTK's) and spaCy split
differently and Gopher quality, Gopher repetition and near dedup decided differently as a result.
Expected tokens and counts were produced by spaCy and are pinned here; the benchmark checks the
whole corpus (every document's tokens equal spaCy's there).
"""

from __future__ import annotations

import pytest

from crucible.trainer.corpus.c4 import count_sentences
from crucible.trainer.corpus.words import is_symbol_word, punctuation, simplify, split_words

CASES = [
    # exceptions: abbreviations stay whole, contractions and "cannot" split
    ("Use e.g. a Buffer, etc.", ["Use", "e.g.", "a", "Buffer", ",", "etc", "."]),
    ("You cannot do it; don't.", ["You", "can", "not", "do", "it", ";", "do", "n't", "."]),
    ("U.S. and Mr. Smith at 5pm.", ["U.S.", "and", "Mr.", "Smith", "at", "5", "pm", "."]),
    ("id", ["i", "d"]),
    # infixes: a hyphen, ":" or "/" between letters, "." before a capital
    ("The built-in 64-bit type.", ["The", "built", "-", "in", "64", "-", "bit", "type", "."]),
    ("const { Buffer } = require('node:buffer');",
     ["const", "{", "Buffer", "}", "=", "require('node", ":", "buffer", "'", ")", ";"]),
    ("An instance of net.Socket or foo.bar.",
     ["An", "instance", "of", "net", ".", "Socket", "or", "foo.bar", "."]),
    ("Node-API (N-API) is stable...",
     ["Node", "-", "API", "(", "N", "-", "API", ")", "is", "stable", "..."]),
    # no infix rule fires: kept whole
    ("amd64->IR and x86->IR", ["amd64->IR", "and", "x86->IR"]),
    ("See https://www.npmjs.com/forgot for details.",
     ["See", "https://www.npmjs.com/forgot", "for", "details", "."]),
    # prefixes and suffixes, one character at a time
    ("if (a == b) {", ["if", "(", "a", "=", "=", "b", ")", "{"]),
    ("Nettle’s API costs $5 for 10km.",
     ["Nettle", "’s", "API", "costs", "$", "5", "for", "10", "km", "."]),
    # the second pass: an exception cut by the affix rules is put back together
    ("(see above):", ["(", "see", "above", "):"]),
    ("Call it :) twice", ["Call", "it", ":)", "twice"]),
    ("It is ''quoted'' here", ["It", "is", "''", "quoted", "''", "here"]),
]


@pytest.mark.parametrize("text,tokens", CASES)
def test_split_words_as_spacy(text, tokens):
    assert split_words(text) == tokens


def test_split_words_drops_every_whitespace():
    assert split_words("a\u00a0b\tc\n\nd  e") == ["a", "b", "c", "d", "e"]


def test_a_long_run_of_dots_is_one_suffix():
    assert split_words("wait" + "." * 20) == ["wait", "." * 20]


@pytest.mark.parametrize("line,sentences", [
    ("Hi!! There.", 2), ("(Yes.) No.", 2), ("Use e.g. this one.", 1),
    ("Stop.\u00a0\u00a0[..]", 2),        # a whitespace run other than " " is a token
    ("Wait... no. Go on.", 2), ("It ends here.  Then more.", 2)])
def test_count_sentences_as_spacy_sentencizer(line, sentences):
    assert count_sentences(line) == sentences


def test_punctuation_is_datatrove_set():
    # "→" and "©" are not in datatrove's PUNCTUATION string: they count as words for Gopher.
    assert is_symbol_word("...") and is_symbol_word("}") and is_symbol_word("１")
    assert is_symbol_word("->")
    assert not is_symbol_word("→") and not is_symbol_word("©") and not is_symbol_word("‘")
    assert "。" in punctuation()            # terminal punctuation is included, as in datatrove


def test_simplify_replaces_only_datatrove_punctuation():
    assert simplify("Node.js’s API: v1.2, (c) 2024!") == "node js s api v0 c 0"
    assert simplify("‘quoted’ © 2024") == "‘quoted © 0"     # "‘" and "©" are not in it
