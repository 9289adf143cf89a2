"""What a Parquet column chunk's pages say they decode to, read from their own headers.

Owns: `declared_bytes` (a column chunk -> the sum of its pages' uncompressed sizes). Must not:
decode a page (Arrow does, after this said it may).

Why: Arrow allocates for each page what the page's header declares (`uncompressed_page_size`,
up to 2 GiB), while the footer's `total_uncompressed_size`, which the row-group cap reads first,
is the file's own word about the same pages and may understate them. The headers are what
Arrow will believe, so the cap must read them too; pyarrow does not expose them.

Thrift compact protocol read by hand (thrift.apache.org/docs, "Thrift Compact protocol
encoding"; the PageHeader struct in apache/parquet-format's parquet.thrift): the one Python
Thrift library, `thrift`, ships no wheel, and the images install wheels only. Only what a page
header needs: fields by id, nested structs skipped with a depth bound, no field names.
"""

from __future__ import annotations

from typing import IO, Any

from crucible.trainer.corpus.bounded import FileProblem

MAX_HEADER_BYTES = 1 << 20     # statistics may hold a value; writers truncate them far below
MAX_DEPTH = 16                 # a PageHeader nests three deep; a crafted one could nest deeper
# PageHeader's field ids (parquet.thrift).
UNCOMPRESSED_PAGE_SIZE, COMPRESSED_PAGE_SIZE = 2, 3
I32 = 5                        # the compact type the sizes are declared with


def _check_depth(depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("values nested deeper than any Parquet header")


class _Truncated(Exception):
    """The buffer ended inside the header: read more of the file."""


class _Compact:
    """A cursor over Thrift compact bytes."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Truncated
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> None:
        if n < 0:
            raise ValueError("a negative length")
        if self.pos + n > len(self.data):
            raise _Truncated
        self.pos += n

    def value(self, kind: int, depth: int) -> Any:
        """A value of compact type `kind`: integers as ints, structs as {field id: value};
        binaries, doubles and containers are skipped (None)."""
        if kind in (1, 2):                    # booleans: in the field header itself
            return kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            self.skip(8)
        elif kind == 8:
            self.skip(self.varint())
        elif kind in (9, 10):                 # list, set
            _check_depth(depth + 1)
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(size):
                self._element(head & 0x0F, depth + 1)
        elif kind == 11:                      # map
            _check_depth(depth + 1)
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self._element(types >> 4, depth + 1)
                    self._element(types & 0x0F, depth + 1)
        elif kind == 12:
            return self.struct(depth + 1)
        else:
            raise ValueError(f"Thrift compact type {kind} is not one")
        return None

    def _element(self, kind: int, depth: int) -> None:
        if kind in (1, 2):                    # in a container a boolean takes a byte
            self.byte()
        else:
            self.value(kind, depth)

    def struct(self, depth: int = 0) -> dict[int, tuple[int, Any]]:
        """{field id: (compact type, value)}; a field given twice is refused (Arrow's reader
        would take the one of the declared type, so the two could disagree)."""
        _check_depth(depth)
        fields: dict[int, tuple[int, Any]] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.zigzag()
            if last in fields:
                raise ValueError(f"field {last} given twice")
            fields[last] = (kind, self.value(kind, depth))


def _page_header(stream: IO[bytes], at: int, end: int) -> tuple[dict[int, Any], int]:
    """The PageHeader at `at` and its length in bytes, reading no further than `end`."""
    want = 4096
    while True:
        stream.seek(at)
        data = stream.read(min(want, end - at))
        cursor = _Compact(data)
        try:
            return cursor.struct(), cursor.pos
        except _Truncated:
            if len(data) < want or want >= MAX_HEADER_BYTES:
                raise FileProblem("bad_parquet", f"a page header at byte {at:,} does not end "
                                  "within its column chunk") from None
            want *= 4


def declared_bytes(stream: IO[bytes], column, enough: int | None = None) -> int:
    """The bytes `column` (pyarrow's ColumnChunkMetaData) decodes to by its pages' headers,
    walking the chunk's byte range as Arrow does (from its dictionary page if it has one);
    the walk ends once the count passes `enough` (the cap: the answer is then known)."""
    start = column.data_page_offset
    if (column.has_dictionary_page and column.dictionary_page_offset
            and 0 < column.dictionary_page_offset < start):
        start = column.dictionary_page_offset
    end = start + column.total_compressed_size
    total, at = 0, start
    try:
        while at < end and (enough is None or total <= enough):
            header, length = _page_header(stream, at, end)
            # Only i32 sizes, as Arrow's generated reader takes them (another type it skips).
            uncompressed = header.get(UNCOMPRESSED_PAGE_SIZE, (None, None))
            compressed = header.get(COMPRESSED_PAGE_SIZE, (None, None))
            if uncompressed[0] != I32 or compressed[0] != I32 \
                    or uncompressed[1] < 0 or compressed[1] < 0:
                raise FileProblem("bad_parquet", f"the page header at byte {at:,} gives no "
                                  "page sizes")
            total += uncompressed[1]
            at += length + compressed[1]
    except (ValueError, RecursionError) as err:
        raise FileProblem("bad_parquet", f"a page header at byte {at:,}: {err}") from None
    return total
