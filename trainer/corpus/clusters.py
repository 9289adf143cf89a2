"""Duplicate clusters: candidate pairs -> connected components, one document kept per cluster.

Owns: `connected_clusters` (the production path: sparse connected components, scipy), the
in-memory reference it is checked against (`UnionFind`, `clusters_from_pairs`: pure Python, one
core), `merge_unique_pairs` (pairs deduplicated across bands in batches), `exact_duplicates` and
the size histogram the report plots. Must not: read files or compute signatures.

Follows FineWeb §3.4 and datatrove's MinhashDedupCluster (src/datatrove/pipeline/dedup/minhash.py):
candidate pairs are merged transitively and one document per cluster survives. We keep the
cluster member with the smallest global key (the earliest in input order), so the survivor does not
depend on sharding or on the order pairs arrive in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np


class UnionFind:
    """Disjoint sets over 0..n-1. Unions attach the larger root under the smaller one."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]   # path halving
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        root_a, root_b = self.find(a), self.find(b)
        if root_a != root_b:
            low, high = (root_a, root_b) if root_a < root_b else (root_b, root_a)
            self.parent[high] = low


@dataclass
class Clusters:
    remove: np.ndarray         # sorted uint64 keys of documents that lose to their cluster's root
    sizes: np.ndarray          # size of every cluster with 2 or more members


def clusters_from_pairs(pairs: np.ndarray) -> Clusters:
    """`pairs`: (m, 2) uint64 keys of candidate duplicates. Transitive closure, keep smallest key."""
    if pairs.size == 0:
        return Clusters(np.zeros(0, np.uint64), np.zeros(0, np.int64))
    keys, dense = np.unique(pairs.reshape(-1), return_inverse=True)   # keys sorted: root = min
    dense = dense.reshape(-1, 2)
    sets = UnionFind(len(keys))
    for a, b in dense.tolist():
        sets.union(a, b)
    roots = np.fromiter((sets.find(i) for i in range(len(keys))), dtype=np.int64, count=len(keys))
    members = np.arange(len(keys))
    _, sizes = np.unique(roots, return_counts=True)
    return Clusters(remove=np.sort(keys[roots != members]), sizes=sizes[sizes >= 2])


_PAIR = np.dtype((np.void, 16))    # one (member, head) pair of uint64 keys as a 16-byte record

# Room for this many pairs is reserved before the first merge (virtual memory: a page counts only
# once a pair is written to it). 32M pairs are 512 MB. A smaller buffer re-sorts the distinct
# pairs more often: with all 22M pairs of 20M documents in one task (14 bands, 2.9M distinct),
# merging every 1M pairs cost 0.72 s per million documents against 0.39 s for one sort. A links
# task (dedup.py) now holds about 1.1M pairs per million documents of its partition, so the first
# merge is usually the only one.
MIN_BATCH_ROWS = 1 << 25


def _as_rows(pairs: np.ndarray) -> np.ndarray:
    """(m, 2) uint64 pairs viewed as m 16-byte records, so one sort orders and dedupes rows."""
    return np.ascontiguousarray(pairs, dtype=np.uint64).view(_PAIR).ravel()


def _compact(rows: np.ndarray, filled: int) -> int:
    """Sort rows[:filled] in place and move its distinct rows to the front; returns their count."""
    head = rows[:filled]
    head.sort()
    if filled == 0:
        return 0
    first = np.empty(filled, dtype=bool)
    first[0] = True
    first[1:] = head[1:] != head[:-1]       # void rows compare with ==/!= but have no ufunc
    distinct = head[first]
    rows[:distinct.size] = distinct
    return distinct.size


def merge_unique_pairs(batches: Iterable[np.ndarray],
                       min_batch_rows: int = MIN_BATCH_ROWS) -> np.ndarray:
    """The distinct rows of many (m, 2) pair arrays, read one at a time.

    The same pair comes out of every band its two documents share (up to 14 with FineWeb's
    setting), so holding every band's pairs and then deduplicating them would cost up to 14x the
    distinct pairs, twice over (np.unique sorts a copy). Instead, batches are copied into one
    buffer of `min_batch_rows` pairs; when it is full, it is sorted in place and its distinct
    pairs move to the front, and the buffer doubles only when those fill it. Memory: the buffer's
    written part plus one copy of the distinct pairs.
    """
    rows = np.empty(min_batch_rows, _PAIR)
    filled = 0
    for batch in batches:
        batch = _as_rows(batch)
        if filled + batch.size > rows.size:
            filled = _compact(rows, filled)
            if filled + batch.size > rows.size:       # the distinct pairs alone fill it: grow
                grown = np.empty(max(2 * rows.size, filled + batch.size), _PAIR)
                grown[:filled] = rows[:filled]
                rows = grown
        rows[filled:filled + batch.size] = batch
        filled += batch.size
    filled = _compact(rows, filled)
    return rows[:filled].copy().view(np.uint64).reshape(-1, 2)   # the copy frees the buffer


def connected_clusters(pairs: np.ndarray, without: Iterable[np.ndarray] = ()) -> Clusters:
    """Same result as `clusters_from_pairs` (transitive closure, the smallest key survives), by
    scipy's sparse connected components: C code, memory linear in the pairs, no Python loop per
    pair (the reference union-find takes minutes and tens of GB at 10^8 pairs).

    `without`: arrays of keys (any order) whose pairs are left out, as if those documents were not
    there (already removed by another rule). Each array is looked up among the pairs' keys, not
    the other way round, so the many exact copies of a large corpus cost one search each."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    if pairs.size == 0:
        return Clusters(np.zeros(0, np.uint64), np.zeros(0, np.int64))
    keys, dense = np.unique(pairs.reshape(-1), return_inverse=True)   # ascending: id order = key order
    dense = dense.reshape(-1, 2).astype(np.int32 if len(keys) < 2**31 else np.int64)
    absent = np.zeros(len(keys), dtype=bool)
    for removed in without:
        at = np.searchsorted(keys, removed).clip(max=len(keys) - 1)
        absent[at[keys[at] == removed]] = True
    if absent.any():
        dense = dense[~absent[dense].any(axis=1)]
    graph = coo_matrix((np.ones(len(dense), np.int8), (dense[:, 0], dense[:, 1])),
                       shape=(len(keys), len(keys)))
    count, labels = connected_components(graph, directed=False)
    del graph, dense
    # Each cluster's smallest id is its smallest key: the survivor. (ufunc.at and bincount are
    # linear; np.unique(labels, return_index=True) would sort them again.) A document whose every
    # pair was left out is a cluster of its own, so it is not removed.
    ids = np.arange(len(keys))
    first = np.full(count, len(keys))
    np.minimum.at(first, labels, ids)
    sizes = np.bincount(labels, minlength=count)
    return Clusters(remove=keys[first[labels] != ids], sizes=sizes[sizes >= 2])


def exact_duplicates(keys: np.ndarray, digests: np.ndarray) -> Clusters:
    """Documents whose content digest equals an earlier document's: all but the smallest key of
    each group are removed. `digests` is any array numpy can sort (e.g. 16-byte strings)."""
    if keys.size == 0:
        return Clusters(np.zeros(0, np.uint64), np.zeros(0, np.int64))
    order = np.lexsort((keys, digests))               # by digest, then key
    sorted_digests, sorted_keys = digests[order], keys[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = sorted_digests[1:] != sorted_digests[:-1]
    group_ids = np.cumsum(starts) - 1
    sizes = np.bincount(group_ids)
    return Clusters(remove=np.sort(sorted_keys[~starts]), sizes=sizes[sizes >= 2])


def size_histogram(sizes: np.ndarray) -> dict[str, int]:
    """Cluster sizes in power-of-two bins ("2", "3-4", "5-8", ...), for the report."""
    histogram: dict[str, int] = {}
    low = 2
    while sizes.size and low <= sizes.max():
        high = max(low, 2 * (low - 1))
        label = str(low) if low == high else f"{low}-{high}"
        count = int(((sizes >= low) & (sizes <= high)).sum())
        if count:
            histogram[label] = count
        low = high + 1
    return histogram
