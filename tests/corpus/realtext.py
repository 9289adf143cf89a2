"""Real text from Debian packages for the corpus tests; nothing here is written by us.

Sources (installed by `make test-data`, see the Makefile):
  fortunes (en), fortunes-de, fortunes-it, fortunes-es: /usr/share/games/fortunes, one text per
      "%"-separated cookie;
  man-db and other packages' translated man pages: /usr/share/man/<lang>, rendered with `man -l`;
  HTML manuals under /usr/share/doc (e.g. libffi's), package copyright files (many carry the same
      licence text: natural exact and near duplicates), Python's own pydoc topics (pydoc_data).
A missing package fails the test that needs it with the install hint; nothing is skipped.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

FORTUNES = Path("/usr/share/games/fortunes")
FORTUNE_DIRS = {"en": FORTUNES, "de": FORTUNES / "de", "it": FORTUNES / "it", "es": FORTUNES / "es"}
MAN = Path("/usr/share/man")
DOC = Path("/usr/share/doc")
HINT = "run `make test-data` (apt-get install fortunes fortunes-de fortunes-it fortunes-es man-db)"


def _require(path: Path) -> Path:
    if not path.exists():
        raise AssertionError(f"{path} is missing: {HINT}")
    return path


@functools.cache
def fortunes(lang: str) -> tuple[str, ...]:
    """Every cookie of the language's fortune files (not the .dat indexes), in file order."""
    folder = _require(FORTUNE_DIRS[lang])
    texts = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.suffix in (".dat", ".u8") or path.is_symlink():
            continue
        raw = path.read_bytes().decode("utf-8", "replace")
        texts += [t.strip() for t in raw.split("\n%\n") if t.strip()]
    return tuple(texts)


def man_page(path: Path, width: int = 100) -> str:
    """A man page rendered to plain text, as a person reads it."""
    env = {**os.environ, "MANWIDTH": str(width), "MAN_KEEP_FORMATTING": "0", "LC_ALL": "C.UTF-8"}
    out = subprocess.run(["man", "-l", "-E", "UTF-8", str(path)], capture_output=True, env=env,
                         timeout=60, check=True).stdout
    plain = subprocess.run(["col", "-bx"], input=out, capture_output=True, timeout=60,
                           check=True).stdout
    return plain.decode("utf-8", "replace")


# man-db's own pages: translated in full for every language it ships (other packages' translated
# pages often keep English paragraphs, which would blur a language-ID measurement).
MAN_DB_PAGES = ("man1/apropos.1.gz", "man1/lexgrog.1.gz", "man1/man.1.gz", "man1/manpath.1.gz",
                "man1/whatis.1.gz", "man1/zsoelim.1.gz", "man5/manpath.5.gz",
                "man8/accessdb.8.gz", "man8/catman.8.gz", "man8/mandb.8.gz")


def man_pages(lang: str) -> list[str]:
    """man-db's man pages in a language ("en": the untranslated originals), rendered."""
    folder = _require(MAN if lang == "en" else MAN / lang)
    return [man_page(folder / page) for page in MAN_DB_PAGES if (folder / page).is_file()]


def is_prose(text: str) -> bool:
    """Mostly letters: leaves out the fortune files' ASCII-art cookies."""
    letters = sum(c.isalpha() for c in text)
    return letters >= 0.6 * len(text.replace(" ", "").replace("\n", ""))


def html_manuals() -> list[Path]:
    return sorted(p for p in _require(DOC).rglob("*.html") if p.is_file())


def copyright_files() -> list[Path]:
    return sorted(p for p in _require(DOC).glob("*/copyright") if p.is_file())


def pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


@functools.cache
def prose_sentences() -> tuple[str, ...]:
    """English sentences (one line each, 8-40 words, ending in ".") from Python's pydoc topics."""
    import re

    found = []
    for text in pydoc_topics().values():
        for paragraph in re.split(r"\n\s*\n", text):
            flat = " ".join(paragraph.split())
            for sentence in re.split(r"(?<=\.) (?=[A-Z])", flat):
                n_words = len(sentence.split())
                if 8 <= n_words <= 40 and sentence.endswith(".") and "{" not in sentence \
                        and "..." not in sentence and "#" not in sentence:
                    found.append(sentence)
    return tuple(dict.fromkeys(found))


@functools.cache
def prose_words() -> tuple[str, ...]:
    """Alphabetic words of those sentences, in reading order."""
    import re

    return tuple(w for s in prose_sentences() for w in re.findall(r"[A-Za-z]+", s))


def words_by_length() -> dict[int, list[str]]:
    """Distinct prose words grouped by length (for documents with an exact mean word length)."""
    groups: dict[int, list[str]] = {}
    for word in dict.fromkeys(prose_words()):
        groups.setdefault(len(word), []).append(word)
    return groups


def lorem_ipsum_line() -> str:
    """The one placeholder line pip's own documentation carries (python3-pip, conventions.rst)."""
    path = _require(DOC / "python3-pip" / "html" / "development" / "conventions.rst")
    return next(line.strip() for line in path.read_text().splitlines()
                if line.strip().lower().startswith("lorem ipsum"))
