"""Encode documents into training shards (the format in `crucible.trainer.data`).

Owns: `encode_to_shards` (batch encoding on every core, the train/validation split by document,
shard cutting at document boundaries, the run summary `encode.json`). Must not: define the shard
format (`trainer/data.py` does) or train tokenizers.

Documents are split into train and validation by `documents.is_held_out` (a hash of position and
text), so the split is reproducible and never cuts a document in two. Each document is followed
by the end-of-text id, and each shard records the tokenizer's hash (the trainer refuses shards
whose hash differs from its tokenizer's), its vocabulary size and how many UTF-8 bytes its tokens
encode (for bits-per-byte evaluation). Shards end at a document boundary once they hold
`shard_tokens` tokens. Encoding runs in batches of about `batch_bytes` of text through the codec,
which spreads each batch over all cores (see `codec`); the per-batch Python work is a few numpy
calls, so Crucible's overhead over the bare library stays small (bench/tokenizer_bench.py).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from crucible.trainer.data import dtype_for, write_shard
from crucible.trainer.tokenizer.codec import Codec, open_codec
from crucible.trainer.tokenizer.documents import is_held_out

SHARD_TOKENS = 1 << 24  # 16 Mi tokens: 32 MiB at uint16, so a shard memory-maps in one go
BATCH_BYTES = 4 << 20  # text per encode call: enough to keep every core busy, small in memory
SPLITS = ("train", "val")
SUMMARY = "encode.json"

# Kept for callers of the old name.
is_validation = is_held_out


class EncodeError(ValueError):
    """An encode that would mix or overwrite shards; the message says what to do."""


class _ShardWriter:
    """Accumulates one split's tokens and writes a shard at each `shard_tokens` boundary."""

    def __init__(self, folder: Path, prefix: str, shard_tokens: int, vocab_size: int,
                 eot_id: int, tok_hash: str):
        self.folder, self.prefix, self.shard_tokens = folder, prefix, shard_tokens
        self.meta = {"vocab_size": vocab_size, "eot_id": eot_id, "tokenizer_hash": tok_hash}
        self.parts: list[np.ndarray] = []
        self.tokens = self.docs = self.bytes = 0
        self.written: list[Path] = []
        self.total = {"documents": 0, "tokens": 0, "bytes": 0}
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, tokens: np.ndarray, doc_tokens: np.ndarray, doc_bytes: np.ndarray) -> None:
        """Documents laid end to end in `tokens` (EOT included), with per-document sizes."""
        while len(doc_tokens):
            room = self.shard_tokens - self.tokens
            ends = np.cumsum(doc_tokens)
            take = int(np.searchsorted(ends, room, side="left")) + 1  # docs until the shard is full
            take = min(take, len(doc_tokens))
            n_tokens = int(ends[take - 1])
            self.parts.append(tokens[:n_tokens])
            self.tokens += n_tokens
            self.docs += take
            self.bytes += int(doc_bytes[:take].sum())
            tokens, doc_tokens, doc_bytes = tokens[n_tokens:], doc_tokens[take:], doc_bytes[take:]
            if self.tokens >= self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        path = self.folder / f"{self.prefix}_{len(self.written):05d}.bin"
        write_shard(path, np.concatenate(self.parts), num_docs=self.docs, num_bytes=self.bytes,
                    **self.meta)
        self.written.append(path)
        for key, value in (("documents", self.docs), ("tokens", self.tokens),
                           ("bytes", self.bytes)):
            self.total[key] += value
        self.parts, self.tokens, self.docs, self.bytes = [], 0, 0, 0


def _batches(docs: Iterable[str], batch_bytes: int) -> Iterator[tuple[list[str], list[int]]]:
    """Documents grouped into batches of about `batch_bytes` UTF-8 bytes, with each one's size."""
    batch: list[str] = []
    sizes: list[int] = []
    size = 0
    for text in docs:
        n = len(text.encode("utf-8", "surrogatepass"))
        batch.append(text)
        sizes.append(n)
        size += n
        if size >= batch_bytes:
            yield batch, sizes
            batch, sizes, size = [], [], 0
    if batch:
        yield batch, sizes


def _prepare(out_dir: Path, overwrite: bool) -> None:
    old = [p for split in SPLITS for p in (out_dir / split).glob("*.bin*")] \
        if out_dir.is_dir() else []
    if old and not overwrite:
        raise EncodeError(f"{out_dir} already holds {len(old)} shard(s); new shards would mix "
                          "with them. Choose an empty folder or pass --overwrite to replace them")
    for path in old:
        path.unlink()


def encode_to_shards(tokenizer_path: str | Path, docs: Iterable[str], out_dir: str | Path, *,
                     val_fraction: float = 0.05, shard_tokens: int = SHARD_TOKENS,
                     batch_size: int | None = None, batch_bytes: int = BATCH_BYTES, seed: int = 0,
                     overwrite: bool = False, progress: bool = False,
                     threads: int | None = None) -> dict[str, list[Path]]:
    """Write out_dir/train/*.bin and out_dir/val/*.bin; returns the shard paths per split.

    `tokenizer_path` is a tokenizer.json or a SentencePiece .model. `batch_size` (documents per
    encode call) is accepted for old callers; batches are cut by `batch_bytes`. A summary with
    counts, the tokenizer hash and the throughput goes to out_dir/encode.json.
    """
    del batch_size  # superseded by batch_bytes; documents vary too much in size to batch by count
    if not 0 <= val_fraction < 1:
        raise EncodeError(f"the validation fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise EncodeError(f"shard_tokens must be positive, got {shard_tokens}")
    codec = open_codec(tokenizer_path, threads=threads)
    out_dir = Path(out_dir)
    _prepare(out_dir, overwrite)
    meta = (codec.vocab_size, codec.eot_id, codec.hash)
    writers = {split: _ShardWriter(out_dir / split, split, shard_tokens, *meta) for split in SPLITS}
    dtype = np.dtype(dtype_for(codec.vocab_size))
    bar = _progress_bar(progress)
    start = time.perf_counter()
    index = 0
    for batch, sizes in _batches(docs, batch_bytes):
        encoded = codec.encode_batch(batch)
        held = np.fromiter((is_held_out(index + i, text, val_fraction, seed)
                            for i, text in enumerate(batch)), dtype=bool, count=len(batch))
        index += len(batch)
        _add_batch(writers, encoded, held, np.asarray(sizes, dtype=np.int64), codec.eot_id, dtype)
        if bar is not None:
            bar.update(sum(sizes))
            bar.set_postfix(docs=index, refresh=False)
    for writer in writers.values():
        writer.flush()
    elapsed_s = time.perf_counter() - start
    if bar is not None:
        bar.close()
    _write_summary(out_dir, codec, writers, elapsed_s, val_fraction, seed, shard_tokens)
    return {split: w.written for split, w in writers.items()}


def _add_batch(writers: dict[str, _ShardWriter], encoded: list[list[int]], held: np.ndarray,
               doc_bytes: np.ndarray, eot_id: int, dtype: np.dtype) -> None:
    doc_tokens = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    for ids in encoded:
        ids.append(eot_id)
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype,
                       count=int(doc_tokens.sum()))
    token_held = np.repeat(held, doc_tokens)
    for split, mask, token_mask in (("train", ~held, ~token_held), ("val", held, token_held)):
        if mask.any():
            writers[split].add(flat[token_mask], doc_tokens[mask], doc_bytes[mask])


def _progress_bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(desc="encode", unit="B", unit_scale=True, unit_divisor=1024, mininterval=1.0,
                smoothing=0.1)


def _write_summary(out_dir: Path, codec: Codec, writers: dict[str, _ShardWriter],
                   elapsed_s: float, val_fraction: float, seed: int, shard_tokens: int) -> None:
    text_bytes = sum(w.total["bytes"] for w in writers.values())
    summary = {
        "tokenizer": str(codec.path), "tokenizer_hash": codec.hash, "family": codec.family,
        "vocab_size": codec.vocab_size, "eot_id": codec.eot_id,
        "val_fraction": val_fraction, "seed": seed, "shard_tokens": shard_tokens,
        "splits": {split: {**w.total, "shards": [p.name for p in w.written]}
                   for split, w in writers.items()},
        "elapsed_s": round(elapsed_s, 3),
        "text_mb_per_s": round(text_bytes / 1e6 / max(elapsed_s, 1e-9), 3),
    }
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
