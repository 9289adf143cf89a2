"""Which input files a shard owns, and what `--shard i/N` means.

Owns: `Shard` (index and count, parsed from "i/N", where i may be "auto" to take the Kubernetes
Indexed Job's JOB_COMPLETION_INDEX), `InputFile` (a file with its source, format and global
index), the global file listing and its split across shards. Must not: open files (readers).

Follows datatrove's task split (README "Reading data"): task i of N reads files i, i+N, i+2N, ...
of the sorted listing and a file is never split between tasks. The global file index is the file's
position in that listing (sources in config order, files sorted within a source), so document keys
do not depend on N; do not change the inputs between a run and its resumption.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from crucible.trainer import storage

# Indexed Jobs set this in every pod (Kubernetes docs, "Job: Completion mode").
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"

FORMATS = ("jsonl", "parquet", "text", "html", "warc")
_COMPRESSION = (".gz", ".zst", ".zstd")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: want 0 <= i < N and N >= 1")

    @classmethod
    def parse(cls, spec: str, environ: dict[str, str] | None = None) -> "Shard":
        """"i/N" (0-based i), or "auto/N" to read i from JOB_COMPLETION_INDEX."""
        environ = os.environ if environ is None else environ
        index_text, sep, count_text = spec.partition("/")
        if not sep:
            raise ValueError(f"shard {spec!r}: expected i/N, e.g. 0/4 or auto/4")
        if index_text == "auto":
            if COMPLETION_INDEX_ENV not in environ:
                raise ValueError(f"shard {spec!r}: {COMPLETION_INDEX_ENV} is not set "
                                 "(auto only works inside an Indexed Job)")
            index_text = environ[COMPLETION_INDEX_ENV]
        try:
            return cls(int(index_text), int(count_text))
        except ValueError as err:
            raise ValueError(f"shard {spec!r}: {err}") from None

    def owns(self, position: int) -> bool:
        return position % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class InputFile:
    source: str
    uri: str
    root: str      # the configured path it was found under; ids are relative to it
    format: str
    index: int     # position in the global listing: the high half of its documents' keys

    @property
    def relative_path(self) -> str:
        rest = self.uri[len(self.root):].lstrip("/")
        return rest or self.uri.rsplit("/", 1)[-1]


def stem(uri: str) -> str:
    """The file's name in lower case without a compression suffix (.gz/.zst/.zstd)."""
    name = uri.rsplit("/", 1)[-1].lower()
    for suffix in _COMPRESSION:
        name = name.removesuffix(suffix)
    return name


def detect_format(uri: str) -> str:
    """Format from the file name: .jsonl/.json/.ndjson, .parquet, .html/.htm, .warc; else text.
    A trailing .gz/.zst is a compression, not a format."""
    name = stem(uri)
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".html", ".htm", ".xhtml")):
        return "html"
    if name.endswith((".warc", ".arc")):
        return "warc"
    return "text"


def list_inputs(sources: Iterable) -> list[InputFile]:
    """Every input file of every source (objects with .name, .paths, .format), in global order."""
    files: list[InputFile] = []
    for source in sources:
        for root in source.paths:
            root_dir = root.rsplit("/", 1)[0] if any(c in root.rsplit("/", 1)[-1] for c in "*?[") \
                else root
            for uri in storage.list_files(root):
                fmt = detect_format(uri) if source.format == "auto" else source.format
                files.append(InputFile(source.name, uri, root_dir, fmt, len(files)))
    return files


def files_of(files: list[InputFile], shard: Shard) -> list[InputFile]:
    return [f for f in files if shard.owns(f.index)]
