"""Readers: one input file -> its records, each a `Document` or a counted `Malformed`.

Owns: JSONL (plain, .gz, .zst), Parquet, plain-text files (one document per file, e.g. a tree of
manuals), HTML files (marked for extraction) and WARC response records (warcio). Every record gets
the source name, an id (the record's own id field, else "<relative path>#<line>", or the path for
one-document files) and its global key. Must not: decide what is good text (steps do).

Malformed input never crashes a run and never vanishes: bad UTF-8 (`bad_utf8`), lines that are
not JSON objects (`bad_json`), a missing or non-string text field (`missing_text`), blank text
(`empty_text`), blank JSONL lines (`blank_line`) become `Malformed` records that the pipeline
counts like any other drop, with a sample. Follows datatrove's readers (src/datatrove/pipeline/
readers/: jsonl, parquet, warc) for field names and WARC handling: only HTTP responses whose
content type is HTML become documents; the URL goes into metadata.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from typing import IO, Iterator

from crucible.trainer import storage
from crucible.trainer.corpus.document import Document, Malformed, make_key
from crucible.trainer.corpus.shards import InputFile

Record = Document | Malformed
RAW_EXCERPT_BYTES = 200   # how much of a malformed record the report shows


@contextlib.contextmanager
def _decompressed(uri: str) -> Iterator[IO[bytes]]:
    with contextlib.closing(storage.open_read(uri)) as raw:
        name = uri.lower()
        if name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw) as stream:
                yield stream
        elif name.endswith((".zst", ".zstd")):
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(raw) as stream:
                yield storage.buffered(stream)
        else:
            yield raw


def _excerpt(raw: bytes) -> str:
    return raw[:RAW_EXCERPT_BYTES].decode("utf-8", "replace")


class Reader:
    """Turns one file into records. `text_field` / `id_field` name the JSON or Parquet columns."""

    def __init__(self, text_field: str = "text", id_field: str = "id"):
        self.text_field = text_field
        self.id_field = id_field

    def read(self, file: InputFile) -> Iterator[Record]:
        method = getattr(self, f"_read_{file.format}")
        yield from method(file)

    def _record(self, file: InputFile, position: int, text: object, doc_id: str,
                raw: bytes, metadata: dict | None = None) -> Record:
        key = make_key(file.index, position)
        if not isinstance(text, str):
            return Malformed("missing_text", doc_id, file.source, key, _excerpt(raw), len(raw))
        if not text.strip():
            return Malformed("empty_text", doc_id, file.source, key, _excerpt(raw), len(raw))
        return Document(text, doc_id, file.source, key, metadata or {})

    def _read_jsonl(self, file: InputFile) -> Iterator[Record]:
        with _decompressed(file.uri) as stream:
            for position, line in enumerate(stream):
                fallback_id = f"{file.relative_path}#{position + 1}"
                key = make_key(file.index, position)
                if not line.strip():
                    yield Malformed("blank_line", fallback_id, file.source, key, "", len(line))
                    continue
                try:
                    obj = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    yield Malformed("bad_utf8", fallback_id, file.source, key, _excerpt(line),
                                    len(line))
                    continue
                except json.JSONDecodeError:
                    yield Malformed("bad_json", fallback_id, file.source, key, _excerpt(line),
                                    len(line))
                    continue
                if not isinstance(obj, dict):
                    yield Malformed("bad_json", fallback_id, file.source, key, _excerpt(line),
                                    len(line))
                    continue
                doc_id = obj.get(self.id_field)
                metadata = {k: v for k, v in obj.items() if k not in (self.text_field, self.id_field)}
                yield self._record(file, position, obj.get(self.text_field),
                                   fallback_id if doc_id is None else str(doc_id), line, metadata)

    def _read_parquet(self, file: InputFile) -> Iterator[Record]:
        import pyarrow.parquet as pq

        with contextlib.closing(storage.seekable_copy(file.uri)) as stream:
            parquet = pq.ParquetFile(stream)
            names = set(parquet.schema_arrow.names)
            columns = [c for c in (self.text_field, self.id_field) if c in names]
            position = 0
            for batch in parquet.iter_batches(columns=columns or None):
                rows = batch.to_pydict()
                texts = rows.get(self.text_field, [None] * batch.num_rows)
                ids = rows.get(self.id_field, [None] * batch.num_rows)
                for text, doc_id in zip(texts, ids):
                    doc_id = f"{file.relative_path}#{position + 1}" if doc_id is None else str(doc_id)
                    raw = (text or "").encode("utf-8", "replace") if isinstance(text, str) else b""
                    yield self._record(file, position, text, doc_id, raw)
                    position += 1

    def _whole_file(self, file: InputFile, metadata: dict) -> Iterator[Record]:
        with _decompressed(file.uri) as stream:
            raw = stream.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield Malformed("bad_utf8", file.relative_path, file.source, make_key(file.index, 0),
                            _excerpt(raw), len(raw))
            return
        yield self._record(file, 0, text, file.relative_path, raw, metadata)

    def _read_text(self, file: InputFile) -> Iterator[Record]:
        yield from self._whole_file(file, {"path": file.relative_path})

    def _read_html(self, file: InputFile) -> Iterator[Record]:
        yield from self._whole_file(file, {"path": file.relative_path, "format": "html"})

    def _read_warc(self, file: InputFile) -> Iterator[Record]:
        from warcio.archiveiterator import ArchiveIterator

        with contextlib.closing(storage.open_read(file.uri)) as stream:
            position = 0
            for record in ArchiveIterator(stream):
                if record.rec_type != "response" or record.http_headers is None:
                    continue
                content_type = record.http_headers.get_header("Content-Type") or ""
                if "html" not in content_type.lower():
                    continue
                raw = record.content_stream().read()
                doc_id = record.rec_headers.get_header("WARC-Record-ID") or \
                    f"{file.relative_path}#{position + 1}"
                url = record.rec_headers.get_header("WARC-Target-URI")
                key = make_key(file.index, position)
                position += 1
                try:
                    text = raw.decode(_charset(content_type))
                except (UnicodeDecodeError, LookupError):
                    yield Malformed("bad_utf8", doc_id, file.source, key, _excerpt(raw), len(raw))
                    continue
                yield self._record(file, position - 1, text, doc_id, raw,
                                   {"url": url, "format": "html"})


def _charset(content_type: str) -> str:
    """The charset named in an HTTP Content-Type, UTF-8 when none is named."""
    for part in content_type.split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.lower() == "charset" and value:
            return value.strip('"\' ')
    return "utf-8"
