"""End to end on a real multi-source raw corpus built from installed packages: HTML manuals,
package copyright files (many share a licence text), fortunes in four languages (JSONL.zst, with
broken lines), man-db's English man pages, Python's pydoc topics (Parquet) and a "mirror" source of
lightly edited licence texts that pass the filters (planted near-duplicates).

Checks: the report adds up at every step, the output is deterministic for a fixed seed, a sharded
run (N=3, 2 processes) and two Indexed-Job workers give the single-shard result, a finished run
resumes by skipping what it did, and the CLI renders a self-contained HTML report.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from crucible.trainer.cli import main
from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus import pipeline
from crucible.trainer.corpus.document import Document
from crucible.trainer.corpus.shards import Shard
from tests.corpus import realtext


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    (root / "html").mkdir()
    for i, page in enumerate(realtext.html_manuals()[:40]):
        shutil.copy(page, root / "html" / f"{i:02d}-{page.name}")
    (root / "copyright").mkdir()
    for path in realtext.copyright_files()[:120]:
        shutil.copy(path, root / "copyright" / f"{path.parent.name}.txt")
    (root / "fortunes").mkdir()
    for lang in ("en", "de", "it", "es"):
        lines = [json.dumps({"id": f"{lang}-{i}", "text": t})
                 for i, t in enumerate(realtext.fortunes(lang)[:150])]
        (root / "fortunes" / f"{lang}.jsonl.zst").write_bytes(
            zstandard.compress(("\n".join(lines) + "\n").encode()))
    (root / "fortunes" / "broken.jsonl").write_bytes(b'{"text": 1}\n{oops\n\xff\n')
    (root / "man").mkdir()
    for name, text in zip(realtext.MAN_DB_PAGES, realtext.man_pages("en")):
        (root / "man" / (Path(name).name + ".txt")).write_text(text)
    topics = realtext.pydoc_topics()
    pq.write_table(pa.table({"id": list(topics), "text": list(topics.values())}),
                   root / "pydoc.parquet")
    # The planted copies are of licence texts the default filters keep (most pydoc topics are
    # now dropped for having under 80% words with a letter, on datatrove's side too), so that
    # dedup is what removes them.
    steps = corpus_config.from_dict(config_dict(root, root / "unused")).build_steps()
    licences = {}
    for path in realtext.copyright_files()[:120]:
        text = path.read_text(errors="replace")
        if all(not isinstance(step.process(Document(text, path.name, "t", 0)), str)
               for step in steps if step.name not in ("extract", "normalise", "language")):
            licences.setdefault(text, path.parent.name)
    rng = np.random.default_rng(0)
    mirror = []
    for text, name in licences.items():
        words = text.split()
        for at in rng.choice(len(words), size=max(1, len(words) // 100), replace=False):
            words[at] = words[at].upper()           # a re-cased word: a near, not exact, copy
        mirror.append(json.dumps({"id": f"mirror-{name}", "text": " ".join(words)}))
    mirror.append(json.dumps({"id": "mirror-exact", "text": next(iter(licences))}))
    (root / "mirror.jsonl").write_text("\n".join(mirror) + "\n")
    return root


def config_dict(raw: Path, output: Path) -> dict:
    return {
        "output": str(output),
        "sources": [{"name": "manuals", "paths": [str(raw / "html")]},
                    {"name": "copyright", "paths": [str(raw / "copyright")]},
                    {"name": "fortunes", "paths": [str(raw / "fortunes")]},
                    {"name": "man", "paths": [str(raw / "man")]},
                    {"name": "pydoc", "paths": [str(raw / "pydoc.parquet")]},
                    {"name": "mirror", "paths": [str(raw / "mirror.jsonl")]}],
        "steps": ["extract", "normalise", {"language": {"languages": ["en", "de", "it", "es"]}},
                  "gopher_repetition", "gopher_quality",
                  {"c4": {"filter_no_terminal_punct": False}}, "fineweb"],
        "pii": {},
        "mixture": {"weights": {"manuals": 0.3, "copyright": 0.1, "man": 0.2, "pydoc": 0.3,
                                "mirror": 0.1}, "seed": 11},
    }


def final_docs(output: Path, folder: str = "mixed") -> list[tuple]:
    found = []
    for path in sorted((output / folder).glob("shard-*.jsonl.zst")):
        for doc in pipeline.read_docs(str(path)):
            found.append((doc.key, doc.metadata.get("copy"), doc.source, doc.id, doc.text))
    return sorted(found)


def comparable(report: dict) -> list:
    """The report's steps without timings (the one field that is not reproducible)."""
    return [{k: v for k, v in step.items() if k not in ("time_s", "docs_per_s")}
            for step in report["steps"]]


def run(raw: Path, output: Path, shards: int, workers: int = 1) -> dict:
    cfg = corpus_config.from_dict(config_dict(raw, output))
    pipeline.run_local(cfg, shards, workers)
    return json.loads((output / "report.json").read_text())


@pytest.fixture(scope="module")
def single(raw, tmp_path_factory):
    output = tmp_path_factory.mktemp("single")
    return output, run(raw, output, shards=1)


def test_report_adds_up_and_every_step_removed_something_for_a_reason(single):
    output, report = single
    assert report["checks"] == {"adds_up": True, "problems": []}
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == ["read", "extract", "normalise", "language", "gopher_repetition",
                           "gopher_quality", "c4", "fineweb", "exact_dedup", "near_dedup", "pii",
                           "mixture"]
    for step in report["steps"]:
        t = step["totals"]
        assert t["docs_in"] - t["removed_docs"] + sum(
            n for k, n in step["counters"].items() if k.startswith("extra_copies.")) == t["docs_out"]
    assert {r["reason"] for r in steps["read"]["reasons"]} == {"missing_text", "bad_json", "bad_utf8"}
    charsets = {k: n for k, n in steps["read"]["counters"].items() if k.startswith("charset_")}
    assert sum(charsets.values()) == steps["read"]["sources"]["manuals"]["docs_in"] == 40
    mirror = steps["near_dedup"]["sources"]["mirror"]                # planted near copies that
    assert mirror["docs_in"] >= 3 and mirror["docs_out"] == 0          # passed the filters: gone
    assert mirror["reasons"] == {"near_duplicate": mirror["docs_in"]}
    assert steps["exact_dedup"]["totals"]["removed_docs"] >= 2       # shared licences, mirror-exact
    assert steps["gopher_quality"]["samples"]                        # removed samples kept
    assert report["dedup"]["near"]["cluster_sizes"]
    epochs = steps["mixture"]["params"]["epochs"]
    assert set(epochs) == {"manuals", "copyright", "man", "pydoc", "mirror"}
    assert steps["mixture"]["sources"]["fortunes"]["reasons"] == {
        "source_not_in_mixture": steps["mixture"]["sources"]["fortunes"]["docs_in"]}
    html = (output / "report.html").read_text()
    assert "<svg" in html and "src=\"http" not in html and "<script" not in html


def test_output_is_deterministic_for_a_fixed_seed(raw, single, tmp_path):
    output, report = single
    again = run(raw, tmp_path / "again", shards=1)
    assert comparable(again) == comparable(report)
    assert final_docs(tmp_path / "again") == final_docs(output)


def test_three_shards_equal_one(raw, single, tmp_path):
    output, report = single
    sharded = run(raw, tmp_path / "sharded", shards=3, workers=2)
    assert comparable(sharded) == comparable(report)
    assert final_docs(tmp_path / "sharded") == final_docs(output)


@pytest.mark.parametrize("shards", [None, 5])    # one shard per worker, or more shards than pods
def test_indexed_job_workers_equal_one_shard_run(raw, single, tmp_path, shards):
    output, report = single
    cfg = corpus_config.from_dict(config_dict(raw, tmp_path / "workers"))
    errors = []

    def worker(index: int) -> None:
        try:
            pipeline.run_worker(cfg, Shard(index, 2), wait_timeout_s=120, poll_s=0.05,
                                shard_count=shards)
        except Exception as err:  # noqa: BLE001 - re-raised in the test thread below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    worker_report = json.loads((tmp_path / "workers" / "report.json").read_text())
    assert worker_report["run"]["shards"] == (shards or 2)
    assert comparable(worker_report) == comparable(report)
    assert final_docs(tmp_path / "workers") == final_docs(output)


def test_resume_skips_finished_tasks_and_refuses_another_config(raw, tmp_path):
    output = tmp_path / "resume"
    first = run(raw, output, shards=2)
    (output / "done" / "dedup" / "00001").unlink()         # as if shard 1 died mid-stage
    (output / "deduped" / "shard-00001.jsonl.zst").unlink()
    before = (output / "filtered" / "shard-00000.jsonl.zst").stat().st_mtime_ns
    second = run(raw, output, shards=2)
    assert (output / "filtered" / "shard-00000.jsonl.zst").stat().st_mtime_ns == before
    assert comparable(second) == comparable(first)
    with pytest.raises(pipeline.RunMismatch):
        run(raw, output, shards=3)


def test_a_run_cut_off_between_component_steps_resumes_in_the_step_it_was_in(raw, tmp_path):
    """Component steps are known only as they finish: a resumed run must find the step it died
    in from the markers and summaries, and reach the same clusters."""
    output = tmp_path / "cut"
    first = run(raw, output, shards=2)
    done = output / "done"
    steps = sorted(int(p.name.split(".")[1]) for p in done.glob("components.*"))
    assert steps == list(range(len(steps))) and len(steps) >= 2
    cut = steps[-2]                                # died in the step before the last
    for step in steps[cut + 1:]:
        shutil.rmtree(done / f"components.{step}")
    for stage in ("clusters", "dedup", "mix", "report"):
        shutil.rmtree(done / stage)
    (done / f"components.{cut}" / "00001").unlink()
    shutil.rmtree(output / "dedup" / "near")
    (output / "report.json").unlink()
    second = run(raw, output, shards=2)
    assert sorted(int(p.name.split(".")[1]) for p in done.glob("components.*")) == steps
    assert comparable(second) == comparable(first)
    assert second["dedup"]["near"]["removed"] > 0


def test_cli_runs_a_config_file_and_reports_user_errors(raw, tmp_path, capsys):
    path = tmp_path / "corpus.yaml"
    cfg = config_dict(raw, tmp_path / "cli")
    cfg["sources"] = cfg["sources"][:1]
    cfg["mixture"] = None
    path.write_text(yaml.safe_dump(cfg))
    assert main(["corpus", "run", "--config", str(path), "--no-progress"]) == 0
    assert (tmp_path / "cli" / "report.html").is_file()
    path.write_text(yaml.safe_dump({**cfg, "steps": ["gopher_quality", {"c4": {"nope": 1}}]}))
    assert main(["corpus", "run", "--config", str(path)]) == 2
    assert "c4" in capsys.readouterr().err
