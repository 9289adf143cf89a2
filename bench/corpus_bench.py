"""Corpus pipeline vs datatrove as it runs today: same WARC files, same steps, each side's own
defaults, files in and files out, plus per-rule agreement on the same extracted texts.

    ~/.cache/crucible/venv/bin/python bench/corpus_bench.py [--out results.json] [--explain]

Corpus: every HTML page that an installed Debian package ships (the paths listed in
/var/lib/dpkg/info/*.list: Node.js and npm manuals, libxslt, valgrind, libffi, nettle, gtk-doc ...),
up to 1 MiB (Common Crawl truncates captures at 1 MiB), written once into gzipped WARC files under
~/.cache/crucible/bench-warc/ (warcio WARCWriter, HTTP 200 response records with Content-Type
text/html, WARC-Identified-Payload-Type text/html, target URIs https://<package>.docs.example/<path>).
Pages are interleaved by a hash of their path and dealt round-robin into --warc-files files.

(a) Throughput, each side as a whole, one process, files in and files out:
  * datatrove: LocalPipelineExecutor(tasks=1, workers=1) over WarcReader -> Trafilatura ->
    GopherRepetitionFilter -> GopherQualityFilter -> C4QualityFilter(filter_no_terminal_punct=
    False) -> FineWebQualityFilter -> JsonlWriter, then MinHash stages 1-4 (signatures from the
    written JSONL, buckets with 14 tasks, cluster, filter -> JsonlWriter with an exclusion writer),
    every step with its defaults (English words: spaCy blank("en") + sentencizer).
  * Crucible: pipeline.run_local (what `crucible corpus run --workers 1` runs), one shard, steps
    extract, gopher_repetition, gopher_quality, c4 (filter_no_terminal_punct false), fineweb;
    dedup exact off, near on (5-grams, 14 bands x 8 rows); the report stage included.
  Language ID is off on both sides: datatrove's LanguageFilter downloads fastText lid.176 at run
  time. Each side uses its own trafilatura (datatrove 0.10.1 pins trafilatura<1.12; Crucible's is
  2.x), and datatrove's extractor runs in a sandbox subprocess with a 1 s timeout per page (its
  default): pages that time out are dropped there, and the count is printed.
(b) Agreement: every page is extracted once (Crucible's ExtractHtml), then each rule of both
  implementations runs on that same text, alone: Gopher repetition, Gopher quality, C4, FineWeb,
  and near dedup (each side's MinHash over all extracted texts; near_dedup_clustered compares
  whether a document is in any duplicate cluster, near_dedup whether it is removed). Per rule:
  the share of documents with the same keep/remove decision, and the disagreements by (Crucible
  reason, datatrove reason).
  --explain prints a few disagreeing documents with both reasons.

The datatrove side runs in its own virtualenv (datatrove from PyPI is not a project dependency):
    python3.11 -m venv ~/.cache/crucible/datatrove-venv
    ~/.cache/crucible/datatrove-venv/bin/pip install "datatrove[io,processing]==0.10.1" \\
        spacy==3.8.18 xxhash==3.6.0 trafilatura==1.11.0 lxml_html_clean==0.4.6 warcio==1.8.1
(datatrove 0.10.1 passes str to xxhash, which xxhash 4 refuses; trafilatura 1.11 imports
lxml.html.clean, which lxml 6 moved to lxml_html_clean.) This script re-runs itself under that
interpreter with --datatrove-side; results go to --out as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATATROVE_PYTHON = Path.home() / ".cache" / "crucible" / "datatrove-venv" / "bin" / "python"
WARC_CACHE = Path.home() / ".cache" / "crucible" / "bench-warc"
MAX_PAGE_BYTES = 1 << 20        # Common Crawl truncates captures at 1 MiB
RULES = ("gopher_repetition", "gopher_quality", "c4", "fineweb", "near_dedup",
         "near_dedup_clustered")


# ---- corpus (project side) ------------------------------------------------------------------
def shipped_html() -> list[tuple[str, Path]]:
    """(package, path) of every HTML page dpkg lists as installed, regular files up to 1 MiB."""
    pages = {}
    for listing in sorted(Path("/var/lib/dpkg/info").glob("*.list")):
        package = listing.name.removesuffix(".list").split(":")[0]
        for line in listing.read_text(errors="replace").splitlines():
            path = Path(line)
            if path.suffix in (".html", ".htm") and path.is_file() and not path.is_symlink() \
                    and 0 < path.stat().st_size <= MAX_PAGE_BYTES:
                pages.setdefault(str(path), package)
    return [(package, Path(path)) for path, package in sorted(pages.items())]


def target_uri(package: str, path: Path) -> str:
    parts = path.parts[4:] if path.parts[1:4] == ("usr", "share", "doc") else path.parts[1:]
    rel = "/".join(parts[1:] if parts and parts[0] == package else parts)
    return f"https://{package}.docs.example/{rel}"


def build_warcs(n_files: int) -> list[Path]:
    """Write the shipped HTML pages into n_files gzipped WARC files once; reuse them after."""
    import xxhash
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    pages = shipped_html()
    folder = WARC_CACHE / "warc"
    manifest = WARC_CACHE / "manifest.json"
    wanted = {"files": n_files, "pages": [[p, str(f), f.stat().st_size] for p, f in pages]}
    if manifest.exists() and json.loads(manifest.read_text()) == wanted:
        return sorted(folder.glob("*.warc.gz"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    pages.sort(key=lambda page: xxhash.xxh3_64_intdigest(str(page[1]).encode()))
    paths = [folder / f"pages-{i:02d}.warc.gz" for i in range(n_files)]
    outs = [open(p, "wb") for p in paths]
    writers = [WARCWriter(out, gzip=True) for out in outs]
    for i, (package, path) in enumerate(pages):
        body = path.read_bytes()
        try:
            body.decode("utf-8")
            charset = "utf-8"
        except UnicodeDecodeError:
            charset = "iso-8859-1"
        http = StatusAndHeaders("200 OK", [("Content-Type", f"text/html; charset={charset}"),
                                           ("Content-Length", str(len(body)))],
                                protocol="HTTP/1.1")
        record = writers[i % n_files].create_warc_record(
            target_uri(package, path), "response", payload=io.BytesIO(body), http_headers=http,
            warc_headers_dict={"WARC-Identified-Payload-Type": "text/html"})
        writers[i % n_files].write_record(record)
    for out in outs:
        out.close()
    manifest.write_text(json.dumps(wanted))
    return paths


def extracted_texts(warcs: list[Path]) -> list[dict]:
    """Every page's main text (Crucible's reader and ExtractHtml), untimed: the agreement input.
    Cached beside the WARC files (rebuilt with them)."""
    cache = WARC_CACHE / "texts.jsonl"
    if cache.exists() and cache.stat().st_mtime > max(p.stat().st_mtime for p in warcs):
        return [json.loads(line) for line in cache.read_text().splitlines()]
    from crucible.trainer.corpus.config import SourceConfig
    from crucible.trainer.corpus.document import Malformed
    from crucible.trainer.corpus.extract import ExtractHtml
    from crucible.trainer.corpus.readers import Reader
    from crucible.trainer.corpus.shards import list_inputs

    extract = ExtractHtml()
    texts = []
    for file in list_inputs((SourceConfig("web", (str(warcs[0].parent),)),)):
        for doc in Reader().read(file):
            if isinstance(doc, Malformed):
                continue
            url = doc.metadata.get("url", doc.id)
            if isinstance(extract.process(doc), str):
                texts.append({"id": url, "text": ""})
            else:
                texts.append({"id": url, "text": doc.text})
    cache.write_text("".join(json.dumps(t) + "\n" for t in texts))
    return texts


# ---- Crucible -------------------------------------------------------------------------------
def run_ours(warc_dir: Path, work: Path) -> dict:
    from crucible.trainer.corpus.config import from_dict
    from crucible.trainer.corpus.pipeline import read_docs, run_local, shard_uri

    output = work / "crucible"
    config = from_dict({
        "output": str(output), "sources": [{"name": "web", "paths": [str(warc_dir)]}],
        "steps": ["extract", "gopher_repetition", "gopher_quality",
                  {"c4": {"filter_no_terminal_punct": False}}, "fineweb"],
        "dedup": {"exact": False, "near": {}}})
    started = time.perf_counter()
    stage_s = run_local(config, shard_count=1, workers=1)
    total_s = time.perf_counter() - started
    stats = json.loads((output / "stats" / "filter" / "00000.json").read_text())
    read = stats[0]
    return {"total_s": total_s, "stage_s": stage_s,
            "docs_in": sum(c["docs_in"] for c in read["sources"].values()),
            "extract_s": stats[1]["time_s"],
            "filters_s": sum(s["time_s"] for s in stats[2:]),
            "after_filters": sum(1 for _ in read_docs(shard_uri(str(output), "filtered", 0))),
            "after_dedup": sum(1 for _ in read_docs(shard_uri(str(output), "deduped", 0)))}


def decisions_ours(texts: list[dict]) -> dict[str, list[str]]:
    """Each rule alone on each text: "keep" or the drop reason."""
    import numpy as np

    from crucible.trainer.corpus.c4 import C4Quality
    from crucible.trainer.corpus.clusters import clusters_from_pairs
    from crucible.trainer.corpus.dedup import bucket_pairs, signatures
    from crucible.trainer.corpus.document import Document
    from crucible.trainer.corpus.fineweb import FineWebQuality
    from crucible.trainer.corpus.gopher_quality import GopherQuality
    from crucible.trainer.corpus.gopher_repetition import GopherRepetition
    from crucible.trainer.corpus.minhash import MinhashConfig

    rules = {"gopher_repetition": GopherRepetition(), "gopher_quality": GopherQuality(),
             "c4": C4Quality(filter_no_terminal_punct=False), "fineweb": FineWebQuality()}
    out = {}
    for name, rule in rules.items():
        out[name] = []
        for i, t in enumerate(texts):
            result = rule.filter(Document(t["text"], t["id"], "bench", i))
            out[name].append("keep" if result is True else result[1])
    docs = [Document(t["text"], t["id"], "bench", i) for i, t in enumerate(texts)]
    config = MinhashConfig()
    arrays = signatures(docs, config)
    pairs = np.concatenate([bucket_pairs(arrays["keys"], arrays["bands"][:, b])
                            for b in range(config.bands)])
    removed = set(clusters_from_pairs(pairs).remove.tolist())
    clustered = set(pairs.reshape(-1).tolist())
    out["near_dedup"] = ["duplicate" if i in removed else "keep" for i in range(len(texts))]
    out["near_dedup_clustered"] = ["in_cluster" if i in clustered else "keep"
                                   for i in range(len(texts))]
    return out


# ---- datatrove (runs under the datatrove venv) ----------------------------------------------
def run_datatrove(warc_dir: str, work: str) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets,
                                                  MinhashDedupCluster, MinhashDedupFilter,
                                                  MinhashDedupSignature)
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter,
                                            GopherQualityFilter, GopherRepetitionFilter)
    from datatrove.pipeline.readers import JsonlReader, WarcReader
    from datatrove.pipeline.writers import JsonlWriter

    config = MinhashConfig()
    logs = f"{work}/logs"
    executors = {
        "filter": LocalPipelineExecutor(pipeline=[
            WarcReader(warc_dir, glob_pattern="*.warc.gz"), Trafilatura(),
            GopherRepetitionFilter(), GopherQualityFilter(),
            C4QualityFilter(filter_no_terminal_punct=False), FineWebQualityFilter(),
            JsonlWriter(f"{work}/filtered")], tasks=1, workers=1, logging_dir=f"{logs}/filter"),
        "signatures": LocalPipelineExecutor(pipeline=[
            JsonlReader(f"{work}/filtered"),
            MinhashDedupSignature(output_folder=f"{work}/sigs", config=config)],
            tasks=1, workers=1, logging_dir=f"{logs}/signatures"),
        "buckets": LocalPipelineExecutor(pipeline=[
            MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets",
                                config=config)],
            tasks=config.num_buckets, workers=1, logging_dir=f"{logs}/buckets"),
        "clusters": LocalPipelineExecutor(pipeline=[
            MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/remove",
                                config=config)],
            tasks=1, workers=1, logging_dir=f"{logs}/clusters"),
        "dedup": LocalPipelineExecutor(pipeline=[
            JsonlReader(f"{work}/filtered"),
            MinhashDedupFilter(input_folder=f"{work}/remove",
                               exclusion_writer=JsonlWriter(f"{work}/removed")),
            JsonlWriter(f"{work}/deduped")], tasks=1, workers=1, logging_dir=f"{logs}/dedup"),
    }
    stage_s = {}
    started = time.perf_counter()
    for name, executor in executors.items():
        begun = time.perf_counter()
        executor.run()
        stage_s[name] = time.perf_counter() - begun
    total_s = time.perf_counter() - started

    def lines(folder: str) -> int:
        import gzip

        return sum(len(gzip.open(p, "rt").read().splitlines())
                   for p in glob.glob(f"{folder}/*.jsonl.gz"))

    stats = json.loads(Path(f"{logs}/filter/stats.json").read_text())
    by_name = {s["name"]: s for s in stats}
    extract = next(s for n, s in by_name.items() if "Trafilatura" in n)
    filters = [s for n, s in by_name.items() if any(
        k in n for k in ("Gopher", "C4", "FineWeb"))]
    reader = next(s for n, s in by_name.items() if "Warc" in n)
    return {"total_s": total_s, "stage_s": stage_s,
            "docs_in": reader["stats"]["documents"]["total"],
            "extract_s": extract["time_stats"]["total"],
            "extract_timeouts": extract["stats"].get("timeout", 0),
            "filters_s": sum(s["time_stats"]["total"] for s in filters),
            "after_filters": lines(f"{work}/filtered"), "after_dedup": lines(f"{work}/deduped")}


def decisions_datatrove(texts: list[dict]) -> dict[str, list[str]]:
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets,
                                                  MinhashDedupCluster, MinhashDedupFilter,
                                                  MinhashDedupSignature)
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter,
                                            GopherQualityFilter, GopherRepetitionFilter)

    rules = {"gopher_repetition": GopherRepetitionFilter(), "gopher_quality": GopherQualityFilter(),
             "c4": C4QualityFilter(filter_no_terminal_punct=False),
             "fineweb": FineWebQualityFilter()}
    out = {}
    for name, rule in rules.items():
        out[name] = []
        for i, t in enumerate(texts):
            result = rule.filter(Document(text=t["text"], id=str(i)))
            out[name].append("keep" if result is True else result[1])

    def documents():
        return (Document(text=t["text"], id=str(i)) for i, t in enumerate(texts))

    config = MinhashConfig()
    with tempfile.TemporaryDirectory() as tmp:
        MinhashDedupSignature(f"{tmp}/sigs", config=config).run(documents(), 0, 1)
        for bucket in range(config.num_buckets):
            MinhashDedupBuckets(f"{tmp}/sigs", f"{tmp}/buckets", config=config).run(
                None, bucket, config.num_buckets)
        MinhashDedupCluster(f"{tmp}/buckets", f"{tmp}/remove", config=config,
                            save_cluster_id=True).run(None, 0, 1)
        kept = {d.id for d in MinhashDedupFilter(f"{tmp}/remove").run(documents(), 0, 1)}
        clusters = Path(f"{tmp}/remove/000000.clusters")
        raw = clusters.read_bytes() if clusters.exists() else b""
        clustered = {doc for doc, _ in struct.iter_unpack("<II", raw)}
    out["near_dedup"] = ["keep" if str(i) in kept else "duplicate" for i in range(len(texts))]
    out["near_dedup_clustered"] = ["in_cluster" if i in clustered else "keep"
                                   for i in range(len(texts))]
    return out


def datatrove_side(warc_dir: str, texts_path: str, out_path: str, work: str) -> None:
    result = run_datatrove(warc_dir, work)
    texts = [json.loads(line) for line in Path(texts_path).read_text().splitlines()]
    result["decisions"] = decisions_datatrove(texts)
    from datatrove.utils.text import split_into_words

    result["token_digests"] = [tokens_digest(split_into_words(t["text"])) for t in texts]
    Path(out_path).write_text(json.dumps(result))


def tokens_digest(tokens: list[str]) -> str:
    """A short digest of a document's word tokens (both sides compare them)."""
    import hashlib

    return hashlib.sha256("\x1f".join(tokens).encode()).hexdigest()[:16]


# ---- report ---------------------------------------------------------------------------------
def agreement(texts: list[dict], ours: dict, theirs: dict) -> dict:
    table = {}
    for rule in RULES:
        a, b = ours[rule], theirs[rule]
        same = sum((x == "keep") == (y == "keep") for x, y in zip(a, b))
        pairs = collections.Counter((x, y) for x, y in zip(a, b) if (x == "keep") != (y == "keep"))
        table[rule] = {"agree": same / len(texts), "removed_ours": sum(x != "keep" for x in a),
                       "removed_datatrove": sum(y != "keep" for y in b),
                       "disagreements": [{"crucible": x, "datatrove": y, "docs": n}
                                         for (x, y), n in pairs.most_common()]}
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warc-files", type=int, default=4)
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--explain", action="store_true", help="print disagreeing documents")
    parser.add_argument("--datatrove-python", default=str(DATATROVE_PYTHON))
    parser.add_argument("--datatrove-side", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.datatrove_side:
        datatrove_side(*args.datatrove_side)
        return 0
    if not Path(args.datatrove_python).exists():
        print(f"no datatrove interpreter at {args.datatrove_python}: see this script's docstring")
        return 1

    warcs = build_warcs(args.warc_files)
    html_bytes = sum(p.stat().st_size for _, p in shipped_html())
    texts = extracted_texts(warcs)
    print(f"corpus: {len(texts)} HTML pages ({html_bytes / 1e6:.1f} MB) in {len(warcs)} WARC "
          f"files ({sum(p.stat().st_size for p in warcs) / 1e6:.1f} MB gzipped); "
          f"{sum(1 for t in texts if t['text'])} with main text after extraction")
    n_records = len(texts)
    texts = [t for t in texts if t["text"].strip()]     # both pipelines drop the others first
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        texts_path = work / "texts.jsonl"
        texts_path.write_text("".join(json.dumps(t) + "\n" for t in texts))
        env = {**os.environ, "PYTHONPATH": "", "LOGURU_LEVEL": "WARNING"}
        subprocess.run([args.datatrove_python, __file__, "--datatrove-side", str(warcs[0].parent),
                        str(texts_path), str(work / "datatrove.json"), str(work / "datatrove")],
                       check=True, env=env)
        theirs = json.loads((work / "datatrove.json").read_text())
        ours = run_ours(warcs[0].parent, work)
    ours["decisions"] = decisions_ours(texts)

    print(f"\n{'one process, files in and out':34}{'Crucible':>12}{'datatrove':>12}{'ratio':>8}")
    rows = (("whole run, WARC records/s", lambda s: n_records / s["total_s"]),
            ("whole run, MB HTML/s", lambda s: html_bytes / 1e6 / s["total_s"]),
            ("  extraction s", lambda s: s["extract_s"]),
            ("  all but extraction s", lambda s: s["total_s"] - s["extract_s"]),
            ("  filters s", lambda s: s["filters_s"]),
            ("  whole run s", lambda s: s["total_s"]))
    for label, f in rows:
        mine, other = f(ours), f(theirs)
        ratio = mine / other if "/s" in label else other / mine
        print(f"{label:34}{mine:12,.2f}{other:12,.2f}{ratio:8.2f}x")
    print(f"  (the same {n_records} records on both sides; datatrove's reader drops pages that "
          "are not UTF-8 when cchardet cannot name their charset)")
    for key in ("docs_in", "after_filters", "after_dedup"):
        print(f"{'  documents ' + key:34}{ours[key]:12,}{theirs[key]:12,}")
    print(f"  datatrove extraction timeouts (1 s): {theirs['extract_timeouts']}")
    print("  stage seconds: Crucible " + ", ".join(f"{k} {v:.1f}" for k, v in ours["stage_s"].items())
          + "; datatrove " + ", ".join(f"{k} {v:.1f}" for k, v in theirs["stage_s"].items()))

    from crucible.trainer.corpus.words import split_words

    same_tokens = sum(tokens_digest(split_words(t["text"])) == d
                      for t, d in zip(texts, theirs["token_digests"]))
    table = agreement(texts, ours["decisions"], theirs["decisions"])
    print(f"\nword tokens equal to datatrove's (spaCy) in {same_tokens} of {len(texts)} texts")
    print(f"per-rule agreement on the same {len(texts)} extracted texts (each rule alone)")
    for rule, row in table.items():
        print(f"  {rule:20}{100 * row['agree']:8.2f}%   removed: Crucible {row['removed_ours']}, "
              f"datatrove {row['removed_datatrove']}")
        for d in row["disagreements"]:
            print(f"      {d['docs']:4}  Crucible {d['crucible']:28} datatrove {d['datatrove']}")
    if args.explain:
        for rule in RULES:
            a, b = ours["decisions"][rule], theirs["decisions"][rule]
            shown = [i for i in range(len(texts)) if (a[i] == "keep") != (b[i] == "keep")][:4]
            for i in shown:
                note = ""
                if rule == "near_dedup":
                    note = "  (in a cluster: Crucible {}, datatrove {})".format(
                        *(d["near_dedup_clustered"][i] == "in_cluster"
                          for d in (ours["decisions"], theirs["decisions"])))
                print(f"\n--- {rule}: {texts[i]['id']}  Crucible {a[i]}, datatrove {b[i]}{note}")
                print(texts[i]["text"][:600])
    if args.out:
        Path(args.out).write_text(json.dumps({
            "warc_records": n_records, "documents": len(texts), "html_bytes": html_bytes,
            "crucible": {k: v for k, v in ours.items() if k != "decisions"},
            "datatrove": {k: v for k, v in theirs.items()
                          if k not in ("decisions", "token_digests")},
            "same_tokens": same_tokens, "agreement": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
