"""Encode documents into training shards (the format in `crucible.trainer.data`).

Documents are split into train and validation by a hash of their position and text, so the split
is reproducible and never cuts a document in two. Each document is followed by the end-of-text
token, and each shard records the tokenizer's hash and how many UTF-8 bytes its tokens encode
(for bits-per-byte evaluation).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

import numpy as np

from crucible.trainer.data import write_shard
from crucible.trainer.tokenizer.bpe import EOT, batched, load, tokenizer_hash


def is_validation(index: int, text: str, val_fraction: float, seed: int = 0) -> bool:
    digest = hashlib.blake2b(f"{seed}:{index}:".encode() + text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


class _ShardWriter:
    def __init__(self, folder: Path, prefix: str, shard_tokens: int, vocab_size: int,
                 eot_id: int, tok_hash: str):
        self.folder, self.prefix, self.shard_tokens = folder, prefix, shard_tokens
        self.meta = {"vocab_size": vocab_size, "eot_id": eot_id, "tokenizer_hash": tok_hash}
        self.parts: list[np.ndarray] = []
        self.tokens = self.docs = self.bytes = 0
        self.written: list[Path] = []
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, ids: list[int], num_bytes: int) -> None:
        self.parts.append(np.asarray(ids, dtype=np.int64))
        self.tokens += len(ids)
        self.docs += 1
        self.bytes += num_bytes
        if self.tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        path = self.folder / f"{self.prefix}_{len(self.written):05d}.bin"
        write_shard(path, np.concatenate(self.parts), num_docs=self.docs, num_bytes=self.bytes,
                    **self.meta)
        self.written.append(path)
        self.parts, self.tokens, self.docs, self.bytes = [], 0, 0, 0


def encode_to_shards(tokenizer_path: str | Path, docs: Iterable[str], out_dir: str | Path, *,
                     val_fraction: float = 0.05, shard_tokens: int = 1 << 24,
                     batch_size: int = 256, seed: int = 0) -> dict[str, list[Path]]:
    """Write out_dir/train/*.bin and out_dir/val/*.bin; returns the shard paths per split."""
    tok = load(tokenizer_path)
    eot = tok.token_to_id(EOT)
    meta = (tok.get_vocab_size(), eot, tokenizer_hash(tokenizer_path))
    out_dir = Path(out_dir)
    writers = {"train": _ShardWriter(out_dir / "train", "train", shard_tokens, *meta),
               "val": _ShardWriter(out_dir / "val", "val", shard_tokens, *meta)}
    index = 0
    for batch in batched(docs, batch_size):
        for text, enc in zip(batch, tok.encode_batch(batch)):
            split = "val" if is_validation(index, text, val_fraction, seed) else "train"
            writers[split].add(enc.ids + [eot], len(text.encode("utf-8")))
            index += 1
    for w in writers.values():
        w.flush()
    return {split: w.written for split, w in writers.items()}
