"""The guard in the training loop (CPU, `tiny`, real text): injected faults get the expected
verdicts, a rollback really reloads and skips data, and the run ends near an uninjected one."""

from __future__ import annotations

import csv
import json

import pytest

from tests.support.training import job_config, run_crucible, write_config

STEPS = 100
GARBAGE, BAD_LR, NAN = 30, 50, 75
GUARD = {"minHistory": 16, "recoverSteps": 10, "rollbackMarginSteps": 5, "cooldownSteps": 20}
VAL_TOLERANCE_NATS = 0.25  # injected vs clean final held-out loss; measured gap 0.11


def records(path, kind):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def train(corpus, tmp_path, name, inject=None):
    cfg = job_config(corpus, tmp_path / name, name=name, steps=STEPS, evalTokens=16384)
    cfg["checkpoint"] = {"uri": str(tmp_path / name / "ckpt"), "everySteps": 5,
                         "everyMinutes": 0, "keep": 4, "keepEvery": 10}
    cfg["faultTolerance"] = {"spikeGuard": GUARD}
    path = write_config(cfg, tmp_path / f"{name}.yaml")
    run = run_crucible("train", "--config", str(path), env={"CRUCIBLE_INJECT": inject or ""})
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp_path / name / "metrics.jsonl", path


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    clean = train(corpus, tmp, "clean")
    injected = train(corpus, tmp, "injected", f"garbage@{GARBAGE},lr_x100@{BAD_LR},nan@{NAN}")
    return {"clean": clean, "injected": injected}


def test_each_injected_fault_gets_its_verdict(runs):
    jsonl, _ = runs["injected"]
    verdicts = [(r["step"], r["verdict"]) for r in records(jsonl, "guard")]
    # Corrupt batch: not applied, then judged a recoverable blip.
    assert (GARBAGE, "skip") in verdicts and (GARBAGE + 1, "transient") in verdicts
    # NaN loss: not applied ("non-finite loss"), then recoverable.
    nan = next(r for r in records(jsonl, "guard") if r["step"] == NAN)
    assert nan["verdict"] == "skip" and nan["reason"].startswith("non-finite loss")
    steps = {r["step"]: r for r in records(jsonl, "train")}
    assert steps[NAN]["applied"] is False and steps[NAN]["update_norm"] == 0.0  # nothing moved
    assert steps[NAN + 1]["update_norm"] > 0
    # One update at 100x LR wrecks the weights: the guard rolls back within a few steps.
    rollback = next(r for r in records(jsonl, "guard") if r["verdict"] == "rollback")
    assert BAD_LR < rollback["onset"] <= BAD_LR + 2
    delay = rollback["step"] - BAD_LR
    assert delay <= 5, f"rollback {delay} steps after the bad update"


def test_rollback_reloads_an_earlier_commit_and_skips_its_data(runs):
    jsonl, _ = runs["injected"]
    guard = next(r for r in records(jsonl, "guard") if r["verdict"] == "rollback")
    back = records(jsonl, "rollback")
    assert len(back) == 1
    restored = back[0]["to_step"]
    assert restored <= guard["onset"] - GUARD["rollbackMarginSteps"] and restored % 5 == 0
    assert back[0]["skipped_batches"] == guard["onset"] - restored
    assert back[0]["sample_offset"] == back[0]["skipped_batches"] * 32  # 32 sequences per step
    train_steps = [r["step"] for r in records(jsonl, "train")]
    after = train_steps[train_steps.index(guard["step"]) + 1]
    assert after == restored + 1  # training continued from the restored step
    lrs = {r["step"]: r["lr"] for r in records(jsonl, "train")}
    clean_lr = {r["step"]: r["lr"] for r in records(runs["clean"][0], "train")}
    assert lrs[restored + 2] == pytest.approx(0.5 * clean_lr[restored + 2])  # lowered for a while
    assert lrs[STEPS] == pytest.approx(clean_lr[STEPS])


def test_injected_run_ends_near_the_clean_run(runs):
    clean = records(runs["clean"][0], "eval")[-1]["loss"]
    injected = records(runs["injected"][0], "eval")[-1]["loss"]
    assert abs(injected - clean) < VAL_TOLERANCE_NATS, (clean, injected)


def test_offline_diagnose_reproduces_the_online_verdicts(runs, tmp_path):
    jsonl, cfg = runs["injected"]
    out = run_crucible("diagnose", str(jsonl), "--config", str(cfg), "--json",
                       "--png", str(tmp_path / "d.png"))
    assert out.returncode == 0, out.stderr
    offline = [(v["step"], v["verdict"]) for v in json.loads(out.stdout)]
    online = [(r["step"], r["verdict"]) for r in records(jsonl, "guard")]
    assert offline == online
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_diagnose_reads_a_csv_of_a_healthy_run_without_alarms(runs, tmp_path):
    path = tmp_path / "healthy.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "grad_norm"])
        for r in records(runs["clean"][0], "train"):
            w.writerow([r["step"], r["loss"], r["grad_norm"]])
    out = run_crucible("diagnose", str(path), "--config", str(runs["clean"][1]))
    assert out.returncode == 0, out.stderr
    assert f"{STEPS} steps from" in out.stdout and "0 verdict(s)" in out.stdout


def test_diagnose_input_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("step,loss\n1,2.0\n")
    out = run_crucible("diagnose", str(bad))
    assert out.returncode == 2 and "lacks column(s) grad_norm" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_crucible("diagnose", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "does not exist" in out.stderr
