"""Training end to end on CPU: it learns real text, sharding changes nothing, Prometheus sees it.

One two-process FSDP run (torchrun, gloo) is shared by the tests of this module: it is scraped by
the stack's real Prometheus while it trains, every per-step metric is looked for on its exporter
and in its JSONL file, its final held-out loss is compared with the unigram entropy of the same
validation tokens, and its first steps are compared with a one-process run of the same config
and global batch.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crucible.trainer.data import ShardSet
from crucible.trainer.metrics import StepMetrics
from tests.support.repo import REPO
from tests.support.services import eventually
from tests.support.training import crucible_cmd, job_config, run_crucible, write_config

STEPS = 80


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_process_run(corpus, tmp_path_factory, prometheus):
    """Train `tiny` on 2 processes while Prometheus scrapes rank 0; yields what was observed."""
    out = tmp_path_factory.mktemp("fsdp2")
    cfg = write_config(job_config(corpus, out, name="fsdp-two", steps=STEPS, evalEvery=40),
                       out / "job.yaml")
    proc = subprocess.Popen(crucible_cmd("train", "--config", str(cfg), "--summary-json",
                                         str(out / "summary.json"), nproc=2),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    scraped = {}
    try:
        exporter = eventually(lambda: json.loads((out / "exporter.json").read_text()), 120,
                              "rank 0's exporter to start")
        target = prometheus.add_target("fsdp-two", f"127.0.0.1:{exporter['port']}")
        query = 'crucible_train_loss{job="fsdp-two",rank="0"}'
        result = eventually(lambda: prometheus.query(query), 90, "loss scraped by Prometheus")
        scraped["loss"] = float(result[0]["value"][1])
        scraped["step"] = float(prometheus.query('crucible_step{job="fsdp-two"}')[0]["value"][1])
        url = f"http://127.0.0.1:{exporter['port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            scraped["series"] = {s.name for family in text_string_to_metric_families(
                resp.read().decode()) for s in family.samples if s.labels.get("job") == "fsdp-two"}
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        target.unlink(missing_ok=True) if "target" in locals() else None
    assert proc.returncode == 0, output[-3000:]
    return {"out": out, "log": output, "scraped": scraped,
            "records": read_jsonl(out / "metrics.jsonl"),
            "summary": json.loads((out / "summary.json").read_text())}


def test_loss_is_exported_and_scraped_by_prometheus(two_process_run):
    train = [r for r in two_process_run["records"] if r["kind"] == "train"]
    scraped = two_process_run["scraped"]
    # The scraped value is the loss of one of the steps the run logged, at that step.
    by_step = {r["step"]: r["loss"] for r in train}
    assert scraped["step"] in by_step
    assert abs(by_step[scraped["step"]] - scraped["loss"]) < 0.05
    assert len(train) == STEPS and train[-1]["tokens"] == STEPS * 4096


def test_every_step_metric_is_exported_and_written(two_process_run):
    train = [r for r in two_process_run["records"] if r["kind"] == "train"]
    record = train[-1]
    for f in fields(StepMetrics):
        key = f.metadata["jsonl"] or f.name
        assert key in record, key
        # This run keeps no checkpoints: the checkpoint's age is null, and has no series.
        if record[key] is not None:
            assert f"crucible_{f.name}" in two_process_run["scraped"]["series"], f.name


def test_two_processes_learn_real_text_well_below_unigram_entropy(two_process_run, corpus):
    val = ShardSet(corpus.val)
    tokens = val.read(0, val.num_tokens)
    counts = np.bincount(tokens)
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())  # best any unigram model can do on val
    evals = [r for r in two_process_run["records"] if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [40, STEPS]
    final = evals[-1]["loss"]
    assert final < unigram_entropy - 0.5, (final, unigram_entropy)
    assert evals[-1]["loss"] < evals[0]["loss"]
    summary = two_process_run["summary"]
    assert summary["eval"]["loss"] == pytest.approx(final)
    assert 0 < summary["eval"]["bits_per_byte"] < 8


def test_one_process_follows_the_two_process_loss_curve(two_process_run, corpus, tmp_path):
    # Same config, same global batch (4096 tokens) and seed: 1 rank with 4 micro-steps of 8
    # sequences vs 2 FSDP ranks with 2 each. Only float summation order differs (the
    # reduce-scatter's average vs one process's sum), so curves agree to ~1e-4 early on.
    steps = 10
    cfg = write_config(job_config(corpus, tmp_path / "one", name="fsdp-one", steps=STEPS,
                                  evalEvery=40), tmp_path / "job.yaml")
    run = run_crucible("train", "--config", str(cfg), "--max-steps", str(steps))
    assert run.returncode == 0, run.stderr[-3000:]
    one = [r["loss"] for r in read_jsonl(tmp_path / "one" / "metrics.jsonl")
           if r["kind"] == "train"]
    two = [r["loss"] for r in two_process_run["records"] if r["kind"] == "train"][:steps]
    assert len(one) == steps
    np.testing.assert_allclose(one, two, rtol=0, atol=2e-3)
    assert one[0] != one[-1]


def test_bad_config_is_one_clear_error(tmp_path, corpus):
    cfg = job_config(corpus, tmp_path / "bad")
    cfg["training"]["globalBatchTokens"] = 1000
    cfg["training"]["warmupStep"] = 3
    run = run_crucible("train", "--config", str(write_config(cfg, tmp_path / "bad.yaml")))
    assert run.returncode == 2
    assert "training.warmupStep: unknown field" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("breakage, message", [
    ("missing-shards", "shard folder .* does not exist"),
    ("small-vocab", "model.vocabSize is 1024"),
    ("other-tokenizer", "re-encode the corpus"),
    ("batch", "globalBatchTokens .* must be a multiple of model.seqLen"),
])
def test_data_and_batch_mistakes_are_clear(tmp_path, corpus, breakage, message):
    cfg = job_config(corpus, tmp_path / "bad")
    if breakage == "missing-shards":
        cfg["data"]["train"] = str(tmp_path / "nowhere")
    elif breakage == "small-vocab":
        cfg["model"]["vocabSize"] = 1024
    elif breakage == "other-tokenizer":
        other = tmp_path / "other.json"
        other.write_text(Path(corpus.tokenizer).read_text().replace('"<|pad|>"', '"<|padding|>"'))
        cfg["data"]["tokenizer"] = str(other)
    else:
        cfg["training"]["globalBatchTokens"] = 4000
    run = run_crucible("train", "--config", str(write_config(cfg, tmp_path / "bad.yaml")))
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    import re

    assert re.search(message, run.stderr), run.stderr[-2000:]
