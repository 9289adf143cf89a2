"""Run `crucible train` under torchrun in the background and break it on purpose.

A `TrainProcess` keeps the whole output in a file, can wait for a line, find the worker
processes torchrun started, and kill one of them or the whole agent (its process group).
`ckpt` (a fixture), `config` and `objects`: a fresh checkpoint prefix on the stack's S3, a job
config that checkpoints there, and what is stored under it; shared by the checkpoint tests."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from crucible.api.launch import TORCHRUN_ENV
from tests.support.repo import REPO
from tests.support.services import eventually
from tests.support.training import crucible_cmd, job_config, write_config

BATCH = 4096  # tokens per step: 32 sequences of 128


@pytest.fixture
def ckpt(s3):
    """A fresh checkpoint prefix in the stack's bucket, and the env that reaches it."""
    uri = f"s3://{s3.bucket}/chaos/{secrets.token_hex(4)}"
    env = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": s3.access_key,
           "AWS_SECRET_ACCESS_KEY": s3.secret_key, "AWS_DEFAULT_REGION": s3.region}
    return uri, env


def config(corpus, tmp_path, name: str, uri: str, steps: int, every: int = 4,
           training: dict | None = None, **checkpoint):
    cfg = job_config(corpus, tmp_path / name, name="chaos", steps=steps, batch_tokens=BATCH,
                     evalTokens=4096, **(training or {}))
    cfg["checkpoint"] = {"uri": uri, "everySteps": every, "everyMinutes": 0, "keep": 3, **checkpoint}
    return write_config(cfg, tmp_path / f"{name}.yaml")


def objects(s3, uri: str) -> set[str]:
    bucket, _, prefix = uri[5:].partition("/")
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])}


class TrainProcess:
    def __init__(self, config: Path, log: Path, *, nproc: int = 2, env: dict | None = None,
                 torchrun_args: list[str] | None = None, extra_args: list[str] | None = None):
        import sys

        self.log_path = log
        if torchrun_args is None:
            cmd = crucible_cmd("train", "--config", str(config), *(extra_args or []), nproc=nproc)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
                   f"--nproc-per-node={nproc}", "-m", "crucible.trainer", "train",
                   "--config", str(config), *(extra_args or [])]
        self.out = open(log, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", **TORCHRUN_ENV, **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # own process group: kill -PGID

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 120) -> re.Match:
        def seen():
            if self.proc.poll() is not None and not re.search(pattern, self.text()):
                raise AssertionError(f"exited ({self.proc.returncode}) before /{pattern}/:\n"
                                     + self.text()[-3000:])
            return re.search(pattern, self.text())

        return eventually(seen, timeout_s, f"/{pattern}/ in {self.log_path.name}")

    def workers(self) -> list[int]:
        """Pids of the trainer processes under this torchrun agent."""
        from crucible.trainer.commands.demo import torchrun_workers

        return torchrun_workers(self.proc.pid)

    def kill_group(self) -> None:
        """SIGKILL the agent and its workers, as a node dying would. torchrun starts each worker
        in a session of its own, so the agent's process group alone would leave them running."""
        for pid in self.workers():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def finish(self, timeout_s: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.out.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill_group()
        self.out.close()


def train_records(jsonl: Path) -> list[dict]:
    return [r for r in (json.loads(l) for l in jsonl.read_text().splitlines() if l.strip())
            if r["kind"] == "train"]


def now() -> float:
    return time.monotonic()


def curve(jsonl: Path) -> list[tuple]:
    """Each step's (loss, gradient norm, LR): what an exact resume reproduces bit for bit (fp32
    on CPU with the same world size, mesh and seeds is deterministic)."""
    return [(r["loss"], r["grad_norm"], r["lr"]) for r in train_records(jsonl)]


def stop_and_resume(cfg: Path, tmp_path: Path, steps: int, *, nproc: int = 2,
                    env: dict | None = None) -> str:
    """Train `cfg` for `steps` steps and stop, then start it again to its end; the output of the
    second start (which says where it resumed from)."""
    first = TrainProcess(cfg, tmp_path / "first.log", nproc=nproc, env=env,
                         extra_args=["--max-steps", str(steps)])
    assert first.finish() == 0, first.text()[-3000:]
    second = TrainProcess(cfg, tmp_path / "second.log", nproc=nproc, env=env)
    assert second.finish() == 0, second.text()[-3000:]
    return second.text()
