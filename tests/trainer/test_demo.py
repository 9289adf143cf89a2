"""`crucible demo` (README command 1) runs end to end, shortened to fit the test suite."""

from __future__ import annotations

import json

from tests.support.training import run_crucible


def test_demo_runs_every_stage_and_reports(tmp_path):
    out = tmp_path / "demo"
    run = run_crucible("demo", "--out", str(out), "--steps", "6", "--man-pages", "40",
                       timeout=900)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
    for stage in ("1/5 raw text", "2/5 corpus", "3/5 tokenizer", "4/5 training", "5/5 summary"):
        assert stage in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval"]["loss"] > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "corpus" / "report.json").read_text())
    assert report["summary"]["docs_out"] > 50
    assert "held-out bits per byte" in run.stdout


def test_demo_survives_a_killed_worker_and_a_corrupt_batch(tmp_path):
    """The survival part: a worker SIGKILLed a third of the way resumes from memory; the corrupt
    batch two thirds of the way gets the guard's verdict; both are in the summary and the plot."""
    out = tmp_path / "demo"
    run = run_crucible("demo", "--out", str(out), "--steps", "48", "--man-pages", "40",
                       timeout=1200)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
    records = [json.loads(line) for line in
               (out / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    restores = [r for r in records if r["kind"] == "restore"]
    assert [r["source"] for r in restores] == ["memory"], run.stdout[-3000:]
    assert 16 - 2 <= restores[0]["step"] <= 16 + 1   # killed after step 16, snapshots every 2
    verdicts = [r for r in records if r["kind"] == "guard"]
    assert verdicts and verdicts[0]["step"] == 38 and verdicts[0]["verdict"] != "ok"
    assert "restore after the kill" in run.stdout and "guard at step 38" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 48 and summary["resumed_from"] == restores[0]["step"]
    assert not (out / "train" / "memory" / "demo").exists()  # freed at the end
