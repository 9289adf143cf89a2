"""Running `crucible` training as a real subprocess on a small tokenized corpus.

- `Corpus`: a tokenizer and its train/val shards (the `corpus` fixture in tests/conftest.py
  builds one from Python's docs once per session);
- `job_config`, `write_config`: a job config for the tiny preset on that corpus, and its file;
- `crucible_cmd`, `run_crucible`: the command line (torchrun for several processes) and a run of
  it from the repository root, with the torchrun environment the operator also sets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.repo import REPO

VOCAB = 2048


@dataclass(frozen=True)
class Corpus:
    tokenizer: Path
    train: Path
    val: Path
    vocab_size: int


def job_config(corpus: Corpus, out: Path, *, name: str = "t", steps: int = 20,
               batch_tokens: int = 4096, **training) -> dict:
    return {
        "name": name,
        "outputDir": str(out),
        "model": {"preset": "tiny", "vocabSize": corpus.vocab_size},
        "data": {"train": str(corpus.train), "val": str(corpus.val),
                 "tokenizer": str(corpus.tokenizer)},
        "training": {"tokens": steps * batch_tokens, "globalBatchTokens": batch_tokens,
                     "microBatch": 8, "warmupSteps": 5, "lr": 3e-3, "precision": "fp32",
                     "evalTokens": 16384, **training},
        "metrics": {"port": 0},
    }


def write_config(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def crucible_cmd(*args: str, nproc: int = 1) -> list[str]:
    """The command line: torchrun for several processes, the plain CLI for one."""
    if nproc == 1:
        return [sys.executable, "-m", "crucible.trainer", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "crucible.trainer", *args]


def run_crucible(*args: str, nproc: int = 1, timeout: float = 300, env: dict | None = None,
                 **kw) -> subprocess.CompletedProcess:
    from crucible.api.launch import TORCHRUN_ENV

    threads = "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    env = {**os.environ, "OMP_NUM_THREADS": threads, **TORCHRUN_ENV, **(env or {})}
    return subprocess.run(crucible_cmd(*args, nproc=nproc), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env, **kw)


# What libstdc++ prints when a thread of torch's profiler (kineto) ends the process; the memory
# probes measure with that profiler, and now and then one aborts so as a profiling ends (seen
# once in a full run of the suite; pytorch/kineto issues 1029 and 1051 are of its kind).
PROFILER_ABORT = "terminate called without an active exception"


def run_probe(module: str, work: Path, nproc: int = 2) -> None:
    """`python -m <module> <work>` under torchrun on `nproc` ranks, one thread each (a test
    probe that writes its results under `work`); fails the test with its stderr's tail. Run
    once more, and only once, after the profiler's own abort."""
    from crucible.api.launch import TORCHRUN_ENV

    for attempt in (1, 2):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", "-m", module, str(work)],
                             capture_output=True, text=True, timeout=600, cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **TORCHRUN_ENV})
        if run.returncode == 0 or PROFILER_ABORT not in run.stderr:
            break
    assert run.returncode == 0, f"attempt {attempt}: {run.stderr[-3000:]}"
