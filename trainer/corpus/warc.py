"""The HTML responses of a WARC archive that nobody vouches for.

Owns: `html_responses` (an uncompressed WARC stream -> `Response`s, a body over the record cap
as None). Must not: open or decompress files (bounded.open_capped does, so the file cap and the
truncation checks apply to WARC as to every format), decode bodies (charset.py does) or make
records (readers do).

warcio 1.8 trusts its input: it reads header lines with an unbounded readline() and keeps them
all, sniffs and decompresses gzip on its own (a second, uncapped layer inside an archive would
be inflated), and reports malformed records with several unrelated exception types, down to an
AttributeError for a response without WARC-Target-URI. Here its line reader is swapped for one
that does not decompress and allows at most the record cap of header lines per record, and every
error it raises ends the file as `bad_warc`, keeping the responses read before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Iterator

from warcio.archiveiterator import ArchiveIterator
from warcio.bufferedreaders import BufferedReader, ChunkedDataException
from warcio.exceptions import ArchiveLoadFailed
from warcio.statusandheaders import StatusAndHeadersParserException

from crucible.trainer.corpus.bounded import FileProblem, read_capped

# warcio's ways of saying a record is malformed (it has no common base class).
_WARC_ERRORS = (ArchiveLoadFailed, StatusAndHeadersParserException, ChunkedDataException,
                ValueError, LookupError, TypeError, AttributeError)


@dataclass(frozen=True)
class Response:
    record_id: str | None
    url: str | None
    content_type: str
    body: bytes | None      # None: over the record cap (not read further)
    size: int               # bytes of the body; for one over the cap, the record's length


class _BoundedLines(BufferedReader):
    """warcio's line reader without decompression, allowing at most `max_bytes` of lines (WARC
    and HTTP headers, the blank lines after a record) between two reads of record content."""

    def __init__(self, stream: IO[bytes], max_bytes: int):
        super().__init__(stream)        # decomp_type None: the bytes are decompressed already
        self._max_bytes = max_bytes
        self._line_bytes = 0

    def read(self, length=None):
        self._line_bytes = 0
        return super().read(length)

    def readline(self, length=None):
        room = self._max_bytes - self._line_bytes + 1
        line = super().readline(room if length is None else min(length, room))
        self._line_bytes += len(line)
        if self._line_bytes > self._max_bytes:
            raise FileProblem("bad_warc", f"more than {self._max_bytes:,} bytes of header lines")
        return line


def _next_html(records: ArchiveIterator, max_bytes: int) -> Response | None:
    try:
        for record in records:
            if record.rec_type != "response" or record.http_headers is None:
                continue
            content_type = record.http_headers.get_header("Content-Type") or ""
            if "html" not in content_type.lower():
                continue
            body = read_capped(record.content_stream(), max_bytes)
            size = len(body) if body is not None else max(record.length or 0, max_bytes + 1)
            return Response(record.rec_headers.get_header("WARC-Record-ID"),
                            record.rec_headers.get_header("WARC-Target-URI"), content_type, body,
                            size)
        return None
    except _WARC_ERRORS as err:
        raise FileProblem("bad_warc", f"{type(err).__name__}: {err}") from None


def html_responses(stream: IO[bytes], max_record_bytes: int,
                   archive_format: str = "warc") -> Iterator[Response]:
    """The HTTP responses with an HTML content type, in archive order. `archive_format` ("warc"
    or "arc") is the only one tried: left to guess, warcio parses a WARC file whose first record
    is garbage as ARC and finds nothing wrong."""
    records = ArchiveIterator(stream)
    # Set before the first record is parsed: warcio reads everything through `reader`.
    records.reader = _BoundedLines(records.fh, max_record_bytes)
    records.known_format = archive_format
    while (response := _next_html(records, max_record_bytes)) is not None:
        yield response

