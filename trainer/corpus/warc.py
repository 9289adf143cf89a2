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

The HTTP body is decoded here too, not by warcio's `content_stream()`: that de-chunks a whole
chunk at once and inflates each buffer of a `Content-Encoding: gzip` body without a bound, so a
2 KB record inflated to gigabytes. `_body` de-chunks in bounded pieces and inflates with zlib's
`max_length`, so at most the record cap (plus one piece) is ever held; a body it cannot decode
(an encoding other than gzip/deflate/identity, a corrupt stream) is one counted record,
`bad_content_encoding`, and the archive goes on.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from typing import IO, Iterable, Iterator

from warcio.archiveiterator import ArchiveIterator
from warcio.bufferedreaders import BufferedReader, ChunkedDataException
from warcio.exceptions import ArchiveLoadFailed
from warcio.statusandheaders import StatusAndHeadersParserException

from crucible.trainer.corpus.bounded import FileProblem

# warcio's ways of saying a record is malformed (it has no common base class).
_WARC_ERRORS = (ArchiveLoadFailed, StatusAndHeadersParserException, ChunkedDataException,
                ValueError, LookupError, TypeError, AttributeError)


@dataclass(frozen=True)
class Response:
    record_id: str | None
    url: str | None
    content_type: str
    body: bytes | None      # None: over the record cap (not read further), or undecodable
    size: int               # bytes of the body; for one over the cap, the record's length
    problem: str | None = None   # why the body could not be decoded (body is then None)


PIECE_BYTES = 64 * 1024          # read and inflated at a time
CHUNK_LINE_BYTES = 1024          # a chunk-size line longer than this is not HTTP
MAX_CHUNKS = 1 << 20             # chunks in one body: past it, bad_content_encoding
# zlib's wbits: gzip (with its header) or zlib-wrapped deflate, detected; raw deflate apart.
_INFLATE_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
                  "deflate": 32 + zlib.MAX_WBITS}


class _BodyProblem(Exception):
    pass


def _pieces(stream: IO[bytes]) -> Iterator[bytes]:
    while piece := stream.read(PIECE_BYTES):
        yield piece


def _dechunked(stream: IO[bytes]) -> Iterator[bytes]:
    """HTTP/1.1 chunked transfer coding, in pieces of at most PIECE_BYTES (small chunks are
    joined: a body sent 2 bytes a chunk must not become millions of objects). Captures are
    often cut or mislabelled: past a line that is not a chunk size the rest is taken as it is,
    as warcio and browsers do. More than MAX_CHUNKS chunks is a body nobody sends."""
    joined = bytearray()
    for _ in range(MAX_CHUNKS):
        line = stream.readline(CHUNK_LINE_BYTES + 1)
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            size = -1
        if size < 0:
            yield bytes(joined) + line
            yield from _pieces(stream)
            return
        if size == 0:
            break
        while size:
            piece = stream.read(min(size, PIECE_BYTES))
            if not piece:
                yield bytes(joined)
                return
            size -= len(piece)
            joined += piece
            if len(joined) >= PIECE_BYTES:
                yield bytes(joined)
                joined.clear()
        stream.readline(CHUNK_LINE_BYTES)   # the CRLF after the chunk
    else:
        raise _BodyProblem(f"more than {MAX_CHUNKS:,} chunks")
    yield bytes(joined)


def _zlib_header(data: bytes) -> bool:
    """RFC 1950's two-byte header (method 8, check bits), or gzip's magic."""
    return len(data) >= 2 and (data[:2] == b"\x1f\x8b" or (
        data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0))


def _inflated(pieces: Iterable[bytes], encoding: str, room: int) -> Iterator[bytes]:
    """`pieces` inflated, never more than `room` bytes from any one call (zlib's max_length).
    A cut stream (captures are truncated) ends where its bytes end, as warcio lets it."""
    pieces = iter(pieces)
    first = b""
    while len(first) < 2 and (more := next(pieces, None)) is not None:
        first += more           # the two bytes that tell zlib-wrapped from raw deflate
    wbits = _INFLATE_WBITS[encoding]
    if encoding == "deflate" and not _zlib_header(first):
        wbits = -zlib.MAX_WBITS     # raw deflate without the zlib wrapper: some servers send it
    inflater = zlib.decompressobj(wbits)
    try:
        for data in itertools.chain([first], pieces):
            while data:
                yield inflater.decompress(data, room)
                data = inflater.unconsumed_tail
                if inflater.eof:
                    return      # what follows the compressed stream is not the body
    except zlib.error as err:
        raise _BodyProblem(f"{encoding}: {err}") from None


def _body(record, max_bytes: int) -> tuple[bytes | None, str | None]:
    """The record's HTTP body decoded (transfer coding, then content coding): (bytes, None);
    (None, None) when it is longer than `max_bytes`; (None, why) when it cannot be decoded."""
    headers = record.http_headers
    transfer = (headers.get_header("Transfer-Encoding") or "").strip().lower()
    encoding = (headers.get_header("Content-Encoding") or "").strip().lower()
    pieces = _dechunked(record.raw_stream) if transfer == "chunked" else _pieces(record.raw_stream)
    if encoding in _INFLATE_WBITS:
        pieces = _inflated(pieces, encoding, max_bytes + 1)
    elif encoding not in ("", "identity"):
        return None, f"Content-Encoding {encoding[:40]!r} is not gzip, deflate or identity"
    body = bytearray()
    try:
        for piece in pieces:
            if len(body) + len(piece) > max_bytes:
                return None, None
            body += piece
    except _BodyProblem as err:
        return None, str(err)
    return bytes(body), None


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
            body, problem = _body(record, max_bytes)
            size = (len(body) if body is not None
                    else record.length or 0 if problem else max(record.length or 0, max_bytes + 1))
            return Response(record.rec_headers.get_header("WARC-Record-ID"),
                            record.rec_headers.get_header("WARC-Target-URI"), content_type, body,
                            size, problem)
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

