"""Corpus pipeline: raw sources -> extracted, filtered, deduplicated, mixed text, with a report of
what every step removed and why.

Modelled on datatrove (huggingface/datatrove) and the FineWeb recipe (Penedo et al. 2024, arXiv
2406.17557): the same step order, the same thresholds by default, the same split between a filter's
pure `filter(doc)` and the base class that counts drops by reason. It runs offline: no step
downloads a model or a word list at run time.

Layout, one concept per module:
    document, words          the record that flows through steps; the one word splitter
    storage, readers         local and s3:// files; JSONL/Parquet/text/HTML/WARC records
    charset                  which charset a web page is in (label, <meta>, detection)
    step, stats              the Step/Filter/Formatter split; mergeable per-step counters
    extract, normalise, language, gopher_quality, gopher_repetition, c4, fineweb, pii
                             the per-document steps
    minhash, clusters, dedup exact and MinHash-LSH near dedup as five file-passing stages
    mixture                  sampling sources to target weights
    config, shards, pipeline what a run is, which files a shard owns, running the stages
    report, report_html      the JSON report and its self-contained HTML page
    indexed_job              the Kubernetes Indexed Job (`crucible corpus manifest` prints it)
    ray_runner, rayjob       the stages on a Ray cluster; the KubeRay RayJob (`--engine ray`)

The `crucible corpus` command is `crucible.trainer.commands.corpus`.
"""
