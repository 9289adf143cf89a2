"""Real text nobody here wrote, as lists of documents for tokenizer and training tests.

Python's own reference documentation (`pydoc_data.topics`, with every CPython), the standard
library's source code (code with tabs and long whitespace runs), fortune cookies in English,
German, Italian and Spanish and man-db's man pages in Russian, Japanese and Chinese, rendered by
man (`make test-data` installs them). The readers are tests/corpus/realtext.py's; a missing
package fails loudly.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.corpus import realtext

STDLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
STDLIB_MODULES = ("argparse.py", "textwrap.py", "tokenize.py", "csv.py", "difflib.py",
                  "json/encoder.py", "email/utils.py", "html/parser.py")


def pydoc_docs() -> list[str]:
    """Python's reference documentation, one document per pydoc topic (~460 kB), sorted by key."""
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
