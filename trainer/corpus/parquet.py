"""The rows of a Parquet file that nobody vouches for, within a memory budget.

Owns: `bounded_rows` (a Parquet file -> each row's text and id as Python values, a value over
the record cap as its size, a row group too large to decode as a `SkippedRowGroup`). Must not:
open or spool files (bounded.seekable_capped does), decode text or make records (readers do).

Why: Parquet stores a dictionary-encoded value once and refers to it by index from every row;
Arrow expands the references when it reads a batch. 1,024 references to one 1 MiB string, a
2.7 KB file whose footer counts 1 MiB, became a gigabyte in Arrow and another in Python. So:
- A dictionary-encoded column chunk is read as a dictionary (Arrow's `read_dictionary`) and never
  expanded: each row's size is its entry's length, a row over the record cap is not made into a
  Python value at all, and the others are made a slice at a time, at most SLICE_BYTES together
  (plus one record). Plain chunks are sliced the same way.
- Arrow decodes a plain page whole, and a page's decoded size is only in its own header: a row
  group whose columns decode to more than `max_row_group_bytes` by the footer's count is not read
  but counted (`row_group_too_large`), and the rows after it are read.
Reading plain chunks as dictionaries would bound them too, but costs ~5x the read time (Arrow
hashes every value), so each row group is read by whichever of two readers matches its text
column's encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Any, Iterator

from crucible.trainer.corpus.bounded import FileProblem, ReadLimits

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


def _dictionary_encoded(chunk) -> bool:
    return any("DICTIONARY" in encoding for encoding in chunk.encodings)


def _as_binary(array):
    """String values as bytes: Arrow does not check that Parquet strings are UTF-8, so the reader
    decodes them per record."""
    import pyarrow as pa

    for string, binary in ((pa.string(), pa.binary()), (pa.large_string(), pa.large_binary())):
        if array.type == string:
            return array.view(binary)
    return array


def _values(array, max_record_bytes: int) -> Iterator[Any]:
    """Each row's value (bytes for strings), `Oversize` for one over the cap; never more than
    SLICE_BYTES of values made into Python objects at once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array, pa.DictionaryArray):
        dictionary = _as_binary(array.dictionary)
        if not (pa.types.is_binary(dictionary.type) or pa.types.is_large_binary(dictionary.type)):
            yield from array.to_pylist()       # numbers and the like: small whatever their count
            return
        sizes = pc.take(pc.binary_length(dictionary), array.indices).to_pylist()
        values, indices = dictionary, array.indices
    else:
        values = _as_binary(array)
        if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
            yield from values.to_pylist()
            return
        sizes, indices = pc.binary_length(values).to_pylist(), None
    start = 0
    while start < len(sizes):
        end, total = start, 0
        while end < len(sizes) and (end == start or total + (sizes[end] or 0) <= SLICE_BYTES):
            total += sizes[end] if sizes[end] and sizes[end] <= max_record_bytes else 0
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
    """(text, id) per row in file order, each None where the file has no such column; a
    `SkippedRowGroup` in place of a row group too large to decode. A file whose row groups
    decode to more than the file cap is a FileProblem; Arrow's errors propagate."""
    import pyarrow.parquet as pq

    max_record_bytes, max_file_bytes = limits.max_record_bytes, limits.max_file_bytes
    plain = pq.ParquetFile(stream)
    footer = plain.metadata
    decoded = sum(footer.row_group(i).total_byte_size for i in range(footer.num_row_groups))
    if decoded > max_file_bytes:
        raise FileProblem("file_too_large", f"{decoded:,} bytes in its row groups")
    names = set(plain.schema_arrow.names)
    columns = [c for c in (text_field, id_field) if c in names]
    by_dictionary = None      # the reader that keeps dictionaries, made when a chunk needs it
    for group in range(footer.num_row_groups):
        meta = footer.row_group(group)
        chunks = {meta.column(j).path_in_schema: meta.column(j) for j in range(meta.num_columns)}
        read = [chunks[c] for c in columns if c in chunks] or list(chunks.values())
        decoded = sum(chunk.total_uncompressed_size for chunk in read)
        if decoded > limits.max_row_group_bytes:
            yield SkippedRowGroup(meta.num_rows, decoded)
            continue
        reader = plain
        if any(_dictionary_encoded(chunks[c]) for c in columns if c in chunks):
            if by_dictionary is None:
                by_dictionary = pq.ParquetFile(stream, read_dictionary=columns)
            reader = by_dictionary
        for batch in reader.iter_batches(batch_size=BATCH_ROWS, row_groups=[group],
                                         columns=columns or None):
            texts = (_values(batch.column(text_field), max_record_bytes)
                     if text_field in batch.schema.names else iter([None] * batch.num_rows))
            ids = (_values(batch.column(id_field), max_record_bytes)
                   if id_field in batch.schema.names else iter([None] * batch.num_rows))
            yield from zip(texts, ids)
