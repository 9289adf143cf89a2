"""Synthetic dedup signatures with planted clusters, at any scale, without any text.

Stage 1's output for a corpus of `docs` documents split over `shards` shards (one input file per
shard), made directly: every document gets its own digest and band keys, then a share of them is
turned into copies of another document picked at random anywhere in the corpus (any shard, earlier
or later): exact copies take its digest and every band key, near copies a random non-empty subset
of its band keys. Copies of copies make chains, so clusters are transitive and cross shards.
Used by tests/corpus/test_dedup_scale.py and bench/dedup_scale.py, which compare the partitioned
stages with the in-memory path on it.
"""

from __future__ import annotations

import numpy as np

from crucible.trainer.corpus.dedup import DIGEST_DTYPE
from crucible.trainer.corpus.document import RECORD_BITS

EXACT_SHARE = 0.05
NEAR_SHARE = 0.10


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (Steele et al., SplitMix): distinct inputs, distinct outputs."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _digests(ids: np.ndarray) -> np.ndarray:
    pair = np.stack([splitmix64(ids), splitmix64(ids ^ np.uint64(0xA5A5A5A5A5A5A5A5))], axis=1)
    return np.ascontiguousarray(pair).view(DIGEST_DTYPE).ravel()


def _band_keys(ids: np.ndarray, bands: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return splitmix64(ids[:, None] * np.uint64(bands) + np.arange(bands, dtype=np.uint64)
                          + np.uint64(1 << 62))


def shard_signatures(shard: int, shards: int, docs: int, bands: int = 14,
                     seed: int = 0) -> dict[str, np.ndarray]:
    """Stage 1's arrays (dedup.signatures' format) for shard `shard` of a `docs`-document corpus
    with the documents dealt out evenly. Deterministic in (shard, shards, docs, bands, seed)."""
    per_shard = -(-docs // shards)
    first = shard * per_shard
    count = max(0, min(docs, first + per_shard) - first)
    ids = np.arange(first, first + count, dtype=np.uint64)       # global document ids
    rng = np.random.default_rng([seed, shard])
    digests, band_keys = _digests(ids), _band_keys(ids, bands)
    kind = rng.random(count)
    roots = rng.integers(0, docs, count, dtype=np.uint64)
    exact = kind < EXACT_SHARE
    digests[exact] = _digests(roots[exact])
    band_keys[exact] = _band_keys(roots[exact], bands)
    near = (kind >= EXACT_SHARE) & (kind < EXACT_SHARE + NEAR_SHARE)
    shared = rng.random((int(near.sum()), bands)) < 0.3
    shared[np.arange(len(shared)), rng.integers(0, bands, len(shared))] = True   # >= 1 band
    band_keys[near] = np.where(shared, _band_keys(roots[near], bands), band_keys[near])
    local = ids - np.uint64(first)
    keys = (np.uint64(shard) << np.uint64(RECORD_BITS)) | local   # file `shard`, record `local`
    return {"keys": keys, "digests": digests, "bands": band_keys,
            "url_keys": np.zeros(0, np.uint64), "url_digests": np.zeros(0, DIGEST_DTYPE)}


def whole_corpus(shards: int, docs: int, bands: int = 14, seed: int = 0) -> dict[str, np.ndarray]:
    """Every shard's arrays concatenated (what the in-memory path reads)."""
    parts = [shard_signatures(s, shards, docs, bands, seed) for s in range(shards)]
    return {name: np.concatenate([p[name] for p in parts]) for name in ("keys", "digests", "bands")}
