"""Exact, URL and MinHash-LSH near dedup as stages that pass files, each task holding only its
slice of the corpus, so a Common Crawl dump (10^8 documents) fits tasks of a few GB.

Owns the stage bodies and their file formats (P = `DedupConfig.partitions`, N = shards):
  1. signatures (per shard): each document's key, its 128-bit content digest (and URL digest),
     and one LSH key per band, written split by hash range into P partitions:
       dedup/digests/<family>/part-PPPPP/shard-NNNNN.npy   (key, digest) records
       dedup/bands/band-BB/part-PPPPP/shard-NNNNN.npy      (m, 2) uint64: key, band key
  2. exact (per family and partition): the partition's digests of every shard, sorted; all but the
     smallest key of each digest group is removed, and so is every document whose digest an
     earlier run in the persistent index holds -> dedup/<family>/part-PPPPP.npz
  3. buckets (per band and partition): documents sharing a band key are candidate pairs (each
     paired with the bucket's smallest key), written ordered by the links task that owns each
     pair's member -> dedup/pairs/band-BB-part-PPPPP.npy (m, 2) uint64 and, beside it,
     band-BB-part-PPPPP.routes.npy: the byte range of each links task's rows
  4. links (per partition of members): one byte range of every pair file, deduplicated across
     bands (clusters.merge_unique_pairs) -> dedup/links/part-PPPPP.npy, the distinct pairs whose
     member falls in the partition. A pair's member decides its partition, so the same pair
     found in 14 bands meets its copies in one task and no task sorts every pair.
  5. clusters (one task): the distinct pairs of every partition, without the documents removed
     as exact or URL copies, into connected components (scipy); all but the smallest key of each
     cluster is removed -> dedup/near/shard-NNNNN.npy per shard, and dedup/clusters.json (counts
     and size histograms for the report)
  6. filter (per shard): the `ExactDuplicate`, `UrlDuplicate` and `NearDuplicate` filters drop what
     stages 2 and 5 chose, each shard loading only its own keys.
Must not: decide which pipeline stage runs when (pipeline.py).

Memory per task: a signatures task holds its shard's signatures (~140 bytes per document); an
exact or buckets task one partition of one family or band (24 or 16 bytes per document of the
slice, about 3x that while sorting); a links task its partition's pairs from every band (16 bytes
each, up to 14 per near copy); the clusters task the distinct pairs (16 bytes each, one per near
copy and bucket it shares) and the keys removed as exact copies (8 bytes each). Nothing scales
with the whole corpus except the clusters task's input, and that only with its near duplicates.
bench/dedup_scale.py measures it.

Follows datatrove's MinhashDedupSignature / Buckets / Cluster / Filter (src/datatrove/pipeline/
dedup/minhash.py: its buckets stage also splits each band's hash range across workers), ExactDedup
(dedup/exact_dedup.py) and UrlDedup (dedup/url_dedup.py). Differences: stage 3 writes pairs to
the bucket's smallest key (a star), which is all connected components need, instead of chains; the
survivor of a cluster is the smallest global key (earliest input) so results do not depend on
sharding or partitioning.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import ClassVar, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import xxhash

from crucible.trainer import storage
from crucible.trainer.corpus.clusters import (clusters_from_pairs, connected_clusters,
                                              exact_duplicates, merge_unique_pairs, size_histogram)
from crucible.trainer.corpus.document import RECORD_BITS, Document
from crucible.trainer.corpus.minhash import MinHasher, MinhashConfig
from crucible.trainer.corpus.step import Filter, FilterResult

DIGEST_DTYPE = "S16"   # xxh3-128: no birthday collision below ~10^18 documents
DIGEST_RECORD = np.dtype([("key", "<u8"), ("digest", DIGEST_DTYPE)])
FAMILIES = ("exact", "url")   # what a digest is of: the normalised text, or the page's URL


# ---- file layout ----------------------------------------------------------------------------
def digest_part_uri(output: str, family: str, part: int, shard: int) -> str:
    return storage.join(output, "dedup", "digests", family, f"part-{part:05d}",
                        f"shard-{shard:05d}.npy")


def band_part_uri(output: str, band: int, part: int, shard: int) -> str:
    return storage.join(output, "dedup", "bands", f"band-{band:02d}", f"part-{part:05d}",
                        f"shard-{shard:05d}.npy")


def removed_uri(output: str, family: str, part: int) -> str:
    return storage.join(output, "dedup", family, f"part-{part:05d}.npz")


def pairs_uri(output: str, band: int, part: int) -> str:
    return storage.join(output, "dedup", "pairs", f"band-{band:02d}-part-{part:05d}.npy")


def routes_uri(output: str, band: int, part: int) -> str:
    return storage.join(output, "dedup", "pairs", f"band-{band:02d}-part-{part:05d}.routes.npy")


def links_uri(output: str, part: int) -> str:
    return storage.join(output, "dedup", "links", f"part-{part:05d}.npy")


def near_removed_uri(output: str, shard: int) -> str:
    return storage.join(output, "dedup", "near", f"shard-{shard:05d}.npy")


def clusters_uri(output: str) -> str:
    return storage.join(output, "dedup", "clusters.json")


def save_array(uri: str, array: np.ndarray) -> None:
    with storage.open_write(uri) as out:
        np.save(out, array, allow_pickle=False)


def load_array(uri: str) -> np.ndarray:
    if storage.is_s3(uri):
        return np.load(io.BytesIO(storage.read_bytes(uri)), allow_pickle=False)
    return np.load(uri, allow_pickle=False)


def _save_npz(uri: str, **arrays: np.ndarray) -> None:
    with storage.open_write(uri) as out:
        np.savez(out, **arrays)


def _load_npz(uri: str) -> dict[str, np.ndarray]:
    source = io.BytesIO(storage.read_bytes(uri)) if storage.is_s3(uri) else uri
    with np.load(source, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


# ---- partitions and shards ------------------------------------------------------------------
def partition_of(hashes: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of each uint64 hash (band keys, digest prefixes): uniform, as they are."""
    return (hashes % np.uint64(partitions)).astype(np.int64)


def digest_prefix(digests: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each 16-byte digest as uint64: what digests are partitioned by."""
    raw = np.ascontiguousarray(digests.astype(DIGEST_DTYPE)).view(np.uint8).reshape(-1, 16)
    return np.ascontiguousarray(raw[:, :8]).view("<u8").ravel()


def partition_of_keys(keys: np.ndarray, partitions: int) -> np.ndarray:
    """The links partition of each document key. Keys are (file, record) packed, so a plain
    modulus would follow record numbers; a multiplicative hash spreads them evenly."""
    mixed = (keys * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)   # wraps: that is the hash
    return partition_of(mixed, partitions)


def shard_of_keys(keys: np.ndarray, shard_count: int) -> np.ndarray:
    """The shard that owns each document key: shard i reads files i, i+N, ... (shards.py)."""
    return ((keys >> np.uint64(RECORD_BITS)) % np.uint64(shard_count)).astype(np.int64)


def keys_of_shard(sorted_keys: np.ndarray, shard: int, shard_count: int) -> np.ndarray:
    return sorted_keys[shard_of_keys(sorted_keys, shard_count) == shard]


# ---- stage 1: signatures --------------------------------------------------------------------
def normalise_url(url: str) -> str:
    """One spelling per page: scheme and host lower case, default port and fragment dropped.
    The path and query are kept as they are: servers may treat their case and order as
    meaningful, and merging two different pages would lose one."""
    try:
        parts = urlsplit(url.strip())
        host = (parts.hostname or "").rstrip(".")
        port = parts.port
    except ValueError:          # a malformed port or host: compare the text as it is
        return url.strip()
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    netloc = host if port is None or port == default else f"{host}:{port}"
    return urlunsplit((parts.scheme.lower(), netloc, parts.path or "/", parts.query, ""))


def signatures(docs: Iterable[Document], config: MinhashConfig | None,
               urls: bool = False) -> dict[str, np.ndarray]:
    """Stage 1 for one shard: keys (n,), digests (n,) S16, band keys (n, bands) and, with `urls`,
    url_keys/url_digests of the documents whose metadata has a "url"."""
    hasher = MinHasher(config) if config is not None else None
    keys, digests, bands, url_keys, url_digests = [], [], [], [], []
    for doc in docs:
        keys.append(doc.key)
        digests.append(xxhash.xxh3_128_digest(doc.text.encode("utf-8")))
        if hasher is not None:
            bands.append(hasher.keys_of(doc.text))
        url = doc.metadata.get("url") if urls else None
        if isinstance(url, str) and url:
            url_keys.append(doc.key)
            url_digests.append(xxhash.xxh3_128_digest(normalise_url(url).encode("utf-8")))
    n_bands = config.bands if config is not None else 0
    return {"keys": np.asarray(keys, dtype=np.uint64),
            "digests": np.asarray(digests, dtype=DIGEST_DTYPE),
            "bands": np.asarray(bands, dtype=np.uint64).reshape(len(keys), n_bands),
            "url_keys": np.asarray(url_keys, dtype=np.uint64),
            "url_digests": np.asarray(url_digests, dtype=DIGEST_DTYPE)}


def digest_records(keys: np.ndarray, digests: np.ndarray) -> np.ndarray:
    records = np.empty(len(keys), DIGEST_RECORD)
    records["key"], records["digest"] = keys, digests
    return records


def write_signatures(output: str, shard: int, arrays: dict[str, np.ndarray], partitions: int,
                     families: Iterable[str]) -> None:
    """Stage 1's files for one shard: every partition of every family and band, empty ones too
    (a missing file then means an unfinished task, never 'no documents')."""
    sources = {"exact": ("keys", "digests"), "url": ("url_keys", "url_digests")}
    for family in families:
        key_name, digest_name = sources[family]
        records = digest_records(arrays[key_name], arrays[digest_name])
        part = partition_of(digest_prefix(records["digest"]), partitions)
        for p in range(partitions):
            save_array(digest_part_uri(output, family, p, shard), records[part == p])
    keys, bands = arrays["keys"], arrays["bands"]
    for band in range(bands.shape[1]):
        column = bands[:, band]
        part = partition_of(column, partitions)
        for p in range(partitions):
            chosen = part == p
            save_array(band_part_uri(output, band, p, shard),
                       np.stack([keys[chosen], column[chosen]], axis=1))


# ---- stage 2: exact and URL groups ----------------------------------------------------------
@dataclass
class ExactPart:
    """One partition's decision: keys removed as later copies, and keys whose digest an earlier
    run already holds (every copy, the first one included)."""
    removed: np.ndarray
    earlier: np.ndarray
    sizes: np.ndarray          # sizes of the groups of 2 or more within this run


def decide_exact(records: np.ndarray, earlier_digests: Iterable[np.ndarray]) -> ExactPart:
    """`records`: (key, digest) of one partition. `earlier_digests`: sorted digest arrays of
    earlier runs (each may hold other partitions' digests too; only membership is asked)."""
    groups = exact_duplicates(records["key"], records["digest"])
    seen = np.zeros(len(records), dtype=bool)
    for known in earlier_digests:
        if known.size and records.size:
            at = np.searchsorted(known, records["digest"]).clip(max=known.size - 1)
            seen |= known[at] == records["digest"]
    return ExactPart(groups.remove, np.sort(records["key"][seen]), groups.sizes)


def run_exact(output: str, family: str, part: int, shard_count: int,
              earlier: Iterable[np.ndarray] = ()) -> dict:
    """Stage 2 task: read partition `part` of `family` from every shard, write its decision.
    Returns the partition's summary (merged by the clusters task for the report)."""
    records = np.concatenate([load_array(digest_part_uri(output, family, part, s))
                              for s in range(shard_count)]) if shard_count else \
        np.zeros(0, DIGEST_RECORD)
    decision = decide_exact(records, earlier)
    summary = {"documents": int(records.size), "groups": int(decision.sizes.size),
               "removed": int(decision.removed.size), "earlier_run": int(decision.earlier.size),
               "group_sizes": size_histogram(decision.sizes)}
    _save_npz(removed_uri(output, family, part), removed=decision.removed,
              earlier=decision.earlier, summary=np.frombuffer(json.dumps(summary).encode(), np.uint8))
    return summary


def exact_summary(summaries: Iterable[dict]) -> dict:
    """The partitions' summaries added up (histogram bins are fixed, so they add by label)."""
    total = {"documents": 0, "groups": 0, "removed": 0, "earlier_run": 0, "group_sizes": {}}
    for summary in summaries:
        for name in ("documents", "groups", "removed", "earlier_run"):
            total[name] += summary[name]
        for label, count in summary["group_sizes"].items():
            total["group_sizes"][label] = total["group_sizes"].get(label, 0) + count
    total["group_sizes"] = dict(sorted(total["group_sizes"].items(),
                                       key=lambda item: int(item[0].split("-")[0])))
    return total


def exact_removal_of_shard(output: str, family: str, partitions: int, shard: int,
                           shard_count: int) -> tuple[np.ndarray, np.ndarray]:
    """(removed, earlier) keys of one shard, each sorted, reading one partition at a time."""
    removed, earlier = [], []
    for part in range(partitions):
        arrays = _load_npz(removed_uri(output, family, part))
        removed.append(keys_of_shard(arrays["removed"], shard, shard_count))
        earlier.append(keys_of_shard(arrays["earlier"], shard, shard_count))
    return np.sort(np.concatenate(removed)), np.sort(np.concatenate(earlier))


# ---- stage 3: buckets -----------------------------------------------------------------------
def bucket_pairs(keys: np.ndarray, band_keys: np.ndarray) -> np.ndarray:
    """Stage 3 for one band (or a hash range of it): (m, 2) pairs (member, smallest member) of
    every shared band key."""
    if keys.size == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    order = np.lexsort((keys, band_keys))
    sorted_bands, sorted_keys = band_keys[order], keys[order]
    del order
    starts = np.ones(len(sorted_keys), dtype=bool)
    starts[1:] = sorted_bands[1:] != sorted_bands[:-1]
    heads = sorted_keys[np.flatnonzero(starts)][np.cumsum(starts) - 1]   # bucket's smallest key
    members = ~starts
    return np.stack([sorted_keys[members], heads[members]], axis=1)


def run_buckets(output: str, band: int, part: int, shard_count: int, partitions: int) -> int:
    """Stage 3 task: read partition `part` of `band` from every shard, write its pairs ordered by
    links partition with the byte range of each. Returns the pair count."""
    slices = [load_array(band_part_uri(output, band, part, s)) for s in range(shard_count)]
    rows = np.concatenate(slices) if slices else np.zeros((0, 2), np.uint64)
    del slices
    pairs = bucket_pairs(rows[:, 0].copy(), rows[:, 1].copy())
    del rows
    owner = partition_of_keys(pairs[:, 0], partitions)
    pairs = pairs[np.argsort(owner, kind="stable")]
    encoded = io.BytesIO()
    np.save(encoded, pairs, allow_pickle=False)
    data_start = encoded.tell() - pairs.nbytes        # the .npy header's length
    rows_before = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=partitions))])
    storage.write_bytes(pairs_uri(output, band, part), encoded.getvalue())
    save_array(routes_uri(output, band, part), data_start + rows_before * pairs.itemsize * 2)
    return len(pairs)


def load_route(output: str, band: int, part: int, links_part: int) -> np.ndarray:
    """The pairs of one buckets file whose member falls in `links_part`: one ranged read."""
    ranges = load_array(routes_uri(output, band, part))
    raw = storage.read_range(pairs_uri(output, band, part), int(ranges[links_part]),
                             int(ranges[links_part + 1]))
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 2)


# ---- stage 4: links -------------------------------------------------------------------------
def run_links(output: str, bands: int, partitions: int, links_part: int) -> int:
    """Stage 4 task: the distinct pairs whose member falls in `links_part`, from every band and
    bucket partition. Returns their count."""
    pairs = merge_unique_pairs(load_route(output, band, part, links_part)
                               for band in range(bands) for part in range(partitions))
    save_array(links_uri(output, links_part), pairs)
    return len(pairs)


# ---- stage 5: clusters ----------------------------------------------------------------------
def run_clusters(output: str, shard_count: int, partitions: int, exact: bool, url: bool,
                 near: MinhashConfig | None) -> dict:
    """Stage 5: decide the near removals, write them per shard and the summary for the report."""
    summary: dict = {"exact": None, "url": None, "near": None}
    gone = []   # near clusters are found among the documents the exact and URL steps keep
    for family, on in (("exact", exact), ("url", url)):
        if not on:
            continue
        summaries = []
        for part in range(partitions):
            arrays = _load_npz(removed_uri(output, family, part))
            summaries.append(json.loads(arrays["summary"].tobytes()))
            gone += [arrays["removed"], arrays["earlier"]]
        summary[family] = exact_summary(summaries)
    if near is not None:
        pairs = np.concatenate([load_array(links_uri(output, part)) for part in range(partitions)])
        found = connected_clusters(pairs, without=gone)
        del pairs
        owner = shard_of_keys(found.remove, shard_count)
        for shard in range(shard_count):
            save_array(near_removed_uri(output, shard), found.remove[owner == shard])
        summary["near"] = {
            "config": str(near), "threshold": round(near.threshold, 4),
            "clusters": int(found.sizes.size), "removed": int(found.remove.size),
            "cluster_sizes": size_histogram(found.sizes)}
    storage.write_bytes(clusters_uri(output), json.dumps(summary, indent=1).encode())
    return summary


# ---- the persistent exact-dedup index -------------------------------------------------------
def run_id(output: str, fingerprint: str) -> str:
    """The name a run's digests have in an index: its config and where it wrote."""
    return f"{fingerprint}-{hashlib.sha256(output.encode()).hexdigest()[:8]}"


def index_run_uri(index: str, run: str, *parts: str) -> str:
    return storage.join(index, "runs", run, *parts)


def committed_runs(index: str) -> list[str]:
    """Runs whose digests are whole in the index (the commit marker is written last)."""
    return [run for run in storage.list_dirs(storage.join(index, "runs"))
            if storage.exists(index_run_uri(index, run, "COMMITTED"))]


def earlier_digests(index: str, runs: list[str], family: str, partitions: int,
                    part: int) -> Iterator[np.ndarray]:
    """Each earlier run's sorted digests that fall in partition `part` (under this run's
    partition count, whatever the earlier run used), one run's file at a time."""
    for run in runs:
        for uri in storage.list_files(index_run_uri(index, run, family)):
            digests = load_array(uri)
            yield digests[partition_of(digest_prefix(digests), partitions) == part]


def publish_part(index: str, run: str, output: str, family: str, part: int,
                 shard_count: int) -> None:
    """Add this run's distinct digests of one partition to the index (invisible until commit)."""
    digests = np.unique(np.concatenate([load_array(digest_part_uri(output, family, part, s))
                                        ["digest"] for s in range(shard_count)]))
    save_array(index_run_uri(index, run, family, f"part-{part:05d}.npy"), digests)


def commit_run(index: str, run: str) -> None:
    storage.write_bytes(index_run_uri(index, run, "COMMITTED"), b"")


# ---- stage 6: filters -----------------------------------------------------------------------
def _contains(sorted_keys: np.ndarray, key: int) -> bool:
    at = int(np.searchsorted(sorted_keys, np.uint64(key)))
    return at < sorted_keys.size and int(sorted_keys[at]) == key


@dataclass
class _DigestDuplicate(Filter):
    """Drops the keys stage 2 chose for one digest family, saying which decision it was."""
    duplicate_reason: ClassVar[str]
    earlier_reason: ClassVar[str]
    hashed: ClassVar[str]

    removed: np.ndarray = None   # type: ignore[assignment]  # sorted keys: later copies
    earlier: np.ndarray = None   # type: ignore[assignment]  # sorted keys an earlier run holds

    def params(self) -> dict:
        return {"hash": f"xxh3-128 of {self.hashed}", "keep": "earliest copy"}

    def filter(self, doc: Document) -> FilterResult:
        if _contains(self.removed, doc.key):
            return False, self.duplicate_reason
        if self.earlier is not None and _contains(self.earlier, doc.key):
            return False, self.earlier_reason
        return True


@dataclass
class ExactDuplicate(_DigestDuplicate):
    name: ClassVar[str] = "exact_dedup"
    why: ClassVar[str] = "the same text twice teaches nothing new and skews the mixture"
    duplicate_reason: ClassVar[str] = "exact_duplicate"
    earlier_reason: ClassVar[str] = "seen_in_earlier_run"
    hashed: ClassVar[str] = "the normalised UTF-8 text"


@dataclass
class UrlDuplicate(_DigestDuplicate):
    name: ClassVar[str] = "url_dedup"
    why: ClassVar[str] = "the same page crawled twice (a refetch, a mirror of the URL) counts once"
    duplicate_reason: ClassVar[str] = "url_duplicate"
    earlier_reason: ClassVar[str] = "url_seen_in_earlier_run"
    hashed: ClassVar[str] = "the URL (scheme and host lower case, no fragment, no default port)"


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


# ---- the in-memory reference ----------------------------------------------------------------
def _members(sorted_keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    if sorted_keys.size == 0:
        return np.zeros(values.shape, dtype=bool)
    at = np.searchsorted(sorted_keys, values).clip(max=sorted_keys.size - 1)
    return sorted_keys[at] == values


@dataclass
class Removal:
    exact: np.ndarray      # sorted keys removed as exact copies
    near: np.ndarray       # sorted keys removed as near copies


def removal_in_memory(keys: np.ndarray, digests: np.ndarray | None,
                      bands: np.ndarray | None) -> Removal:
    """Every decision from whole-corpus arrays in one process, with the pure-Python union-find:
    the simple path the partitioned stages must agree with exactly (tests, bench)."""
    exact = exact_duplicates(keys, digests).remove if digests is not None else \
        np.zeros(0, np.uint64)
    near = np.zeros(0, np.uint64)
    if bands is not None and bands.shape[1]:
        pairs = np.concatenate([bucket_pairs(keys, bands[:, b]) for b in range(bands.shape[1])])
        pairs = pairs[~_members(exact, pairs).any(axis=1)]
        near = clusters_from_pairs(pairs).remove
    return Removal(exact, near)
