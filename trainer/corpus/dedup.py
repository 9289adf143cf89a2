"""Exact, URL and MinHash-LSH near dedup as stages that pass files, each task holding only its
slice of the corpus, so a Common Crawl dump (10^8 documents) fits tasks of a few GB.

Owns the stage bodies and their file formats (P = `DedupConfig.partitions`, N = shards):
  1. signatures (per shard): each document's key, its 128-bit content digest (and URL digest),
     and one LSH key per band, written split by hash range into P partitions:
       dedup/digests/<family>/part-PPPPP/shard-NNNNN.npy   (key, digest) records
       dedup/bands/band-BB/part-PPPPP/shard-NNNNN.npy      (m, 2) uint64: key, band key
  2. exact (per family and partition): the partition's digests of every shard, sorted; all but the
     smallest key of each digest group is removed, and so is every document whose digest an
     earlier run in the persistent index holds -> dedup/<family>/by-partition/part-PPPPP.npy
     (routed to the links and components tasks by key) and by-shard/part-PPPPP.npy ((key, flag)
     rows, routed to the filter tasks by shard), then the summary part-PPPPP.json
  3. buckets (per band and partition): documents sharing a band key are candidate pairs (each
     paired with the bucket's smallest key, its head), written routed to the links task of each
     pair's head -> dedup/pairs/band-BB-part-PPPPP.npy (m, 2) uint64 and, beside it,
     band-BB-part-PPPPP.routes.npy: the byte range of each reader's rows (`save_routed`)
  4. links (per partition of heads): one byte range of every pair file, deduplicated across bands
     (clusters.merge_unique_pairs), less the pairs whose head the exact or URL step removes ->
     dedup/links/part-PPPPP.npy, routed to each pair's member. The same pair found in 14 bands
     meets its copies in one task, and no task sorts every pair.
  5. components (per partition of keys, in steps): small-star and large-star steps in turn
     (clusters.py), each task taking its keys' edges from every task of the step before and
     routing its edges to the next step's; step 0 reads the links files and leaves out the pairs
     whose member the exact or URL step removes -> dedup/components/step-SSS/part-PPPPP.npy, and
     a .json beside each with what the step changed. A large-star step that, with the small-star
     step before it, changed nothing leaves each cluster as a star around its smallest key.
  6. clusters (per partition): the converged stars' leaves (every member but the smallest key)
     -> dedup/near/part-PPPPP.npy, routed to each document's shard
  7. filter (per shard): the `ExactDuplicate`, `UrlDuplicate` and `NearDuplicate` filters drop what
     stages 2 and 6 chose, each shard reading only its own keys. The report task writes
     dedup/clusters.json (counts and size histograms) from the stages' summaries.
Must not: decide which pipeline stage runs when (pipeline.py).

Memory per task: a signatures task holds its shard's signatures (~140 bytes per document); an
exact or buckets task one partition of one family or band (24 or 16 bytes per document of the
slice, about 3x that while sorting); a links task its partition's pairs from every band (16 bytes
each, up to 14 per near copy); a components or clusters task the edges of its partition's keys
(16 bytes each, twice while sorting). Nothing scales with the whole corpus, except that a cluster's
star ends up in the task of its smallest key (a 10M-copy template would be 10M edges there).
bench/dedup_scale.py measures it.

Follows datatrove's MinhashDedupSignature / Buckets / Cluster / Filter (src/datatrove/pipeline/
dedup/minhash.py: its buckets stage also splits each band's hash range across workers), ExactDedup
(dedup/exact_dedup.py) and UrlDedup (dedup/url_dedup.py). Differences: stage 3 writes pairs to
the bucket's smallest key (a star), which is all connected components need, instead of chains;
components run in partitioned steps rather than in one task; the survivor of a cluster is the
smallest global key (earliest input) so results do not depend on sharding or partitioning.
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
from crucible.trainer.corpus.clusters import (both_directions, clusters_from_pairs,
                                              exact_duplicates, large_star, merge_unique_pairs,
                                              size_histogram, small_star)
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


def exact_summary_uri(output: str, family: str, part: int) -> str:
    return storage.join(output, "dedup", family, f"part-{part:05d}.json")


def exact_keys_uri(output: str, family: str, part: int) -> str:
    """One exact task's removals, routed to the links and components tasks by key partition."""
    return storage.join(output, "dedup", family, "by-partition", f"part-{part:05d}.npy")


def exact_shards_uri(output: str, family: str, part: int) -> str:
    """One exact task's (key, earlier-run flag) rows, routed to the filter tasks by shard."""
    return storage.join(output, "dedup", family, "by-shard", f"part-{part:05d}.npy")


def pairs_uri(output: str, band: int, part: int) -> str:
    return storage.join(output, "dedup", "pairs", f"band-{band:02d}-part-{part:05d}.npy")


def links_uri(output: str, part: int) -> str:
    return storage.join(output, "dedup", "links", f"part-{part:05d}.npy")


def star_step_uri(output: str, step: int, part: int) -> str:
    return storage.join(output, "dedup", "components", f"step-{step:03d}", f"part-{part:05d}.npy")


def star_summary_uri(output: str, step: int, part: int) -> str:
    return storage.join(output, "dedup", "components", f"step-{step:03d}",
                        f"part-{part:05d}.json")


def near_removed_uri(output: str, part: int) -> str:
    return storage.join(output, "dedup", "near", f"part-{part:05d}.npy")


def clusters_uri(output: str) -> str:
    return storage.join(output, "dedup", "clusters.json")


def save_array(uri: str, array: np.ndarray) -> None:
    with storage.open_write(uri) as out:
        np.save(out, array, allow_pickle=False)


def load_array(uri: str) -> np.ndarray:
    if storage.is_s3(uri):
        return np.load(io.BytesIO(storage.read_bytes(uri)), allow_pickle=False)
    return np.load(uri, allow_pickle=False)


def _routes_uri(uri: str) -> str:
    return uri.removesuffix(".npy") + ".routes.npy"


def save_routed(uri: str, rows: np.ndarray, owner: np.ndarray, owners: int) -> None:
    """uint64 `rows` ((m,) or (m, k)) ordered by `owner` (0..owners-1), and beside them the byte
    range of each owner's rows, so that each reader fetches only its own (`load_routed`)."""
    # A stable sort of 16-bit owners is a radix sort: 6x faster than of int64 on 130k rows.
    narrow = owner.astype(np.uint16) if owners <= 1 << 16 else owner
    rows = np.ascontiguousarray(rows[np.argsort(narrow, kind="stable")], dtype=np.uint64)
    encoded = io.BytesIO()
    np.save(encoded, rows, allow_pickle=False)
    data_start = encoded.tell() - rows.nbytes         # the .npy header's length
    rows_before = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=owners))])
    row_bytes = rows.itemsize * (rows.shape[1] if rows.ndim == 2 else 1)
    storage.write_bytes(uri, encoded.getvalue())
    save_array(_routes_uri(uri), data_start + rows_before * row_bytes)


def load_routed(uri: str, owner: int, columns: int = 2) -> np.ndarray:
    """The rows of a `save_routed` file that belong to `owner`: one ranged read."""
    ranges = load_array(_routes_uri(uri))
    raw = storage.read_range(uri, int(ranges[owner]), int(ranges[owner + 1]))
    rows = np.frombuffer(raw, dtype="<u8")
    return rows.reshape(-1, columns) if columns > 1 else rows


def load_routes(uris: Iterable[str], owner: int, columns: int = 2) -> np.ndarray:
    """`owner`'s rows of every `save_routed` file in `uris`, one after another."""
    empty = np.zeros((0, columns) if columns > 1 else 0, np.uint64)
    return np.concatenate([empty] + [load_routed(uri, owner, columns) for uri in uris])


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


def run_exact(output: str, family: str, part: int, shard_count: int, partitions: int,
              earlier: Iterable[np.ndarray] = ()) -> dict:
    """Stage 2 task: read partition `part` of `family` from every shard, write its decision
    twice, routed by key partition (links, components) and by shard (filters), so each reader
    fetches one byte range of it rather than the whole file. Returns the partition's summary
    (added up by `write_summary` for the report), written last."""
    records = np.concatenate([load_array(digest_part_uri(output, family, part, s))
                              for s in range(shard_count)]) if shard_count else \
        np.zeros(0, DIGEST_RECORD)
    decision = decide_exact(records, earlier)
    gone = np.union1d(decision.removed, decision.earlier)
    save_routed(exact_keys_uri(output, family, part), gone, partition_of_keys(gone, partitions),
                partitions)
    flagged = np.concatenate([np.stack([keys, np.full(keys.size, flag, np.uint64)], axis=1)
                              for flag, keys in enumerate((decision.removed, decision.earlier))])
    save_routed(exact_shards_uri(output, family, part), flagged,
                shard_of_keys(flagged[:, 0], shard_count), shard_count)
    summary = {"documents": int(records.size), "groups": int(decision.sizes.size),
               "removed": int(decision.removed.size), "earlier_run": int(decision.earlier.size),
               "group_sizes": size_histogram(decision.sizes)}
    storage.write_bytes(exact_summary_uri(output, family, part), json.dumps(summary).encode())
    return summary


def add_histograms(histograms: Iterable[dict[str, int]]) -> dict[str, int]:
    """Size histograms added bin by bin (`size_histogram`'s bins are fixed, so labels match)."""
    total: dict[str, int] = {}
    for histogram in histograms:
        for label, count in histogram.items():
            total[label] = total.get(label, 0) + count
    return dict(sorted(total.items(), key=lambda item: int(item[0].split("-")[0])))


def exact_summary(summaries: Iterable[dict]) -> dict:
    """The partitions' summaries added up."""
    summaries = list(summaries)
    total = {name: sum(s[name] for s in summaries)
             for name in ("documents", "groups", "removed", "earlier_run")}
    total["group_sizes"] = add_histograms(s["group_sizes"] for s in summaries)
    return total


def exact_removal_of_shard(output: str, family: str, partitions: int,
                           shard: int) -> tuple[np.ndarray, np.ndarray]:
    """(removed, earlier) keys of one shard, each sorted: one range of each exact task's file."""
    rows = load_routes((exact_shards_uri(output, family, p) for p in range(partitions)), shard)
    return np.sort(rows[rows[:, 1] == 0, 0]), np.sort(rows[rows[:, 1] == 1, 0])


# ---- stage 3: buckets -----------------------------------------------------------------------
def bucket_pairs(keys: np.ndarray, band_keys: np.ndarray) -> np.ndarray:
    """Stage 3 for one band (or a hash range of it): (m, 2) pairs (member, smallest member) of
    every shared band key. Keys are distinct (a document has one key per band)."""
    if keys.size == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    # One unstable sort by band key, then each bucket's smallest key by a reduction: a lexsort
    # by (band key, key) costs two stable sorts, 2.3x the time, and more when the keys arrive
    # as one sorted run per shard (measured on 1M rows: 168-211 ms against 73-94 ms).
    order = np.argsort(band_keys)
    sorted_bands, sorted_keys = band_keys[order], keys[order]
    del order
    starts = np.ones(len(sorted_keys), dtype=bool)
    starts[1:] = sorted_bands[1:] != sorted_bands[:-1]
    heads = np.minimum.reduceat(sorted_keys, np.flatnonzero(starts))[np.cumsum(starts) - 1]
    members = sorted_keys != heads
    return np.stack([sorted_keys[members], heads[members]], axis=1)


def run_buckets(output: str, band: int, part: int, shard_count: int, partitions: int) -> int:
    """Stage 3 task: read partition `part` of `band` from every shard, write its pairs routed to
    the links task of each pair's head. Returns the pair count."""
    slices = [load_array(band_part_uri(output, band, part, s)) for s in range(shard_count)]
    rows = np.concatenate(slices) if slices else np.zeros((0, 2), np.uint64)
    del slices
    pairs = bucket_pairs(rows[:, 0].copy(), rows[:, 1].copy())
    del rows
    save_routed(pairs_uri(output, band, part), pairs,
                partition_of_keys(pairs[:, 1], partitions), partitions)
    return len(pairs)


def removed_in_partition(output: str, families: Iterable[str], partitions: int,
                         part: int) -> np.ndarray:
    """The sorted keys of partition `part` that the exact and URL steps remove (later copies, and
    documents an earlier run holds): one range of each exact task's file."""
    return np.unique(load_routes((exact_keys_uri(output, family, p) for family in families
                                  for p in range(partitions)), part, columns=1))


def _members(sorted_keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    if sorted_keys.size == 0:
        return np.zeros(values.shape, dtype=bool)
    at = np.searchsorted(sorted_keys, values).clip(max=sorted_keys.size - 1)
    return sorted_keys[at] == values


def _without(rows: np.ndarray, column: int, removed: np.ndarray) -> np.ndarray:
    return rows[~_members(removed, rows[:, column])] if removed.size else rows


# ---- stage 4: links -------------------------------------------------------------------------
def run_links(output: str, bands: int, partitions: int, links_part: int,
              removed: np.ndarray) -> int:
    """Stage 4 task: the distinct pairs whose head falls in `links_part`, from every band and
    bucket partition, less those whose head is in `removed` (this partition's exact and URL
    removals), routed to the first components task of each pair's member. Returns their count."""
    pairs = merge_unique_pairs(load_routed(pairs_uri(output, band, part), links_part)
                               for band in range(bands) for part in range(partitions))
    pairs = _without(pairs, 1, removed)
    save_routed(links_uri(output, links_part), pairs, partition_of_keys(pairs[:, 0], partitions),
                partitions)
    return len(pairs)


# ---- stage 5: components, in steps ----------------------------------------------------------
# A guard against a bug looping forever, far above what near-copy graphs take (6-8 steps measured
# on synthetic corpora up to 20M documents; the paper's bound is O(log^2 n), ~800 at 3x10^8).
MAX_STAR_STEPS = 2048


def star_step_kind(step: int) -> str:
    """Steps alternate, from a small-star: the links files hold each pair at its larger key."""
    return "small" if step % 2 == 0 else "large"


def run_star_step(output: str, step: int, partitions: int, part: int,
                  removed: np.ndarray | None) -> int:
    """One components task: this partition's edges from every task of the step before (or from
    the links stage), one star step over them, its edges routed to the next step's tasks and a
    summary of what changed. Step 0 first leaves out the edges of keys in `removed` (this
    partition's exact and URL removals; the links stage left out the heads'). Returns the
    changes."""
    rows = load_routes((links_uri(output, p) if step == 0 else star_step_uri(output, step - 1, p)
                        for p in range(partitions)), part)
    if removed is not None:
        rows = _without(rows, 0, removed)
    if star_step_kind(step) == "small":
        done = small_star(rows)
        del rows
        edges = both_directions(done.edges)    # a large-star step needs each edge at both keys
    else:
        done = large_star(rows)
        del rows
        edges = done.edges                      # a small-star step needs each at its larger key
    save_routed(star_step_uri(output, step, part), edges,
                partition_of_keys(edges[:, 0], partitions), partitions)
    summary = {"step": step, "kind": star_step_kind(step), "edges_out": len(edges),
               "changes": done.changes, "centres": int(done.centre_sizes.size),
               "leaves": int(done.centre_sizes.sum() - done.centre_sizes.size),
               "cluster_sizes": size_histogram(done.centre_sizes)}
    storage.write_bytes(star_summary_uri(output, step, part), json.dumps(summary).encode())
    return done.changes


def star_summaries(output: str, step: int, partitions: int) -> list[dict]:
    return [json.loads(storage.read_bytes(star_summary_uri(output, step, p)))
            for p in range(partitions)]


def star_converged(output: str, step: int, partitions: int) -> bool:
    """After every task of `step`: a large-star step that, with the small-star before it, changed
    nothing has left stars centred on each cluster's smallest key (its survivor)."""
    if star_step_kind(step) != "large":
        return False
    changes = sum(s["changes"] for k in (step - 1, step) for s in star_summaries(output, k,
                                                                                partitions))
    if changes and step + 1 >= MAX_STAR_STEPS:
        raise RuntimeError(f"near-dedup components did not converge in {MAX_STAR_STEPS} steps: "
                           "please report it with the step summaries under "
                           f"{storage.join(output, 'dedup', 'components')}")
    return changes == 0


def last_star_step(output: str, partitions: int) -> int:
    """The converged step of a finished components stage."""
    step = 1
    while not star_converged(output, step, partitions):
        step += 2
    return step


# ---- stage 6: clusters ----------------------------------------------------------------------
def run_near_removal(output: str, partitions: int, part: int, shard_count: int) -> int:
    """Stage 6 task: the leaves of the converged stars whose key falls in `part` (every cluster
    member but its smallest key), routed to each document's shard. Returns their count."""
    step = last_star_step(output, partitions)
    edges = load_routes((star_step_uri(output, step, p) for p in range(partitions)), part)
    leaves = np.unique(edges[:, 0])
    save_routed(near_removed_uri(output, part), leaves, shard_of_keys(leaves, shard_count),
                shard_count)
    return len(leaves)


def near_removal_of_shard(output: str, partitions: int, shard: int) -> np.ndarray:
    """The sorted keys of one shard that near dedup removes: one range of each clusters file."""
    return np.sort(load_routes((near_removed_uri(output, p) for p in range(partitions)), shard,
                               columns=1))


def write_summary(output: str, partitions: int, families: Iterable[str],
                  near: MinhashConfig | None) -> dict:
    """dedup/clusters.json for the report: each rule's groups, removals and size histograms."""
    summary: dict = {"exact": None, "url": None, "near": None}
    for family in families:
        summary[family] = exact_summary(
            json.loads(storage.read_bytes(exact_summary_uri(output, family, part)))
            for part in range(partitions))
    if near is not None:
        stars = star_summaries(output, last_star_step(output, partitions), partitions)
        summary["near"] = {
            "config": str(near), "threshold": round(near.threshold, 4),
            "clusters": sum(s["centres"] for s in stars),
            "removed": sum(s["leaves"] for s in stars),
            "cluster_sizes": add_histograms(s["cluster_sizes"] for s in stars)}
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


# ---- stage 7: filters -----------------------------------------------------------------------
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
