"""`bench/gpu_mfu.py` drives the real training step and reads its figures from the run's own
metrics; here `--cpu` runs it on gloo with llama-tiny, so the script a GPU session relies on is
known to work before one is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.repo import REPO


def test_cpu_run_reports_the_trainers_own_step_figures(tmp_path):
    out = tmp_path / "mfu.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_mfu.py"), "--cpu",
                          "--steps", "3", "--warmup", "1", "--micro-batch", "2", "--json",
                          str(out), "--keep", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert r["model"] == "llama-tiny" and r["steps"] == 3 and r["tokens_per_step"] == 2 * 128
    # The step went through the trainer: its metrics file is where the figures came from.
    records = [json.loads(line) for line in
               (tmp_path / "work" / "llama-tiny" / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in records if x["kind"] == "train"]
    assert [x["step"] for x in trained] == [1, 2, 3, 4]
    assert r["tokens_per_s"] == sorted(x["tokens_per_second"] for x in trained[1:])[1]
    assert 0 < r["mfu_trainer"] <= 1
    assert r["mfu_measured_peak"] == pytest.approx(
        r["tokens_per_s"] * r["flops_per_token"] / report["peak_flops"])


def test_without_cuda_it_says_so_and_measures_nothing(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_mfu.py")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0 and "no CUDA GPU" in run.stdout


def test_the_micro_batch_is_the_largest_the_planner_fits_on_the_device():
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_mfu import fitting_micro_batch

    from crucible.api import arch
    from crucible.trainer.plan import memory as mem

    h200 = 141e9
    for model in ("gpt2-124m", "llama-1b"):
        cfg = arch.preset(model)
        b = fitting_micro_batch(cfg, 1, h200)

        def fits(n):
            return mem.estimate(cfg, micro_batch=n, capacity_bytes=h200, stage=3, dp=1,
                                flash_attention=True, compiled=True).fits

        assert fits(b) and (b == 64 or not fits(2 * b)), (model, b)
    # The old fixed default (8 x 8,192 tokens) does not fit llama-1b on one H200 by that count;
    # GPT-2 small gets a large micro-batch, as MFU wants.
    assert fitting_micro_batch(arch.preset("llama-1b"), 1, h200) < 8
    assert fitting_micro_batch(arch.preset("gpt2-124m"), 1, h200) >= 32
