"""The rows of a Parquet file that nobody vouches for, within a memory budget.

Owns: `bounded_rows` (a Parquet file -> each row's text and id as Python values, a value over
the record cap as its size, a row group too large to decode as a `SkippedRowGroup`). Must not:
open or spool files (bounded.seekable_capped does), decode text or make records (readers do).

Why: Parquet stores a dictionary-encoded value once and refers to it by index from every row;
Arrow expands the references when it reads a batch. 1,024 references to one 1 MiB string, a
2.7 KB file whose footer counts 1 MiB, became a gigabyte in Arrow and another in Python. So:
- String and byte columns are always read as dictionaries (Arrow's `read_dictionary`; the
  footer's word on a chunk's encoding is not taken) and never expanded: each row's size is its
  entry's length, a row over the record cap is not made into a Python value at all, and the
  others are made a slice at a time, at most SLICE_BYTES together (plus one record).
- Arrow decodes a page whole, allocating what the page's own header declares: a row group whose
  columns decode to more than `max_row_group_bytes`, by the footer's count or by its pages'
  headers (parquet_pages.py), whichever says more, is not read but counted
  (`row_group_too_large`), and the rows after it are read.
- Only flat columns are read (strings, bytes, numbers): a nested text column is `bad_parquet`,
  a nested id column is left unread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import IO, Any, Iterator

from crucible.trainer.corpus.bounded import FileProblem, ReadLimits
from crucible.trainer.corpus.parquet_pages import declared_bytes

SLICE_BYTES = 64 << 20        # values materialised together, at most (one record may exceed it)
BATCH_ROWS = 1024             # rows Arrow reads at once (their dictionary indices, or values)


@dataclass(frozen=True)
class Oversize:
    """A value over the record cap, not read: its size in bytes."""

    size: int


@dataclass(frozen=True)
class SkippedRowGroup:
    """A row group not read: its rows and the bytes its columns decode to (the footer's)."""

    rows: int
    decoded_bytes: int


def _as_binary(array):
    """String values as bytes: Arrow does not check that Parquet strings are UTF-8, so the reader
    decodes them per record."""
    import pyarrow as pa

    for string, binary in ((pa.string(), pa.binary()), (pa.large_string(), pa.large_binary())):
        if array.type == string:
            return array.view(binary)
    return array


def _bytes_like(field_type) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)
            or pa.types.is_binary(field_type) or pa.types.is_large_binary(field_type))


def _flat(field_type) -> bool:
    """A column a record's text or id can come from: strings, bytes, numbers."""
    import pyarrow as pa

    return (_bytes_like(field_type) or pa.types.is_integer(field_type)
            or pa.types.is_floating(field_type) or pa.types.is_boolean(field_type)
            or pa.types.is_dictionary(field_type))


def _values(array, max_record_bytes: int) -> Iterator[Any]:
    """Each row's value (bytes for strings), `Oversize` for one over the cap; never more than
    SLICE_BYTES of values made into Python objects at once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    dictionary = isinstance(array, pa.DictionaryArray)
    values = _as_binary(array.dictionary if dictionary else array)
    if not _bytes_like(values.type):
        yield from array.to_pylist()       # numbers and the like: small whatever their count
        return
    indices = array.indices if dictionary else None
    sizes = pc.binary_length(values)
    sizes = (pc.take(sizes, indices) if dictionary else sizes).to_pylist()
    # Bytes a row's value costs when made (one over the cap or null is not made).
    made_bytes = [s if s is not None and s <= max_record_bytes else 0 for s in sizes]
    start = 0
    while start < len(sizes):
        end, total = start, 0
        while end < len(sizes) and (end == start or total + made_bytes[end] <= SLICE_BYTES):
            total += made_bytes[end]
            end += 1
        wanted = [i for i in range(start, end) if sizes[i] is not None
                  and sizes[i] <= max_record_bytes]
        rows = (pc.take(values, pc.take(indices, wanted)) if indices is not None
                else pc.take(values, wanted)).to_pylist() if wanted else []
        made = iter(rows)
        for i in range(start, end):
            size = sizes[i]
            yield None if size is None else Oversize(size) if size > max_record_bytes else next(made)
        start = end


def bounded_rows(stream: IO[bytes], text_field: str, id_field: str,
                 limits: ReadLimits) -> Iterator[tuple[Any, Any] | SkippedRowGroup]:
    """(text, id) per row in file order, each None where the file has no such column (an id
    column of nested values is not read: the reader's position names the row); a
    `SkippedRowGroup` in place of a row group too large to decode. A file whose row groups
    decode to more than the file cap, or whose text column is nested, is a FileProblem;
    Arrow's errors propagate."""
    import pyarrow.parquet as pq

    max_record_bytes, max_file_bytes = limits.max_record_bytes, limits.max_file_bytes
    schema_file = pq.ParquetFile(stream)
    footer = schema_file.metadata
    decoded = sum(footer.row_group(i).total_byte_size for i in range(footer.num_row_groups))
    if decoded > max_file_bytes:
        raise FileProblem("file_too_large", f"{decoded:,} bytes in its row groups")
    schema = schema_file.schema_arrow
    names = schema.names
    if names.count(text_field) > 1 or names.count(id_field) > 1:
        raise FileProblem("bad_parquet", "a column name appears more than once")
    if text_field in names and not _flat(schema.field(text_field).type):
        raise FileProblem("bad_parquet", f"the {text_field!r} column holds "
                                         f"{schema.field(text_field).type}, not text")
    columns = [c for c in (text_field, id_field) if c in names and _flat(schema.field(c).type)]
    # Every string column read as a dictionary whatever the footer says of its encoding (the
    # footer is the file's word, and Arrow decodes what the pages hold): a dictionary page is
    # then never expanded. It costs Arrow hashing plain values (~5x its read time, still far
    # above what the filters take).
    binary = [c for c in columns if _bytes_like(schema.field(c).type)]
    reader = pq.ParquetFile(stream, read_dictionary=binary) if binary else schema_file
    for group in range(footer.num_row_groups):
        meta = footer.row_group(group)
        if not columns:   # nothing to read: each row is one without text
            for _ in range(meta.num_rows):
                yield None, None
            continue
        chunks = {meta.column(j).path_in_schema: meta.column(j) for j in range(meta.num_columns)}
        # The footer's count and the pages' own: Arrow allocates what the pages declare.
        decoded = sum(max(chunks[c].total_uncompressed_size,
                          declared_bytes(stream, chunks[c], limits.max_row_group_bytes))
                      for c in columns if c in chunks)
        if decoded > limits.max_row_group_bytes:
            yield SkippedRowGroup(meta.num_rows, decoded)
            continue
        for batch in reader.iter_batches(batch_size=BATCH_ROWS, row_groups=[group],
                                         columns=columns):
            texts = (_values(batch.column(text_field), max_record_bytes)
                     if text_field in columns else itertools.repeat(None, batch.num_rows))
            ids = (_values(batch.column(id_field), max_record_bytes)
                   if id_field in columns else itertools.repeat(None, batch.num_rows))
            yield from zip(texts, ids)
