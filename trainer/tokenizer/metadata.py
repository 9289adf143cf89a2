"""The small metadata file saved beside every trained tokenizer: hash, corpus, settings.

Owns: `tokenizer.meta.json` (beside `tokenizer.json` or `tokenizer.model`) and `CorpusTally`,
which counts and fingerprints the documents a trainer consumes as they stream past, so the file
says exactly which text made the tokenizer without a second pass over it. Must not: train or
encode.

The tokenizer's identity is the SHA-256 of its file (`tokenizer_hash`); shards record it and the
trainer refuses shards made by another tokenizer. The metadata repeats it so a person can match a
tokenizer, its shards and its training text by eye.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

METADATA_SUFFIX = ".meta.json"
FORMAT_VERSION = 1


def tokenizer_hash(path: str | Path) -> str:
    """SHA-256 of the tokenizer file: the identity shards and the trainer compare."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {path} does not exist") from None


def metadata_path(tokenizer_path: str | Path) -> Path:
    """tokenizer.json -> tokenizer.meta.json; tokenizer.model -> tokenizer.meta.json."""
    path = Path(tokenizer_path)
    return path.with_name(path.stem + METADATA_SUFFIX)


@dataclass(frozen=True)
class CorpusStats:
    """What the trainer read: document count, UTF-8 bytes, a fingerprint and where from."""

    documents: int
    bytes: int
    fingerprint: str  # BLAKE2b-128 over every document, each followed by a 0 byte
    sources: tuple[str, ...] = ()


class CorpusTally:
    """Wraps a stream of documents; counts and fingerprints what passes through it."""

    def __init__(self, docs: Iterable[str], sources: Iterable[str] = ()):
        self._docs = docs
        self._hash = hashlib.blake2b(digest_size=16)
        self.documents = 0
        self.bytes = 0
        self.sources = tuple(str(s) for s in sources)

    def __iter__(self) -> Iterator[str]:
        for text in self._docs:
            raw = text.encode("utf-8", "surrogatepass")
            self._hash.update(raw)
            self._hash.update(b"\0")
            self.documents += 1
            self.bytes += len(raw)
            yield text

    def stats(self) -> CorpusStats:
        return CorpusStats(self.documents, self.bytes, self._hash.hexdigest(), self.sources)


def write_metadata(tokenizer_path: str | Path, *, family: str, vocab: dict, corpus: CorpusStats,
                   settings: dict, library: dict[str, str], train_s: float) -> Path:
    """Write tokenizer.meta.json next to the tokenizer; returns its path."""
    tokenizer_path = Path(tokenizer_path)
    doc = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer_path.name,
        "hash": tokenizer_hash(tokenizer_path),
        "family": family,
        "vocab": vocab,
        "corpus": asdict(corpus),
        "settings": settings,
        "library": {**library, "python": platform.python_version()},
        "train_s": round(train_s, 3),
        "created_unix_s": int(time.time()),
    }
    out = metadata_path(tokenizer_path)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return out


def read_metadata(tokenizer_path: str | Path) -> dict | None:
    """The metadata of a tokenizer, or None when it has none (e.g. a downloaded tokenizer.json)."""
    path = metadata_path(tokenizer_path)
    if not path.is_file():
        return None
    return json.loads(path.read_text())
