"""Exact and MinHash-LSH near dedup as four stages that pass files, so N workers can share them.

Owns the stage bodies and their file formats:
  1. signatures (per shard): key, 128-bit content digest and one LSH key per band of every document
     -> dedup/signatures/shard-NNNNN.npz
  2. buckets (per band): documents sharing that band's key are candidate pairs (each paired with
     the bucket's smallest key) -> dedup/buckets/band-BB.npy, shape (m, 2) uint64
  3. clusters (one task): exact groups first, then union-find over the candidate pairs of what is
     left; all but the smallest key of each group or cluster is removed -> dedup/remove.npz and
     dedup/clusters.json (cluster-size histograms)
  4. filter (per shard): the `ExactDuplicate` and `NearDuplicate` filters drop what stage 3 chose.
Must not: decide which pipeline stage runs when (pipeline.py).

Follows datatrove's MinhashDedupSignature / Buckets / Cluster / Filter (src/datatrove/pipeline/
dedup/minhash.py) and ExactDedup (dedup/exact_dedup.py). Differences: stage 2 writes pairs to the
bucket's smallest key (a star), which is all union-find needs, instead of chains; the survivor of a
cluster is the smallest global key (earliest input) so results do not depend on sharding.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import ClassVar, Iterable

import numpy as np
import xxhash

from crucible.trainer import storage
from crucible.trainer.corpus.clusters import clusters_from_pairs, exact_duplicates, size_histogram
from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.minhash import MinHasher, MinhashConfig
from crucible.trainer.corpus.step import Filter, FilterResult

DIGEST_DTYPE = "S16"   # xxh3-128 of the UTF-8 text: no birthday collision below ~10^18 documents


def signatures_uri(output: str, shard: int) -> str:
    return storage.join(output, "dedup", "signatures", f"shard-{shard:05d}.npz")


def bucket_uri(output: str, band: int) -> str:
    return storage.join(output, "dedup", "buckets", f"band-{band:02d}.npy")


def remove_uri(output: str) -> str:
    return storage.join(output, "dedup", "remove.npz")


def clusters_uri(output: str) -> str:
    return storage.join(output, "dedup", "clusters.json")


def _save_npz(uri: str, **arrays: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    storage.write_bytes(uri, buffer.getvalue())


def _load_npz(uri: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(storage.read_bytes(uri))) as data:
        return {name: data[name] for name in data.files}


def signatures(docs: Iterable[Document], config: MinhashConfig | None) -> dict[str, np.ndarray]:
    """Stage 1 for one shard: keys (n,), digests (n,) S16 and band keys (n, bands)."""
    hasher = MinHasher(config) if config is not None else None
    keys, digests, bands = [], [], []
    for doc in docs:
        keys.append(doc.key)
        digests.append(xxhash.xxh3_128_digest(doc.text.encode("utf-8")))
        if hasher is not None:
            bands.append(hasher.keys_of(doc.text))
    n_bands = config.bands if config is not None else 0
    return {"keys": np.asarray(keys, dtype=np.uint64),
            "digests": np.asarray(digests, dtype=DIGEST_DTYPE),
            "bands": np.asarray(bands, dtype=np.uint64).reshape(len(keys), n_bands)}


def write_signatures(output: str, shard: int, arrays: dict[str, np.ndarray]) -> None:
    _save_npz(signatures_uri(output, shard), **arrays)


def bucket_pairs(keys: np.ndarray, band_keys: np.ndarray) -> np.ndarray:
    """Stage 2 for one band: (m, 2) pairs (member, smallest member) of every shared band key."""
    if keys.size == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    order = np.lexsort((keys, band_keys))
    sorted_bands, sorted_keys = band_keys[order], keys[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = sorted_bands[1:] != sorted_bands[:-1]
    heads = sorted_keys[np.flatnonzero(starts)][np.cumsum(starts) - 1]   # bucket's smallest key
    members = ~starts
    return np.stack([sorted_keys[members], heads[members]], axis=1)


def run_buckets(output: str, band: int, shard_count: int) -> int:
    """Stage 2 task: read every shard's column `band`, write its pairs. Returns the pair count."""
    keys, band_keys = [], []
    for shard in range(shard_count):
        arrays = _load_npz(signatures_uri(output, shard))
        keys.append(arrays["keys"])
        band_keys.append(arrays["bands"][:, band])
    pairs = bucket_pairs(np.concatenate(keys), np.concatenate(band_keys))
    buffer = io.BytesIO()
    np.save(buffer, pairs)
    storage.write_bytes(bucket_uri(output, band), buffer.getvalue())
    return len(pairs)


@dataclass
class Removal:
    exact: np.ndarray      # sorted keys removed as exact copies
    near: np.ndarray       # sorted keys removed as near copies


def run_clusters(output: str, shard_count: int, exact: bool,
                 near: MinhashConfig | None) -> dict:
    """Stage 3: decide every removal. Returns (and writes) the cluster summary for the report."""
    keys, digests = [], []
    for shard in range(shard_count):
        arrays = _load_npz(signatures_uri(output, shard))
        keys.append(arrays["keys"])
        digests.append(arrays["digests"])
    all_keys = np.concatenate(keys)
    exact_groups = exact_duplicates(all_keys, np.concatenate(digests)) if exact else None
    removed_exact = exact_groups.remove if exact_groups else np.zeros(0, np.uint64)

    near_clusters = None
    if near is not None:
        pairs = [np.load(io.BytesIO(storage.read_bytes(bucket_uri(output, band))))
                 for band in range(near.bands)]
        pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.uint64)
        # An exact copy has the same bands as its survivor, so its pairs add nothing.
        alive = ~np.isin(pairs, removed_exact).any(axis=1)
        near_clusters = clusters_from_pairs(pairs[alive])
    removed_near = near_clusters.remove if near_clusters else np.zeros(0, np.uint64)

    _save_npz(remove_uri(output), exact=removed_exact, near=removed_near)
    summary = {
        "documents": int(all_keys.size),
        "exact": None if exact_groups is None else {
            "groups": int(exact_groups.sizes.size), "removed": int(removed_exact.size),
            "group_sizes": size_histogram(exact_groups.sizes)},
        "near": None if near_clusters is None else {
            "config": str(near), "threshold": round(near.threshold, 4),
            "clusters": int(near_clusters.sizes.size), "removed": int(removed_near.size),
            "cluster_sizes": size_histogram(near_clusters.sizes)},
    }
    storage.write_bytes(clusters_uri(output), json.dumps(summary, indent=1).encode())
    return summary


def load_removal(output: str) -> Removal:
    arrays = _load_npz(remove_uri(output))
    return Removal(exact=arrays["exact"], near=arrays["near"])


def _contains(sorted_keys: np.ndarray, key: int) -> bool:
    at = int(np.searchsorted(sorted_keys, np.uint64(key)))
    return at < sorted_keys.size and int(sorted_keys[at]) == key


@dataclass
class ExactDuplicate(Filter):
    name: ClassVar[str] = "exact_dedup"
    why: ClassVar[str] = "the same text twice teaches nothing new and skews the mixture"

    removed: np.ndarray = None   # type: ignore[assignment]  # sorted keys chosen by stage 3

    def params(self) -> dict:
        return {"hash": "xxh3-128 of the normalised UTF-8 text", "keep": "earliest copy"}

    def filter(self, doc: Document) -> FilterResult:
        return (False, "exact_duplicate") if _contains(self.removed, doc.key) else True


@dataclass
class NearDuplicate(Filter):
    name: ClassVar[str] = "near_dedup"
    why: ClassVar[str] = "near copies (templates, mirrors, revisions) over-weight a few texts"

    removed: np.ndarray = None   # type: ignore[assignment]
    config: MinhashConfig = MinhashConfig()

    def params(self) -> dict:
        return {"n_grams": self.config.n_grams, "bands": self.config.bands,
                "rows": self.config.rows, "seed": self.config.seed,
                "threshold": round(self.config.threshold, 4), "keep": "earliest of each cluster"}

    def filter(self, doc: Document) -> FilterResult:
        return (False, "near_duplicate") if _contains(self.removed, doc.key) else True
