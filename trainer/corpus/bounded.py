"""Reading untrusted input within bounds: a size cap per record and per decompressed file, and one
error type for a file that cannot be read to its end.

Owns: `ReadLimits` (the caps; the corpus config's `limits`), `FileProblem` (why the rest of a
file is lost, under the reason the report counts), `open_capped` (a local or s3:// file,
decompressed by its suffix, that stops at the file cap), `bounded_lines`, `read_capped` and
`seekable_capped` (Parquet's spool). Must not: parse formats (readers do) or count anything (the
pipeline counts the `Malformed` records readers make of these).

Why: web data is broken or hostile. A JSONL line of 2 GB, a 30 kB .zst that expands to 1 TB of
zeros (zstd stores 128 KiB of one byte in a 4-byte RLE block) or a file cut short by an
interrupted copy must not take a worker's memory, hang it or fail the Job. Each becomes one
counted record and the reader moves on, keeping what came before.

Defaults:
- max_record_bytes 8 MiB: Common Crawl truncates every capture at 1 MiB (since 2013; a move to
  5 MiB is planned), and Gopher quality drops documents over 100,000 words (~0.6 MB of English),
  so no record this cap removes could have reached the output with the default steps, and 8 MiB
  leaves room for markup and whole books. It bounds a worker's memory: one record is held as
  bytes, str and parsed JSON at once (~50 MiB at the cap, against the Job's 4 GiB).
- max_file_bytes 16 GiB decompressed: a Common Crawl WARC file is ~1 GiB gzipped and ~5-6 GiB
  decompressed, and datatrove/FineWeb shards are smaller. Memory is bounded by the record cap;
  this one bounds the time a decompression bomb or a file of blank lines can cost.
- max_row_group_bytes 1 GiB decoded (the footer's count of the text and id columns): Arrow
  decodes a plain Parquet page whole, and a page's size is only in its own header, so this
  bounds what one crafted page can put in memory (a quarter of the corpus Job's 4 GiB).
  Writers' pages are ~1 MiB and datatrove writes 1,000 documents a row group (~5 MB), but
  `pyarrow.parquet.write_table` puts up to 1Mi rows in one, so a corpus written in one call
  can have row groups of gigabytes: raise the cap for those (they are counted, not lost
  silently, as `row_group_too_large`).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import tempfile
import zlib
from dataclasses import asdict, dataclass
from typing import IO, Iterator

from crucible.trainer import storage

MiB = 1 << 20
BUFFER_BYTES = 1 * MiB     # read-ahead of the line reader; also the step when skipping a line
# zstd input fed per step. 256 bytes hold at most 64 RLE blocks, 8 MiB of output: the most one
# step can put in memory, whatever the ratio of the file. Measured on JSONL: ~110 MB/s of input,
# a sixth of the time json.loads then takes for the decompressed lines.
ZSTD_STEP_BYTES = 256


@dataclass(frozen=True)
class ReadLimits:
    """Caps on what a reader takes from one file (see the module docstring for the defaults)."""

    max_record_bytes: int = 8 * MiB        # a JSONL line, WARC body, text/HTML file, Parquet value
    max_file_bytes: int = 16 * 1024 * MiB  # decompressed bytes of one input file
    max_row_group_bytes: int = 1024 * MiB  # decoded bytes of a Parquet row group's columns read
    # Seconds one step may take over one document (HTML extraction of a page built to be slow:
    # 200,000 paragraphs, 4 MB, took trafilatura 17.6 s and 416 MiB here); past it the document
    # is dropped as <step>_timeout. Only where the steps run in a process's main thread.
    max_step_seconds: float = 10.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "max_step_seconds":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"limits.{name}: want a positive number of seconds, "
                                     f"got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{name}: want a positive number of bytes, got {value!r}")


class FileProblem(Exception):
    """The rest of a file cannot be read: `reason` is what the report counts it under, `detail`
    says what was wrong (shown with the file's name)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _Capped(io.RawIOBase):
    """The decompressed bytes of a file, at most `cap` of them; the byte after the cap raises
    `file_too_large`. Decompression errors become FileProblems here, below every parser: warcio
    would take gzip's EOFError for a clean end of the archive and hide the truncation."""

    def __init__(self, inner: IO[bytes], cap: int):
        self._inner = inner
        self._cap = cap
        self._count = 0

    def readable(self) -> bool:
        return True

    def _read(self, n: int) -> bytes:
        # read1: one step of the decompressor. GzipFile.read(n) loops until it has n bytes and
        # drops what it decompressed when the stream then ends short; read1 returns it first.
        read = getattr(self._inner, "read1", self._inner.read)
        try:
            return read(n)
        except EOFError as err:          # gzip: the stream ends inside a member
            raise FileProblem("truncated_file", f"gzip: {err}") from None
        except (zlib.error, gzip.BadGzipFile) as err:
            raise FileProblem("bad_compression", f"gzip: {err}") from None

    def readinto(self, buffer) -> int:
        room = min(len(buffer), self._cap - self._count)
        if room == 0:
            if self._read(1):
                raise FileProblem("file_too_large",
                                  f"more than {self._cap:,} bytes after decompression")
            return 0
        data = self._read(room)
        buffer[:len(data)] = data
        self._count += len(data)
        return len(data)


class _ZstdFrames(io.RawIOBase):
    """zstd decompression, frame after frame, that tells a cut-off stream from a finished one.

    zstandard's stream_reader returns a clean EOF in the middle of a truncated frame and stops
    after the first frame of a multi-frame file (pzstd, concatenated shards). Its decompressobj
    reports the end of each frame, but returns all output of its input at once, so it is fed
    ZSTD_STEP_BYTES at a time to bound that output."""

    def __init__(self, source: IO[bytes]):
        import zstandard

        self._source = source
        self._zstd = zstandard
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = None          # the current frame's decompressobj; None between frames
        self._unfed = b""           # input read past the end of the last frame
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _step(self) -> bool:
        """Feed one step of input; False at the end of the input between two frames."""
        data = self._unfed or self._source.read(ZSTD_STEP_BYTES)
        self._unfed = b""
        if not data:
            if self._frame is not None:
                raise FileProblem("truncated_file", "zstd: the input ends inside a frame")
            return False
        if self._frame is None:
            self._frame = self._decompressor.decompressobj()
        try:
            self._out = memoryview(self._frame.decompress(data))
        except self._zstd.ZstdError as err:
            raise FileProblem("bad_compression", f"zstd: {err}") from None
        if self._frame.eof:
            self._unfed, self._frame = self._frame.unused_data, None
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            if not self._step():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


def _decompressor(uri: str, raw: IO[bytes]) -> IO[bytes]:
    name = uri.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if name.endswith((".zst", ".zstd")):
        return _ZstdFrames(raw)
    return raw


@contextlib.contextmanager
def open_capped(uri: str, max_bytes: int) -> Iterator[IO[bytes]]:
    """The file's bytes, decompressed by suffix (.gz, .zst), as a buffered stream that raises
    FileProblem at byte `max_bytes` + 1 and on corrupt or truncated compression."""
    with contextlib.closing(storage.open_read(uri)) as raw:
        with contextlib.closing(_decompressor(uri, raw)) as inner:
            with io.BufferedReader(_Capped(inner, max_bytes), buffer_size=BUFFER_BYTES) as stream:
                yield stream


def bounded_lines(stream: IO[bytes], max_bytes: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, size) for every line, newline included. A line over `max_bytes` comes as
    (None, size): it is read past BUFFER_BYTES at a time, never held whole."""
    while line := stream.readline(max_bytes + 1):
        size = len(line)
        if size <= max_bytes:
            yield line, size
            continue
        while not line.endswith(b"\n"):
            line = stream.readline(BUFFER_BYTES)
            if not line:
                break
            size += len(line)
        yield None, size


def read_capped(stream: IO[bytes], max_bytes: int) -> bytes | None:
    """The rest of `stream`, or None when it is longer than `max_bytes` (having read one more)."""
    data = stream.read(max_bytes + 1)
    return data if len(data) <= max_bytes else None


@contextlib.contextmanager
def seekable_capped(uri: str, max_bytes: int) -> Iterator[IO[bytes]]:
    """A seekable copy of a stored file (Parquet needs one): a local file as it is; an S3 object
    spooled to a temporary file, not memory, and refused past `max_bytes`."""
    if not storage.is_s3(uri):
        with open(uri, "rb") as local:
            yield local
        return
    with tempfile.TemporaryFile() as spool, contextlib.closing(storage.open_read(uri)) as source:
        copied = 0
        while chunk := source.read(BUFFER_BYTES):
            copied += len(chunk)
            if copied > max_bytes:
                raise FileProblem("file_too_large", f"more than {max_bytes:,} bytes stored")
            spool.write(chunk)
        spool.seek(0)
        yield spool
