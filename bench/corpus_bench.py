"""Corpus pipeline vs datatrove, side by side on the same documents and thresholds.

    ~/.cache/crucible/venv/bin/python bench/corpus_bench.py [--docs 4000]

Prints documents per second per core for (a) the filter chain Gopher repetition -> Gopher quality
-> C4 (terminal-punctuation rule off) -> FineWeb, and (b) MinHash near dedup alone (signatures,
buckets, clusters: 5-grams, 14 bands x 8 rows), for both implementations, their ratio, and the
share of documents on which both make the same keep/remove decision, per step.

The datatrove side runs in its own virtualenv (datatrove from PyPI is not a project dependency):
    python3.11 -m venv ~/.cache/crucible/datatrove-venv
    ~/.cache/crucible/datatrove-venv/bin/pip install datatrove==0.10.1 nltk tokenizers xxhash==3.6.0
(datatrove 0.10.1 passes str to xxhash, which xxhash 4 refuses.)
This script re-runs itself under that interpreter with --datatrove-side.

What cannot be compared offline, and what was substituted:
  * datatrove's LanguageFilter downloads fastText lid.176 at run time: language ID is left out of
    the comparison (ours uses py3langid; its accuracy is in tests/corpus/test_language.py).
  * datatrove's English word splitter is NLTK word_tokenize, whose sentence splitter loads the
    `punkt` data at run time. We give datatrove the same NLTK code with an untrained
    PunktSentenceTokenizer (no abbreviation list), passed as its documented custom WordTokenizer.
  * HTML extraction is trafilatura on both sides, so it is done once before timing, not compared.
Corpus: real text from installed packages (Debian changelogs, copyright files, HTML manuals after
extraction, English fortunes, Python's pydoc topics). Both sides run on one core, in process,
over documents already in memory, through their own step machinery (stats included).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATATROVE_PYTHON = Path.home() / ".cache" / "crucible" / "datatrove-venv" / "bin" / "python"
CORPUS_CACHE = Path.home() / ".cache" / "crucible" / "bench-corpus.jsonl"
FILTERS = ("gopher_repetition", "gopher_quality", "c4", "fineweb")


# ---- corpus (project side) ------------------------------------------------------------------
def build_corpus(limit: int) -> list[dict]:
    if CORPUS_CACHE.exists():
        docs = [json.loads(line) for line in CORPUS_CACHE.read_text().splitlines()]
        if len(docs) >= limit:
            return docs[:limit]
    import trafilatura

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.corpus import realtext

    docs = []
    for path in sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz")):
        docs.append({"id": str(path), "text": gzip.decompress(path.read_bytes())
                     .decode("utf-8", "replace")[:20000]})
    for path in realtext.copyright_files():
        docs.append({"id": str(path), "text": path.read_text(errors="replace")})
    for path in realtext.html_manuals():
        text = trafilatura.extract(path.read_text(errors="replace"), favor_precision=True)
        if text:
            docs.append({"id": str(path), "text": text})
    for name, text in realtext.pydoc_topics().items():
        docs.append({"id": f"pydoc:{name}", "text": text})
    for i, text in enumerate(realtext.fortunes("en")):
        docs.append({"id": f"fortune:{i}", "text": text})
    # Interleave sources so that any prefix is a mix of all of them.
    docs.sort(key=lambda d: hash_of(d["id"]))
    CORPUS_CACHE.parent.mkdir(parents=True, exist_ok=True)
    CORPUS_CACHE.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return docs[:limit]


def hash_of(text: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(text.encode())


# ---- ours -----------------------------------------------------------------------------------
def run_ours(docs: list[dict]) -> dict:
    from crucible.trainer.corpus.c4 import C4Quality
    from crucible.trainer.corpus.clusters import clusters_from_pairs
    from crucible.trainer.corpus.dedup import bucket_pairs, signatures
    from crucible.trainer.corpus.document import Document
    from crucible.trainer.corpus.fineweb import FineWebQuality
    from crucible.trainer.corpus.gopher_quality import GopherQuality
    from crucible.trainer.corpus.gopher_repetition import GopherRepetition
    from crucible.trainer.corpus.minhash import MinhashConfig
    from crucible.trainer.corpus.step import run_steps
    from crucible.trainer.corpus.words import punctuation

    import numpy as np

    punctuation()    # build the character tables before timing (once per process)

    def make_steps():
        return [GopherRepetition(), GopherQuality(), C4Quality(filter_no_terminal_punct=False),
                FineWebQuality()]

    def documents():
        return [Document(d["text"], d["id"], "bench", i) for i, d in enumerate(docs)]

    decisions = {}
    for step in make_steps():          # each step alone on every document
        decisions[step.name] = [isinstance(step.process(doc), Document) for doc in documents()]

    steps = make_steps()
    stats = [s.new_stats() for s in steps]
    batch = documents()
    started = time.perf_counter()
    kept = sum(1 for _ in run_steps(batch, steps, stats))
    chain_s = time.perf_counter() - started

    batch = documents()
    config = MinhashConfig()
    started = time.perf_counter()
    arrays = signatures(batch, config)
    pairs = np.concatenate([bucket_pairs(arrays["keys"], arrays["bands"][:, b])
                            for b in range(config.bands)])
    removed = clusters_from_pairs(pairs).remove
    dedup_s = time.perf_counter() - started
    removed_set = set(removed.tolist())
    decisions["near_dedup"] = [i not in removed_set for i in range(len(docs))]
    return {"chain_s": chain_s, "chain_kept": kept, "dedup_s": dedup_s, "decisions": decisions}


# ---- datatrove (runs under the datatrove venv) ----------------------------------------------
def run_datatrove(docs: list[dict]) -> dict:
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets,
                                                  MinhashDedupCluster, MinhashDedupFilter,
                                                  MinhashDedupSignature)
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter,
                                            GopherQualityFilter, GopherRepetitionFilter)
    from datatrove.utils.word_tokenizers import WordTokenizer, strip_strings
    from nltk.tokenize import NLTKWordTokenizer, PunktSentenceTokenizer

    class OfflineNltk(WordTokenizer):
        """NLTK word_tokenize as datatrove calls it, with an untrained Punkt (no download)."""

        def __init__(self):
            super().__init__("en")
            self._sentences = PunktSentenceTokenizer()
            self._words = NLTKWordTokenizer()

        def word_tokenize(self, text):
            return strip_strings([t for s in self._sentences.tokenize(text)
                                  for t in self._words.tokenize(s)])

        def sent_tokenize(self, text):
            return strip_strings(self._sentences.tokenize(text))

        def span_tokenize(self, text):
            return list(self._sentences.span_tokenize(text))

    tok = OfflineNltk()

    def make_steps():
        return [GopherRepetitionFilter(language=tok), GopherQualityFilter(language=tok),
                C4QualityFilter(filter_no_terminal_punct=False, language=tok),
                FineWebQualityFilter(language=tok)]

    def documents():
        return [Document(text=d["text"], id=str(i)) for i, d in enumerate(docs)]

    names = dict(zip(FILTERS, range(4)))
    decisions = {}
    for name, step in zip(names, make_steps()):
        decisions[name] = []
        for doc in documents():
            result = step.filter(doc)
            decisions[name].append(result is True or (isinstance(result, bool) and result))

    stream = iter(documents())
    for step in make_steps():
        stream = step.run(stream, rank=0, world_size=1)
    started = time.perf_counter()
    kept = sum(1 for _ in stream)
    chain_s = time.perf_counter() - started

    config = MinhashConfig()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        MinhashDedupSignature(f"{tmp}/sigs", config=config, language=tok).run(
            iter(documents()), rank=0, world_size=1)
        for bucket in range(config.num_buckets):
            MinhashDedupBuckets(f"{tmp}/sigs", f"{tmp}/buckets", config=config).run(
                None, rank=bucket, world_size=config.num_buckets)
        MinhashDedupCluster(f"{tmp}/buckets", f"{tmp}/remove", config=config).run(None, 0, 1)
        dedup_s = time.perf_counter() - started
        kept_ids = {d.id for d in MinhashDedupFilter(f"{tmp}/remove").run(iter(documents()), 0, 1)}
    decisions["near_dedup"] = [str(i) in kept_ids for i in range(len(docs))]
    return {"chain_s": chain_s, "chain_kept": kept, "dedup_s": dedup_s, "decisions": decisions}


# ---- report ---------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--datatrove-python", default=str(DATATROVE_PYTHON))
    parser.add_argument("--datatrove-side", nargs=2, metavar=("CORPUS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.datatrove_side:
        corpus, out = args.datatrove_side
        docs = [json.loads(line) for line in Path(corpus).read_text().splitlines()]
        Path(out).write_text(json.dumps(run_datatrove(docs)))
        return 0

    docs = build_corpus(args.docs)
    print(f"corpus: {len(docs)} documents, {sum(len(d['text']) for d in docs) / 1e6:.1f} M chars")
    ours = run_ours(docs)
    if not Path(args.datatrove_python).exists():
        print(f"datatrove side skipped: no interpreter at {args.datatrove_python} (see --help)")
        theirs = None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            corpus, out = Path(tmp, "corpus.jsonl"), Path(tmp, "out.json")
            corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
            env = {**os.environ, "PYTHONPATH": "", "LOGURU_LEVEL": "ERROR"}
            subprocess.run([args.datatrove_python, __file__, "--datatrove-side", str(corpus),
                            str(out)], check=True, env=env)
            theirs = json.loads(out.read_text())

    n = len(docs)
    print(f"\n{'':28}{'ours':>12}{'datatrove':>12}{'ratio':>8}   (docs/s on one core)")
    for label, key in (("filter chain", "chain_s"), ("near dedup (stages 1-3)", "dedup_s")):
        mine = n / ours[key]
        if theirs:
            other = n / theirs[key]
            print(f"{label:28}{mine:12,.0f}{other:12,.0f}{mine / other:8.2f}x")
        else:
            print(f"{label:28}{mine:12,.0f}")
    if theirs:
        print(f"\nkept after the chain: ours {ours['chain_kept']}, datatrove {theirs['chain_kept']}")
        print(f"{'agreement (same keep/remove)':28}")
        for step in (*FILTERS, "near_dedup"):
            a, b = ours["decisions"][step], theirs["decisions"][step]
            same = sum(x == y for x, y in zip(a, b)) / n
            print(f"  {step:26}{100 * same:8.2f}%   removed: ours {a.count(False)}, "
                  f"datatrove {b.count(False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
