"""Real text for the tokenizer tests, and tokenizers trained on it once per session.

Nothing here is written by us: Python's own reference documentation (`pydoc_data.topics`, with
every CPython), the standard library's source code (/usr/lib/python3.11, code with tabs and
long whitespace runs), fortune cookies in English, German, Italian and Spanish and man-db's man
pages in Russian, Japanese and Chinese, rendered by man (`make test-data` installs them; see
tests/corpus/realtext.py, whose readers these fixtures reuse). A missing package fails loudly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.corpus import realtext

STDLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
STDLIB_MODULES = ("argparse.py", "textwrap.py", "tokenize.py", "csv.py", "difflib.py",
                  "json/encoder.py", "email/utils.py", "html/parser.py")


def pydoc_docs() -> list[str]:
    return list(realtext.pydoc_topics().values())


def stdlib_sources() -> list[str]:
    """A few standard-library modules, read as written (code, comments, docstrings)."""
    paths = [STDLIB / name for name in STDLIB_MODULES]
    missing = [p for p in paths if not p.is_file()]
    assert not missing, f"standard-library sources missing: {missing}"
    return [p.read_text(encoding="utf-8") for p in paths]


def fortunes_mixed(per_language: int = 400) -> list[str]:
    """The first cookies of each language's fortune files (one document per cookie)."""
    return [t for lang in ("en", "de", "it", "es") for t in realtext.fortunes(lang)[:per_language]]


def man_pages_non_latin() -> list[str]:
    """man-db's pages in Russian, Japanese and Simplified Chinese, rendered."""
    pages = []
    for lang in ("ru", "ja", "zh_CN"):
        pages += realtext.man_pages(lang)[:3]
    return pages


@dataclass(frozen=True)
class Trained:
    docs: tuple[str, ...]
    bpe: Path
    spm_bpe: Path
    spm_unigram: Path


@pytest.fixture(scope="session")
def corpus_docs() -> tuple[str, ...]:
    """~1.2 MB of mixed real text: prose, code, four Latin-script languages, three others."""
    return tuple(pydoc_docs() + stdlib_sources() + fortunes_mixed() + man_pages_non_latin())


@pytest.fixture(scope="session")
def trained(tmp_path_factory, corpus_docs) -> Trained:
    """One tokenizer of each kind, 2,048 tokens, trained on the mixed corpus."""
    from crucible.trainer.tokenizer import trainers

    root = tmp_path_factory.mktemp("tokenizers")
    paths = {kind: trainers.train(kind, corpus_docs, 2048, root / kind)
             for kind in trainers.KINDS}
    return Trained(corpus_docs, paths["bpe"], paths["spm-bpe"], paths["spm-unigram"])
