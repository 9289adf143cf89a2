"""Duplicate clusters: union-find over candidate pairs, one document kept per cluster.

Owns: `UnionFind` (path halving; the root of a set is its smallest member), `clusters_from_pairs`
(pairs of document keys -> which keys to remove, and the cluster sizes) and the size histogram the
report plots. Must not: read files or compute signatures.

Follows FineWeb §3.4 and datatrove's MinhashDedupCluster (src/datatrove/pipeline/dedup/minhash.py):
candidate pairs are merged transitively and one document per cluster survives. We keep the
cluster member with the smallest global key (the earliest in input order), so the survivor does not
depend on sharding or on the order pairs arrive in.
"""

from __future__ import annotations

from dataclasses import dataclass

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
