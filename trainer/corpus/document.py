"""The record that flows through the corpus steps, and the marker for one that could not be read.

Owns: `Document` (text plus where it came from) and `Malformed` (a record a reader could not turn
into text, with the reason). Must not: parse formats (readers) or decide anything (steps).

Follows datatrove's `Document(text, id, metadata)` (src/datatrove/data.py) and adds two fields the
report and the sharded dedup need: `source` (the configured source name, for per-source counts and
the mixture) and `key`, a global order that does not depend on how files were split into shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A key packs (global file index, record index in that file) into one uint64, so that "keep the
# first copy" in dedup and "the first k samples" in the report mean the same thing whether a run
# used 1 shard or 100. 2**32 records per file and per-run files are far beyond any real input.
RECORD_BITS = 32


def make_key(file_index: int, record_index: int) -> int:
    """The shard-independent order key of record `record_index` in global file `file_index`."""
    if record_index >= 1 << RECORD_BITS:
        raise ValueError(f"more than 2**{RECORD_BITS} records in one file")
    return (file_index << RECORD_BITS) | record_index


@dataclass(slots=True)
class Document:
    """One document: its text, its source name, its id inside that source and its global key."""

    text: str
    id: str
    source: str
    key: int
    metadata: dict[str, Any] = field(default_factory=dict)
    _view: Any = field(default=None, repr=False, compare=False)

    def view(self):
        """Cached word/line splits of the current text (recomputed if a step rewrote the text)."""
        from crucible.trainer.corpus.words import TextView

        if self._view is None or self._view.text is not self.text:
            self._view = TextView(self.text)
        return self._view

    @property
    def size_bytes(self) -> int:
        return self.view().size_bytes

    def to_record(self) -> dict[str, Any]:
        """The JSON object written to shard files (round-trips through `from_record`)."""
        return {"id": self.id, "source": self.source, "key": self.key, "text": self.text,
                "metadata": self.metadata}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Document":
        return cls(text=record["text"], id=record["id"], source=record["source"],
                   key=int(record["key"]), metadata=record.get("metadata") or {})


@dataclass(slots=True)
class Malformed:
    """A record a reader could not turn into a document: counted under `reason`, never dropped
    silently. `raw` is a short excerpt of what was there, for the report's samples. With
    `file_problem`, it stands for the unread rest of the file `id` and `raw` says what was wrong."""

    reason: str
    id: str
    source: str
    key: int
    raw: str = ""
    size_bytes: int = 0
    file_problem: bool = False
