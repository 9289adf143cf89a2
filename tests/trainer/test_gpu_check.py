"""`bench/gpu_check.py`, the one-script check of the GPU path, runs every stage on gloo here.

On a GPU it trains on NCCL; here `--cpu` runs the same stages (train, SIGKILL mid-save, resume
from the last commit, a guard rollback after an injected bad update, eval, a worker killed and
restored from in-memory snapshots), so the script a GPU
session relies on is known to work before one is lent. Without `--cpu` and without CUDA it must
stop after preparing the data and say why, with exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.repo import REPO


def test_every_stage_passes_on_gloo(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--cpu",
                          "--keep", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for stage in ("data", "train", "kill", "resume", "rollback", "eval", "memory"):
        assert f"PASS  {stage}" in run.stdout, run.stdout
    assert "PASS: 7/7 stages" in run.stdout


def test_without_cuda_it_stops_where_cuda_is_required(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--keep",
                          str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "PASS  data" in run.stdout and "CUDA is required from here" in run.stdout
