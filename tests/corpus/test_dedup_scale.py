"""Dedup split into hash-range partitions gives exactly the in-memory decisions; URL dedup and
the persistent exact-dedup index across runs.

The partitioned stages (exact per digest range, buckets per band and hash range, links per
partition of pair heads: pairs deduplicated across bands; components by large-star/small-star
steps, each task holding the edges of its partition's keys; clusters per partition) are what
bounds each task's memory (bench/dedup_scale.py measures it at 20M documents). Here they must
remove the very same keys as the simple whole-corpus path (`dedup.removal_in_memory`: one sort,
pure-Python union-find) on synthetic signatures with planted exact and near clusters that cross
shards, for several partition counts.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import numpy as np
import pytest

from crucible.api.spec import ConfigError
from crucible.trainer import storage
from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus import dedup, pipeline
from crucible.trainer.corpus.clusters import (both_directions, clusters_from_pairs, large_star,
                                              merge_unique_pairs, small_star, star_clusters)
from tests.corpus import synthetic

DOCS, SHARDS = 30_000, 4


def dedup_job(output: Path | str, shards: int, **dedup_config) -> pipeline.Job:
    config = corpus_config.from_dict({"output": str(output), "steps": [],
                                      "sources": [{"name": "s",
                                                   "paths": [storage.join(str(output), "none")]}],
                                      "dedup": dedup_config})
    return pipeline.Job(config, shards)


DEDUP_STAGES = ("exact", "buckets", "links", "components", "clusters")


def partitioned_removal(output: Path | str, partitions: int) -> dedup.Removal:
    """Stage 1's files from the synthetic corpus, then the exact, buckets, links, components
    (step by step) and clusters stages task by task, as any runner would run them."""
    job = dedup_job(output, SHARDS, partitions=partitions)
    for shard in range(SHARDS):
        dedup.write_signatures(job.output, shard, synthetic.shard_signatures(shard, SHARDS, DOCS),
                               job.partitions, job.families)
    for stage in job.run_order():
        if stage.kind in DEDUP_STAGES:
            for task in reversed(range(stage.tasks)):   # no task may rely on an earlier one
                stage.body(job, task)
    dedup.write_summary(job.output, partitions, job.families, job.config.dedup.near)
    exact = [dedup.exact_removal_of_shard(job.output, "exact", partitions, s)[0]
             for s in range(SHARDS)]
    near = [dedup.near_removal_of_shard(job.output, partitions, s) for s in range(SHARDS)]
    for shard, keys in enumerate(exact + near):     # each filter task reads only its own keys
        assert (dedup.shard_of_keys(keys, SHARDS) == shard % SHARDS).all()
    return dedup.Removal(np.sort(np.concatenate(exact)), np.sort(np.concatenate(near)))


@pytest.fixture(scope="module")
def in_memory() -> dedup.Removal:
    corpus = synthetic.whole_corpus(SHARDS, DOCS)
    return dedup.removal_in_memory(corpus["keys"], corpus["digests"], corpus["bands"])


@pytest.mark.parametrize("partitions", [1, 3, 8])
def test_partitioned_stages_remove_exactly_what_the_in_memory_path_removes(
        in_memory, partitions, tmp_path):
    # The planted shares: ~5% exact copies, ~10% near copies (some land in other clusters).
    assert 0.03 * DOCS < in_memory.exact.size < 0.06 * DOCS
    assert 0.05 * DOCS < in_memory.near.size < 0.11 * DOCS
    found = partitioned_removal(tmp_path, partitions)
    assert np.array_equal(found.exact, in_memory.exact)
    assert np.array_equal(found.near, in_memory.near)
    shards_hit = set(dedup.shard_of_keys(found.near, SHARDS).tolist())
    assert shards_hit == set(range(SHARDS))
    summary = json.loads((tmp_path / "dedup" / "clusters.json").read_text())
    assert summary["exact"]["removed"] == in_memory.exact.size
    assert summary["exact"]["documents"] == DOCS
    assert summary["near"]["removed"] == in_memory.near.size


@pytest.mark.stack
def test_partitioned_stages_on_s3_read_byte_ranges_of_the_pair_files(in_memory, s3_storage):
    """On S3 a task reads its rows of each routed file (pairs, links, steps, exact removals) with a
    ranged GET: a range off by a byte would misread every row after it."""
    found = partitioned_removal(f"s3://{s3_storage.bucket}/dedup-stages/{secrets.token_hex(4)}", 3)
    assert np.array_equal(found.exact, in_memory.exact)
    assert np.array_equal(found.near, in_memory.near)


def test_each_links_task_holds_the_distinct_pairs_of_its_heads(tmp_path):
    """A pair goes to the links task of its head, once however many bands found it, and the
    links tasks together hold every distinct pair of every band but those headed by a document
    removed as an exact copy."""
    partitions = 3
    partitioned_removal(tmp_path, partitions)
    job = dedup_job(tmp_path, SHARDS, partitions=partitions)
    bands = job.config.dedup.near.bands
    every_pair = np.concatenate([dedup.load_array(dedup.pairs_uri(job.output, band, part))
                                 for band in range(bands) for part in range(partitions)])
    assert len(every_pair) > len(np.unique(every_pair, axis=0))   # bands found some pairs twice
    removed = [dedup.removed_in_partition(job.output, ["exact"], partitions, p)
               for p in range(partitions)]
    for part, keys in enumerate(removed):          # each task reads only its own partition's
        assert (dedup.partition_of_keys(keys, partitions) == part).all()
    removed = np.concatenate(removed)
    headed_by_removed = np.isin(every_pair[:, 1], removed)
    assert headed_by_removed.any()
    every_pair = every_pair[~headed_by_removed]
    links = []
    for part in range(partitions):
        pairs = dedup.load_array(dedup.links_uri(job.output, part))
        assert (dedup.partition_of_keys(pairs[:, 1], partitions) == part).all()
        assert len(pairs) == len(np.unique(pairs, axis=0))
        for member_part in range(partitions):      # routed to the components task of the member
            routed = dedup.load_routed(dedup.links_uri(job.output, part), member_part)
            assert (dedup.partition_of_keys(routed[:, 0], partitions) == member_part).all()
        links.append(pairs)
    assert np.array_equal(np.unique(np.concatenate(links), axis=0), np.unique(every_pair, axis=0))
    sizes = [len(pairs) for pairs in links]
    assert min(sizes) > 0.8 * max(sizes)       # the hash spreads heads evenly


def test_a_range_of_a_file_is_read_whole_and_nothing_else(tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(256)))
    assert storage.read_range(str(path), 10, 14) == bytes([10, 11, 12, 13])
    assert storage.read_range(str(path), 250, 256) == bytes(range(250, 256))
    assert storage.read_range(str(path), 7, 7) == b""


def test_a_task_reads_only_its_partition(tmp_path):
    """Each partition file holds only hashes of its range, and together they hold every row."""
    job = dedup_job(tmp_path, 1, partitions=4)
    arrays = synthetic.shard_signatures(0, 1, 2_000)
    dedup.write_signatures(job.output, 0, arrays, 4, ["exact"])
    rows = 0
    for part in range(4):
        band = dedup.load_array(dedup.band_part_uri(job.output, 5, part, 0))
        assert (dedup.partition_of(band[:, 1], 4) == part).all()
        digests = dedup.load_array(dedup.digest_part_uri(job.output, "exact", part, 0))
        assert (dedup.partition_of(dedup.digest_prefix(digests["digest"]), 4) == part).all()
        rows += len(band)
    assert rows == 2_000


def random_pairs(rng: np.random.Generator, nodes: int, edges: int) -> np.ndarray:
    """(member, head) pairs, member > head, among `nodes` random keys."""
    keys = np.unique(rng.integers(1, 10**12, size=nodes, dtype=np.uint64))
    pairs = rng.choice(keys, size=(edges, 2))
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    return np.stack([pairs.max(axis=1), pairs.min(axis=1)], axis=1)


def test_star_steps_agree_with_union_find_on_random_graphs():
    rng = np.random.default_rng(3)
    for _ in range(200):
        pairs = random_pairs(rng, int(rng.integers(2, 60)), int(rng.integers(1, 90)))
        expected, found = clusters_from_pairs(pairs), star_clusters(pairs)
        assert np.array_equal(found.remove, expected.remove)
        assert sorted(found.sizes.tolist()) == sorted(expected.sizes.tolist())
    chain = np.array([[30, 20], [20, 10], [50, 40]], dtype=np.uint64)
    result = star_clusters(chain)
    assert result.remove.tolist() == [20, 30, 50] and sorted(result.sizes.tolist()) == [2, 3]
    # A long path in shuffled key order: the worst shape for passing labels along edges.
    order = rng.permutation(5_000).astype(np.uint64) + np.uint64(1)
    path = np.stack([order[1:], order[:-1]], axis=1)
    path = np.stack([path.max(axis=1), path.min(axis=1)], axis=1)
    result = star_clusters(path)
    assert result.sizes.tolist() == [5_000] and result.remove.size == 4_999
    assert 1 not in result.remove.tolist()


def test_star_steps_change_nothing_only_on_stars_centred_on_the_smallest_key():
    star = np.array([[5, 1], [9, 1], [7, 1]], dtype=np.uint64)
    assert small_star(star).changes == 0
    done = large_star(both_directions(small_star(star).edges))
    assert done.changes == 0 and done.centre_sizes.tolist() == [4]
    assert sorted(done.edges[:, 0].tolist()) == [5, 7, 9]
    # A node with two smaller neighbours is not a leaf yet; nor is a centre with a smaller one.
    assert small_star(np.array([[9, 1], [9, 5]], dtype=np.uint64)).changes == 1
    assert large_star(both_directions(np.array([[5, 1], [9, 5]], dtype=np.uint64))).changes == 1


def test_a_bucket_pairs_each_member_with_its_smallest_key_whatever_the_row_order():
    """Brute force on random buckets: every member of a shared band key, and no other row, is
    paired once with the smallest key of its bucket; rows arrive as sorted runs (shards) or
    shuffled."""
    rng = np.random.default_rng(7)
    keys = rng.choice(10**9, size=3_000, replace=False).astype(np.uint64)
    band_keys = rng.integers(0, 400, size=keys.size).astype(np.uint64)   # buckets of ~7
    band_keys[:50] = np.arange(10**6, 10**6 + 50, dtype=np.uint64)       # 50 alone: no pair
    expected = set()
    for band in np.unique(band_keys):
        members = keys[band_keys == band]
        expected |= {(int(k), int(members.min())) for k in members if k != members.min()}
    for order in (np.argsort(keys), rng.permutation(keys.size)):
        pairs = dedup.bucket_pairs(keys[order], band_keys[order])
        assert len(pairs) == len(expected)
        assert {(int(a), int(b)) for a, b in pairs} == expected


def test_pairs_from_every_band_are_merged_once():
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 40, size=(int(rng.integers(0, 50)), 2)).astype(np.uint64)
               for _ in range(30)]
    merged = merge_unique_pairs(batches, min_batch_rows=16)   # forces many intermediate merges
    expected = np.unique(np.concatenate(batches), axis=0)
    assert np.array_equal(merged, expected)


# ---- URL dedup and the index, through the whole pipeline -------------------------------------
def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def pipeline_config(raw: Path, output: str | Path, **dedup_config) -> corpus_config.CorpusConfig:
    return corpus_config.from_dict({"output": str(output), "steps": ["normalise"],
                                    "sources": [{"name": "web", "paths": [str(raw)]}],
                                    "dedup": {"near": False, **dedup_config}})


def kept_ids(output: str) -> list[str]:
    return sorted(doc.id for uri in storage.list_files(storage.join(output, "deduped"))
                  for doc in pipeline.read_docs(uri))


def reasons(output: str, step: str) -> dict:
    report = json.loads(storage.read_bytes(storage.join(output, "report.json")))
    entry = next(s for s in report["steps"] if s["step"] == step)
    return {r["reason"]: r["docs"] for r in entry["reasons"] + entry["other_reasons"]}


def test_url_dedup_keeps_the_earliest_page_of_a_url(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_jsonl(raw / "a.jsonl", [
        {"id": "a1", "text": "first fetch of the page", "url": "HTTPS://Example.org:443/x#top"},
        {"id": "a2", "text": "another page", "url": "https://example.org/y"}])
    write_jsonl(raw / "b.jsonl", [
        {"id": "b1", "text": "a later fetch of the page", "url": "https://example.org/x"},
        {"id": "b2", "text": "the y page with a query", "url": "https://example.org/y?q=1"},
        {"id": "b3", "text": "a page without a url"}])
    output = str(tmp_path / "out")
    pipeline.run_local(pipeline_config(raw, output, url=True, exact=False), 2)
    assert kept_ids(output) == ["a1", "a2", "b2", "b3"]
    assert reasons(output, "url_dedup") == {"url_duplicate": 1}


def test_normalised_urls():
    assert dedup.normalise_url("HTTP://Example.COM:80/a/B?x=1#f") == "http://example.com/a/B?x=1"
    assert dedup.normalise_url("https://example.com:8443") == "https://example.com:8443/"
    assert dedup.normalise_url("http://[::1:bad") == "http://[::1:bad"     # kept, not raised


def later_run_drops_what_an_earlier_committed_run_kept(raw: Path, runs: str) -> None:
    """Two dumps through two runs sharing the index `runs`/index, outputs under `runs`."""
    index = storage.join(runs, "index")
    dump1, dump2 = raw / "dump1", raw / "dump2"
    dump1.mkdir(), dump2.mkdir()
    write_jsonl(dump1 / "a.jsonl", [{"id": f"old{i}", "text": f"text number {i}"}
                                    for i in range(6)])
    write_jsonl(dump2 / "a.jsonl", [{"id": f"new{i}", "text": f"text number {i}"}
                                    for i in range(3, 9)] + [{"id": "dup", "text": "text number 8"}])
    first = storage.join(runs, "out1")
    pipeline.run_local(pipeline_config(dump1, first, index=index), 2)
    assert len(kept_ids(first)) == 6
    assert len(dedup.committed_runs(index)) == 1

    second = storage.join(runs, "out2")
    pipeline.run_local(pipeline_config(dump2, second, index=index), 3)
    assert kept_ids(second) == ["new6", "new7", "new8"]
    assert reasons(second, "exact_dedup") == {"seen_in_earlier_run": 3, "exact_duplicate": 1}
    assert len(dedup.committed_runs(index)) == 2

    # A run that has started but not finished is not committed: nobody dedups against it.
    started = pipeline.Job(pipeline_config(dump2, storage.join(runs, "out3"), index=index), 1)
    started.check_run_file()
    assert started.index_runs() == dedup.committed_runs(index)
    for stage in started.stages()[:3]:            # filter, signatures, exact: digests published
        assert stage.name in ("filter", "signatures", "exact")
        stage.body(started, 0)
    assert storage.list_files(storage.join(index, "runs")) != []
    assert len(dedup.committed_runs(index)) == 2
    # Re-running the first dump's run does not drop its own documents as "seen before".
    pipeline.run_local(pipeline_config(dump1, first, index=index), 2)
    assert len(kept_ids(first)) == 6


def test_a_later_run_drops_what_an_earlier_committed_run_kept(tmp_path):
    later_run_drops_what_an_earlier_committed_run_kept(tmp_path, str(tmp_path / "runs"))


@pytest.mark.stack
def test_the_index_and_outputs_on_s3(tmp_path, s3_storage):
    later_run_drops_what_an_earlier_committed_run_kept(
        tmp_path, f"s3://{s3_storage.bucket}/corpus-index-test/{secrets.token_hex(4)}")


@pytest.mark.parametrize("dedup_config, message", [
    ({"partitions": 0}, "partitions"),
    ({"partitions": True}, "partitions"),
    ({"partitions": "8"}, "partitions"),
    ({"index": "s3://b/i", "exact": False}, "index needs dedup.exact"),
    ({"urls": True}, "unknown keys urls"),
    ("yes", "dedup: a mapping"),
])
def test_bad_dedup_config_says_what_is_wrong(dedup_config, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        corpus_config.from_dict({"output": str(tmp_path), "sources": [{"name": "s", "paths": ["x"]}],
                                 "dedup": dedup_config})
