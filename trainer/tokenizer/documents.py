"""The documents a tokenizer is trained on, measured on and encoded from, and their split.

Owns: turning input paths into a stream of document texts (through the corpus pipeline's own
readers: JSONL, .gz/.zst, Parquet, plain-text trees, WARC; a `crucible corpus run` output folder
is read from its final stage), and the train/held-out split by document. Must not: judge text
quality (the corpus pipeline does) or tokenize.

The split is a pure function of (seed, position, text): BLAKE2b of both, compared with the
fraction. It never cuts a document in two, does not depend on batch sizes or worker counts, and
is the same in `train`, `sweep` and `encode`, so a tokenizer trained by `train` has never seen the
documents `encode` puts in the validation shards.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from crucible.trainer import storage
from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.readers import Reader
from crucible.trainer.corpus.shards import list_inputs

# A corpus run writes its stages to these folders; the last one present is its output
# (trainer/corpus/pipeline.py, `final_folder`: mixed if a mixture is configured, else deduped,
# else filtered). `run.json` marks a corpus run folder.
CORPUS_STAGES = ("mixed", "deduped", "filtered")
CORPUS_RUN_MARKER = "run.json"


class DocumentError(ValueError):
    """Inputs that yield no documents; the message says which and why."""


@dataclass(frozen=True)
class _Source:  # what `list_inputs` needs of a source: name, paths, format
    name: str
    paths: tuple[str, ...]
    format: str = "auto"


def resolve_input(path: str) -> str:
    """A corpus run folder becomes its final stage folder; anything else is returned as is."""
    local = Path(path)
    if local.is_dir() and (local / CORPUS_RUN_MARKER).is_file():
        for stage in CORPUS_STAGES:
            if any((local / stage).glob("*.jsonl*")):
                return str(local / stage)
        raise DocumentError(f"{path} is a corpus run folder without output; finish it with "
                            "`crucible corpus run`")
    return path


class DocumentSource:
    """Document texts from `paths`, in a fixed order (sources as given, files sorted), with counts.

    Re-iterable: each iteration reads the inputs again. `max_bytes` stops after the document that
    reaches that many UTF-8 bytes. Malformed records (bad JSON, missing text, ...) are skipped and
    counted by reason in `malformed`.
    """

    def __init__(self, paths: Sequence[str], *, text_field: str = "text",
                 max_bytes: int | None = None):
        if not paths:
            raise DocumentError("no inputs given")
        self.paths = tuple(resolve_input(str(p)) for p in paths)
        empty = [p for p in self.paths if not storage.list_files(p)]
        if empty:
            raise DocumentError(f"no input files at {', '.join(empty)}")
        self.files = list_inputs([_Source("input", self.paths)])
        self.reader = Reader(text_field=text_field)
        self.max_bytes = max_bytes
        self.malformed: Counter[str] = Counter()
        self.documents = self.bytes = 0

    def __iter__(self) -> Iterator[str]:
        self.malformed.clear()
        self.documents = self.bytes = 0
        for file in self.files:
            for record in self.reader.read(file):
                if not isinstance(record, Document):
                    self.malformed[record.reason] += 1
                    continue
                self.documents += 1
                self.bytes += len(record.text.encode("utf-8", "surrogatepass"))
                yield record.text
                if self.max_bytes is not None and self.bytes >= self.max_bytes:
                    return


def is_held_out(index: int, text: str, fraction: float, seed: int = 0) -> bool:
    """Whether document `index` (its position in the stream) with `text` is held out."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}:".encode() + text.encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def split_stream(docs: Iterable[str], fraction: float, seed: int = 0,
                 keep: str = "train") -> Iterator[str]:
    """Only the documents of one side of the split ("train" or "held_out"), streaming."""
    want_held = keep == "held_out"
    for index, text in enumerate(docs):
        if is_held_out(index, text, fraction, seed) == want_held:
            yield text


def split_documents(docs: Iterable[str], fraction: float,
                    seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held_out) lists; every document lands in exactly one."""
    train: list[str] = []
    held: list[str] = []
    for index, text in enumerate(docs):
        (held if is_held_out(index, text, fraction, seed) else train).append(text)
    return train, held
