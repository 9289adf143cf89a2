"""Duplicate clusters: candidate pairs -> connected components, one document kept per cluster.

Owns: the star steps (`small_star`, `large_star`: connected components in steps over partitions
of keys, the production path; `star_clusters` runs them all in one process), the in-memory
reference they are checked against (`UnionFind`, `clusters_from_pairs`: pure Python, one core),
`merge_unique_pairs` (pairs deduplicated across bands in batches), `exact_duplicates` and the size
histogram the report plots. Must not: read files or compute signatures.

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


# ---- connected components in steps: large-star / small-star ---------------------------------
# Kiveris, Lattanzi, Mirrokni, Rastogi, Vassilvitskii, "Connected Components in MapReduce and
# Beyond" (SoCC 2014). Each step groups undirected edges by one endpoint (the key), so a step is one
# task per partition of keys and no task holds more than its keys' edges; steps repeat until the
# graph is a set of stars, each centred on its component's smallest key. Written here because no
# maintained library runs components over partitioned files (scipy's and networkx's hold the
# whole graph; datatrove's cluster stage is one task holding every pair).
# Rows are (key, other) uint64 edges of the task's keys; edges come out as (larger, smaller).

@dataclass
class StarStep:
    edges: np.ndarray          # (k, 2) uint64 (larger, smaller), possibly repeated
    changes: int               # input edges this step replaced: 0 at its fixed point
    centre_sizes: np.ndarray   # large-star: size of the star centred on each local minimum
                               # among the keys (cluster sizes once the steps have converged)


def _grouped(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Distinct rows sorted by (key, other): keys, others, the first row of each key's group, and
    each row's group number."""
    order = np.lexsort((rows[:, 1], rows[:, 0]))
    keys, others = rows[order, 0], rows[order, 1]
    distinct = np.ones(len(keys), dtype=bool)
    distinct[1:] = (keys[1:] != keys[:-1]) | (others[1:] != others[:-1])
    keys, others = keys[distinct], others[distinct]
    starts = np.ones(len(keys), dtype=bool)
    starts[1:] = keys[1:] != keys[:-1]
    return keys, others, starts, np.cumsum(starts) - 1


def _no_edges() -> StarStep:
    return StarStep(np.zeros((0, 2), np.uint64), 0, np.zeros(0, np.int64))


def small_star(rows: np.ndarray) -> StarStep:
    """Rows: every edge of the task's keys to a smaller node. Each key and each of its smaller
    neighbours are linked to the smallest of those neighbours. A key with one smaller neighbour
    changes nothing."""
    if rows.size == 0:
        return _no_edges()
    keys, others, starts, group = _grouped(rows)
    smallest = others[starts][group]              # sorted: a group's first row has its minimum
    linked = ~starts                              # (other, smallest) for the group's other rows
    edges = np.concatenate([np.stack([others[linked], smallest[linked]], axis=1),
                            np.stack([keys[starts], others[starts]], axis=1)])
    return StarStep(edges, int(linked.sum()), np.zeros(0, np.int64))


def large_star(rows: np.ndarray) -> StarStep:
    """Rows: every edge of the task's keys, in both directions. Each larger neighbour of a key is
    linked to the smallest node of the key's neighbourhood (the key included)."""
    if rows.size == 0:
        return _no_edges()
    keys, others, starts, group = _grouped(rows)
    smallest = np.minimum(keys, others[starts][group])
    larger = others > keys
    edges = np.stack([others[larger], smallest[larger]], axis=1)
    changes = int((larger & (smallest < keys)).sum())
    # A key smaller than all its neighbours is a centre: its neighbours plus itself.
    centre = starts & (smallest == keys)
    sizes = np.bincount(group)[centre[starts]] + 1
    return StarStep(edges, changes, sizes)


def both_directions(edges: np.ndarray) -> np.ndarray:
    """Each edge as two rows, (a, b) and (b, a): a large-star step needs every edge at both keys."""
    return np.concatenate([edges, edges[:, ::-1]])


def star_clusters(pairs: np.ndarray, max_steps: int = 256) -> Clusters:
    """All the steps in one process (the partitioned stages run the same functions, one partition
    of keys per task): small-star and large-star in turn until a pair of them changes nothing.
    Same result as `clusters_from_pairs`; `pairs` are (member, head) with member > head."""
    rows = np.ascontiguousarray(pairs, dtype=np.uint64).reshape(-1, 2)
    small = small_star(rows)
    for _ in range(max_steps):
        large = large_star(both_directions(small.edges))
        if small.changes == 0 and large.changes == 0:
            removed = np.unique(large.edges[:, 0])
            return Clusters(remove=removed, sizes=large.centre_sizes)
        small = small_star(large.edges)
    raise RuntimeError(f"connected components did not converge in {max_steps} steps")


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
