"""Readers: one input file -> its records, each a `Document` or a counted `Malformed`.

Owns: JSONL (plain, .gz, .zst), Parquet, plain-text files (one document per file, e.g. a tree of
manuals), HTML files (marked for extraction) and WARC response records (warcio, via warc.py).
Every record gets the source name, an id (the record's own id field, else "<relative path>#<line>",
or the path for one-document files) and its global key. Must not: decide what is good text (steps
do) or hold more of a file than the record cap (bounded.py).

Malformed input never crashes a run and never vanishes. A record becomes a `Malformed` that the
pipeline counts like any other drop, with a sample: bad UTF-8 (`bad_utf8`), a JSON string that
decodes to a lone UTF-16 surrogate, which no UTF-8 output can hold (`lone_surrogate`), lines
that are not JSON objects (`bad_json`), a missing or non-string text field (`missing_text`),
blank text (`empty_text`), blank JSONL lines (`blank_line`), a record over
`limits.max_record_bytes` (`record_too_large`, skipped unread), a WARC body or HTML file that no
step of charset.py's chain decodes (`bad_encoding`, or `unknown_charset` when its Content-Type
named no web encoding), a WARC body whose transfer or content coding cannot be undone
(`bad_content_encoding`: corrupt gzip, an encoding other than gzip/deflate/identity). A file that cannot be read to its end becomes one `Malformed` with
`file_problem` set after the records read before it, which are kept: more than
`limits.max_file_bytes` decompressed (`file_too_large`), a gzip or zstd stream cut short
(`truncated_file`) or corrupt (`bad_compression`), a malformed WARC (`bad_warc`) or Parquet file
(`bad_parquet`), more records than a key can number (`too_many_records`). Storage errors (S3,
disk) are not the data's fault and still fail the task, which the Job retries.

Follows datatrove's readers (src/datatrove/pipeline/readers/: jsonl, parquet, warc) for field
names and WARC handling: only HTTP responses whose content type is HTML become documents; the URL
goes into metadata.

Web pages (WARC bodies, HTML files) are decoded as browsers decode them (charset.py: BOM, HTTP
charset, <meta>, UTF-8, detection); each document's metadata says how (`charset`, the Python
codec, and `charset_source`, the step of the chain), and `Reader.counters` counts pages per
step as "charset_<source>", so a run can report how many needed a fallback. Text files, JSONL
and Parquet are UTF-8 by contract and stay strict (`bad_utf8`).
"""

from __future__ import annotations

import json
import re
from typing import Iterator

from crucible.trainer.corpus.bounded import (FileProblem, ReadLimits, bounded_lines, open_capped,
                                             read_capped, seekable_capped)
from crucible.trainer.corpus.document import RECORD_BITS, Document, Malformed, make_key
from crucible.trainer.corpus.shards import InputFile, stem

Record = Document | Malformed
RAW_EXCERPT_BYTES = 200      # how much of a malformed record the report shows
MAX_RECORDS = 1 << RECORD_BITS
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only then can json.loads make a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _excerpt(raw: bytes) -> str:
    return raw[:RAW_EXCERPT_BYTES].decode("utf-8", "replace")


def _key(file: InputFile, position: int) -> int:
    if position >= MAX_RECORDS:
        raise FileProblem("too_many_records", f"more than {MAX_RECORDS:,} records in one file")
    return make_key(file.index, position)


def _json_object(line: bytes) -> dict | str:
    """The JSON object on `line`, or the reason there is none."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "bad_utf8"
    except (ValueError, RecursionError):   # not JSON, an int over Python's digit cap, deep nesting
        return "bad_json"
    if not isinstance(obj, dict):
        return "bad_json"
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "lone_surrogate"
    return obj


class Reader:
    """Turns one file into records. `text_field` / `id_field` name the JSON or Parquet columns."""

    def __init__(self, text_field: str = "text", id_field: str = "id",
                 limits: ReadLimits = ReadLimits()):
        self.text_field = text_field
        self.id_field = id_field
        self.limits = limits
        self.counters: dict[str, int] = {}   # pages per charset source, across the files read

    def read(self, file: InputFile) -> Iterator[Record]:
        method = getattr(self, f"_read_{file.format}")
        next_key = make_key(file.index, 0)
        try:
            for record in method(file):
                next_key = record.key + 1
                yield record
        except FileProblem as problem:
            # Keyed after the last record kept, within this file's keys even at the record limit.
            key = min(next_key, make_key(file.index, MAX_RECORDS - 1))
            yield Malformed(problem.reason, file.relative_path, file.source, key,
                            problem.detail[:RAW_EXCERPT_BYTES], 0, file_problem=True)

    def _record(self, file: InputFile, position: int, text: object, doc_id: str,
                raw: bytes, metadata: dict | None = None) -> Record:
        key = _key(file, position)
        if not isinstance(text, str):
            return Malformed("missing_text", doc_id, file.source, key, _excerpt(raw), len(raw))
        if not text.strip():
            return Malformed("empty_text", doc_id, file.source, key, _excerpt(raw), len(raw))
        return Document(text, doc_id, file.source, key, metadata or {})

    def _utf8_record(self, file: InputFile, position: int, raw: bytes | None, size: int,
                     doc_id: str, metadata: dict | None = None) -> Record:
        """A record from bytes that must be UTF-8 text; None: the record was over the cap."""
        if raw is None:
            return Malformed("record_too_large", doc_id, file.source, _key(file, position), "",
                             size)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return Malformed("bad_utf8", doc_id, file.source, _key(file, position), _excerpt(raw),
                             len(raw))
        return self._record(file, position, text, doc_id, raw, metadata)

    def _page_record(self, file: InputFile, position: int, raw: bytes | None, size: int,
                     doc_id: str, content_type: str | None, metadata: dict) -> Record:
        """A record from a web page's bytes (charset.py's chain); None: over the record cap."""
        from crucible.trainer.corpus.charset import decode_page

        key = _key(file, position)
        if raw is None:
            return Malformed("record_too_large", doc_id, file.source, key, "", size)
        decoded = decode_page(raw, content_type)
        if isinstance(decoded, str):
            shown = content_type.encode() if decoded == "unknown_charset" else raw
            return Malformed(decoded, doc_id, file.source, key, _excerpt(shown), len(raw))
        counter = f"charset_{decoded.source}"
        self.counters[counter] = self.counters.get(counter, 0) + 1
        return self._record(file, position, decoded.text, doc_id, raw,
                            {**metadata, "charset": decoded.codec,
                             "charset_source": decoded.source})

    def _read_jsonl(self, file: InputFile) -> Iterator[Record]:
        with open_capped(file.uri, self.limits.max_file_bytes) as stream:
            lines = bounded_lines(stream, self.limits.max_record_bytes)
            for position, (line, size) in enumerate(lines):
                fallback_id = f"{file.relative_path}#{position + 1}"
                key = _key(file, position)
                if line is None:
                    yield Malformed("record_too_large", fallback_id, file.source, key, "", size)
                    continue
                if not line.strip():
                    yield Malformed("blank_line", fallback_id, file.source, key, "", size)
                    continue
                obj = _json_object(line)
                if isinstance(obj, str):
                    yield Malformed(obj, fallback_id, file.source, key, _excerpt(line), size)
                    continue
                doc_id = obj.get(self.id_field)
                metadata = {k: v for k, v in obj.items() if k not in (self.text_field, self.id_field)}
                yield self._record(file, position, obj.get(self.text_field),
                                   fallback_id if doc_id is None else str(doc_id), line, metadata)

    def _read_parquet(self, file: InputFile) -> Iterator[Record]:
        import pyarrow as pa

        from crucible.trainer.corpus.parquet import bounded_rows

        with seekable_capped(file.uri, self.limits.max_file_bytes) as stream:
            try:
                rows = bounded_rows(stream, self.text_field, self.id_field, self.limits)
                yield from self._parquet_records(file, rows)
            # OSError: Arrow's IO errors (ArrowIOError is OSError), e.g. a footer that does not
            # parse; the bytes are on local disk by now. UnicodeDecodeError: Arrow making Python
            # objects of a nested id column with non-UTF-8 strings (text and string ids are
            # decoded here, per record).
            # KeyError, ValueError, TypeError: Arrow's reading of malformed schemas (a nested
            # column read as a dictionary, say) surfaces as these too.
            except (pa.ArrowException, OSError, UnicodeDecodeError, KeyError, ValueError,
                    TypeError) as err:
                raise FileProblem("bad_parquet", f"{type(err).__name__}: {err}") from None

    def _parquet_records(self, file: InputFile, rows) -> Iterator[Record]:
        from crucible.trainer.corpus.parquet import Oversize, SkippedRowGroup

        position = 0
        for row in rows:
            if isinstance(row, SkippedRowGroup):
                # One counted record for the group's rows, which are not read: a page Arrow
                # would decode whole could be of any size.
                yield Malformed("row_group_too_large", f"{file.relative_path}#{position + 1}",
                                file.source, _key(file, position),
                                f"{row.rows:,} rows, {row.decoded_bytes:,} bytes decoded",
                                row.decoded_bytes)
                position += row.rows
                continue
            text, doc_id = row
            if doc_id is None or isinstance(doc_id, Oversize):
                doc_id = f"{file.relative_path}#{position + 1}"
            elif isinstance(doc_id, bytes):
                doc_id = doc_id.decode("utf-8", "replace")   # a label: keep it readable
            else:
                doc_id = str(doc_id)
            if isinstance(text, Oversize):
                yield self._utf8_record(file, position, None, text.size, doc_id)
            elif isinstance(text, bytes):
                yield self._utf8_record(file, position, text, len(text), doc_id)
            else:
                yield self._record(file, position, text, doc_id, b"")
            position += 1

    def _whole_file(self, file: InputFile) -> tuple[bytes | None, int]:
        with open_capped(file.uri, self.limits.max_file_bytes) as stream:
            raw = read_capped(stream, self.limits.max_record_bytes)
        return raw, self.limits.max_record_bytes + 1 if raw is None else len(raw)

    def _read_text(self, file: InputFile) -> Iterator[Record]:
        raw, size = self._whole_file(file)
        yield self._utf8_record(file, 0, raw, size, file.relative_path,
                                {"path": file.relative_path})

    def _read_html(self, file: InputFile) -> Iterator[Record]:
        raw, size = self._whole_file(file)
        yield self._page_record(file, 0, raw, size, file.relative_path, None,
                                {"path": file.relative_path, "format": "html"})

    def _read_warc(self, file: InputFile) -> Iterator[Record]:
        from crucible.trainer.corpus.warc import html_responses

        with open_capped(file.uri, self.limits.max_file_bytes) as stream:
            responses = html_responses(stream, self.limits.max_record_bytes,
                                       "arc" if stem(file.uri).endswith(".arc") else "warc")
            for position, response in enumerate(responses):
                doc_id = response.record_id or f"{file.relative_path}#{position + 1}"
                if response.problem is not None:
                    yield Malformed("bad_content_encoding", doc_id, file.source,
                                    _key(file, position), response.problem[:200], response.size)
                    continue
                yield self._page_record(file, position, response.body, response.size, doc_id,
                                        response.content_type,
                                        {"url": response.url, "format": "html"})
