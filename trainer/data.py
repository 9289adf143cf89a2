"""Tokenized shards and the deterministic sampler that feeds the training loop.

Shard format (`*.bin`), written by `write_shard`, read with a memory map:
  bytes 0..8      magic b"CRUCTOK1"
  bytes 8..12     little-endian uint32: length n of the JSON header
  bytes 12..12+n  JSON: dtype ("uint16" | "uint32"), vocab_size, num_tokens, num_docs,
                  num_bytes (UTF-8 bytes of the text the tokens encode, for bits per byte),
                  eot_id, tokenizer_hash
  bytes 4096..    the tokens, documents separated by eot_id
The fixed 4 KiB data offset keeps the token array page-aligned for `np.memmap`.

Sampling is a pure function of (seed, sample index): the stream of all shards is cut into
windows of seq_len+1 tokens, and sample g of the run is window perm_e(g mod n) of epoch
e = g div n, where perm_e is a keyed Feistel permutation (O(1) memory at any corpus size).
A step that starts after c training tokens consumes samples [c/T + offset, c/T + B + offset),
where T is seq_len and B the step's global batch in sequences (constant, or growing over a
batch ramp: crucible.api.batch_ramp); rank r of W takes a contiguous 1/W of them. So the data
order is addressed by tokens trained on, not by step: it does not depend on the world size (an
elastic restart on fewer nodes continues the same order), nor on how the tokens were cut into
steps (a changed batch continues at the first unseen sample), and the sampler's whole state is
{seed, sample_offset}: the samples skipped beyond those trained on (`skip` moves the offset past
a bad data window).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"CRUCTOK1"
DATA_OFFSET = 4096


class DataError(ValueError):
    """Missing, malformed or mismatched shards: a message the user can act on."""


@dataclass(frozen=True)
class ShardHeader:
    dtype: str
    vocab_size: int
    num_tokens: int
    num_docs: int
    num_bytes: int
    eot_id: int
    tokenizer_hash: str

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_shard(path: str | Path, tokens: np.ndarray, *, vocab_size: int, num_docs: int,
                num_bytes: int, eot_id: int, tokenizer_hash: str) -> ShardHeader:
    """Write tokens as a shard; written to a temp name and renamed, so readers never see half."""
    path = Path(path)
    dtype = dtype_for(vocab_size)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise DataError(f"token ids must be in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    header = ShardHeader(dtype, vocab_size, int(tokens.size), num_docs, num_bytes, eot_id,
                         tokenizer_hash)
    blob = header.to_json()
    if 12 + len(blob) > DATA_OFFSET:
        raise DataError("shard header too large")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(blob)) + blob)
        f.write(b"\0" * (DATA_OFFSET - 12 - len(blob)))
        f.write(tokens.astype(dtype, copy=False).tobytes())
    tmp.rename(path)
    return header


def read_header(path: str | Path) -> ShardHeader:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(DATA_OFFSET)
    except FileNotFoundError:
        raise DataError(f"shard {path} does not exist") from None
    if len(head) < 12 or head[:8] != MAGIC:
        raise DataError(f"{path} is not a Crucible token shard (bad magic); write shards with "
                        "`crucible tokenizer encode`")
    (n,) = struct.unpack("<I", head[8:12])
    try:
        header = ShardHeader(**json.loads(head[12:12 + n]))
    except (ValueError, TypeError) as err:
        raise DataError(f"{path} has a corrupt header: {err}") from None
    expected = DATA_OFFSET + header.num_tokens * np.dtype(header.dtype).itemsize
    if path.stat().st_size != expected:
        raise DataError(f"{path} is truncated or padded: {path.stat().st_size} bytes, header "
                        f"says {expected}")
    return header


class ShardSet:
    """All `*.bin` shards of a folder, in name order, as one memory-mapped token stream."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not folder.is_dir():
            raise DataError(f"shard folder {folder} does not exist")
        self.paths = sorted(folder.glob("*.bin"))
        if not self.paths:
            raise DataError(f"no *.bin shards in {folder}; create them with "
                            "`crucible tokenizer encode`")
        self.headers = [read_header(p) for p in self.paths]
        first = self.headers[0]
        for path, h in zip(self.paths, self.headers):
            if (h.vocab_size, h.tokenizer_hash) != (first.vocab_size, first.tokenizer_hash):
                raise DataError(f"{path} was encoded with a different tokenizer than "
                                f"{self.paths[0]} (hash {h.tokenizer_hash[:12]} vs "
                                f"{first.tokenizer_hash[:12]})")
        self.vocab_size, self.tokenizer_hash = first.vocab_size, first.tokenizer_hash
        self.eot_id = first.eot_id
        self.arrays = [np.memmap(p, dtype=h.dtype, mode="r", offset=DATA_OFFSET,
                                 shape=(h.num_tokens,)) for p, h in zip(self.paths, self.headers)]
        self.starts = np.cumsum([0] + [h.num_tokens for h in self.headers])
        self.num_tokens = int(self.starts[-1])
        self.num_bytes = sum(h.num_bytes for h in self.headers)

    @property
    def bytes_per_token(self) -> float:
        return self.num_bytes / max(1, self.num_tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the concatenated stream (may span shards)."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            offset = start + filled - int(self.starts[i])
            take = min(length - filled, len(self.arrays[i]) - offset)
            out[filled:filled + take] = self.arrays[i][offset:offset + take]
            filled += take
            i += 1
        return out

    def check_compatible(self, model_vocab_size: int, tokenizer_hash: str | None = None) -> None:
        if self.vocab_size > model_vocab_size:
            raise DataError(f"shards use a vocabulary of {self.vocab_size} tokens but "
                            f"model.vocabSize is {model_vocab_size}; set model.vocabSize >= "
                            f"{self.vocab_size} (a multiple of 64 is fastest)")
        if tokenizer_hash is not None and tokenizer_hash != self.tokenizer_hash:
            raise DataError(f"the shards were encoded with tokenizer {self.tokenizer_hash[:12]} "
                            f"but data.tokenizer is {tokenizer_hash[:12]}; re-encode the corpus "
                            "or point data.tokenizer at the tokenizer that made the shards")


# --- permutation ---------------------------------------------------------------------------------
def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit integer hash (SplitMix64's finaliser) of x keyed by `key`; vectorised."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(key)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def feistel_permute(index: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """A keyed bijection of [0, n) evaluated at `index`: a balanced Feistel network over the
    smallest even-bit domain >= n, with cycle-walking to stay inside [0, n)."""
    if n <= 1:
        return np.zeros_like(index, dtype=np.int64)
    half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half_bits) - 1)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(half_bits), x[todo] & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix(right, key * 31 + r) & mask)
        y = (left << np.uint64(half_bits)) | right
        x[todo] = y
        todo[todo] = y >= np.uint64(n)  # outside [0, n): walk the cycle until inside
    return x.astype(np.int64)


@dataclass
class Sampler:
    """Which windows each rank reads at each step; `state_dict` is all a checkpoint needs."""

    shards: ShardSet
    seq_len: int
    seed: int
    sample_offset: int = 0
    restored_num_tokens: int | None = None  # the shard set's size in the last loaded checkpoint

    @property
    def windows_per_epoch(self) -> int:
        n = (self.shards.num_tokens - 1) // self.seq_len
        if n < 1:
            raise DataError(f"the shards hold {self.shards.num_tokens} tokens, fewer than one "
                            f"sequence of {self.seq_len + 1}")
        return n

    def window_starts(self, sample_indices: np.ndarray) -> np.ndarray:
        n = self.windows_per_epoch
        epoch, within = np.divmod(sample_indices, n)
        starts = np.empty_like(sample_indices)
        for e in np.unique(epoch):
            sel = epoch == e
            starts[sel] = feistel_permute(within[sel], n, key=self.seed * 7919 + int(e))
        return starts * self.seq_len

    def batch(self, start: int, micro: int, *, global_batch: int, micro_batch: int, rank: int,
              world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets, each (micro_batch, seq_len) int64, for one micro-step of a rank,
        of the step whose first sample is `start` (tokens trained on before it / seq_len) and
        whose global batch is `global_batch` sequences."""
        per_rank = global_batch // world_size
        first = start + self.sample_offset + rank * per_rank + micro * micro_batch
        idx = np.arange(first, first + micro_batch, dtype=np.int64)
        rows = np.stack([self.shards.read(int(s), self.seq_len + 1) for s in self.window_starts(idx)])
        return rows[:, :-1], rows[:, 1:]

    def epochs_at(self, tokens_seen: int) -> float:
        return (tokens_seen // self.seq_len + self.sample_offset) / self.windows_per_epoch

    def skip(self, samples: int) -> None:
        """Move past `samples` samples (a spike's data window) without reading them."""
        self.sample_offset += samples

    def state_dict(self) -> dict:
        # Keys are a contract with every checkpoint written: DCP refuses to load a key a
        # checkpoint lacks, so a new one would orphan the checkpoints made before it.
        return {"seed": self.seed, "sample_offset": self.sample_offset,
                "num_tokens": self.shards.num_tokens}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.sample_offset = int(state["seed"]), int(state["sample_offset"])
        self.restored_num_tokens = int(state["num_tokens"])

