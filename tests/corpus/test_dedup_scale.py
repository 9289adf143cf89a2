"""Dedup split into hash-range partitions gives exactly the in-memory decisions; URL dedup and
the persistent exact-dedup index across runs.

The partitioned stages (exact per digest range, buckets per band and hash range, links per
partition of members: pairs deduplicated across bands; clusters by sparse connected components
over the distinct pairs) are what bounds each task's
memory (bench/dedup_scale.py measures it at 20M documents). Here they must remove the very same
keys as the simple whole-corpus path (`dedup.removal_in_memory`: one sort, pure-Python union-find)
on synthetic signatures with planted exact and near clusters that cross shards, for several
partition counts.
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
from crucible.trainer.corpus.clusters import (clusters_from_pairs, connected_clusters,
                                              merge_unique_pairs)
from tests.corpus import synthetic

DOCS, SHARDS = 30_000, 4


def dedup_job(output: Path | str, shards: int, **dedup_config) -> pipeline.Job:
    config = corpus_config.from_dict({"output": str(output), "steps": [],
                                      "sources": [{"name": "s",
                                                   "paths": [storage.join(str(output), "none")]}],
                                      "dedup": dedup_config})
    return pipeline.Job(config, shards)


def partitioned_removal(output: Path | str, partitions: int) -> dedup.Removal:
    """Stage 1's files from the synthetic corpus, then the exact, buckets, links and clusters
    stages task by task, as any runner would run them."""
    job = dedup_job(output, SHARDS, partitions=partitions)
    for shard in range(SHARDS):
        dedup.write_signatures(job.output, shard, synthetic.shard_signatures(shard, SHARDS, DOCS),
                               job.partitions, job.families)
    for stage in job.stages():
        if stage.name in ("exact", "buckets", "links", "clusters"):
            for task in range(stage.tasks):
                stage.body(job, task)
    exact = [dedup.exact_removal_of_shard(job.output, "exact", partitions, s, SHARDS)[0]
             for s in range(SHARDS)]
    near = [dedup.load_array(dedup.near_removed_uri(job.output, s)) for s in range(SHARDS)]
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
    """On S3 a links task reads its rows of each pair file with a ranged GET: a range off by a
    byte would misread every pair after it."""
    found = partitioned_removal(f"s3://{s3_storage.bucket}/dedup-stages/{secrets.token_hex(4)}", 3)
    assert np.array_equal(found.exact, in_memory.exact)
    assert np.array_equal(found.near, in_memory.near)


def test_each_links_task_holds_the_distinct_pairs_of_its_members(tmp_path):
    """A pair goes to the links task of its member, once however many bands found it, and the
    links tasks together hold every distinct pair of every band."""
    partitions = 3
    partitioned_removal(tmp_path, partitions)
    job = dedup_job(tmp_path, SHARDS, partitions=partitions)
    bands = job.config.dedup.near.bands
    every_pair = np.concatenate([dedup.load_array(dedup.pairs_uri(job.output, band, part))
                                 for band in range(bands) for part in range(partitions)])
    assert len(every_pair) > len(np.unique(every_pair, axis=0))   # bands found some pairs twice
    links = []
    for part in range(partitions):
        pairs = dedup.load_array(dedup.links_uri(job.output, part))
        assert (dedup.partition_of_keys(pairs[:, 0], partitions) == part).all()
        assert len(pairs) == len(np.unique(pairs, axis=0))
        links.append(pairs)
    assert np.array_equal(np.unique(np.concatenate(links), axis=0), np.unique(every_pair, axis=0))
    sizes = [len(pairs) for pairs in links]
    assert min(sizes) > 0.8 * max(sizes)       # the hash spreads members evenly


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


def test_connected_components_agree_with_union_find_on_random_graphs():
    rng = np.random.default_rng(3)
    for _ in range(20):
        nodes = np.unique(rng.integers(1, 10**12, size=60, dtype=np.uint64))
        pairs = rng.choice(nodes, size=(int(rng.integers(1, 80)), 2))
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        expected, found = clusters_from_pairs(pairs), connected_clusters(pairs)
        assert np.array_equal(found.remove, expected.remove)
        assert sorted(found.sizes.tolist()) == sorted(expected.sizes.tolist())
    chain = np.array([[30, 20], [20, 10], [40, 50]], dtype=np.uint64)
    result = connected_clusters(chain)
    assert result.remove.tolist() == [20, 30, 50] and sorted(result.sizes.tolist()) == [2, 3]


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
