"""Checkpoint costs on CPU: blocking time per save (async vs sync), commit and restore times for
GPT-2 124M with its AdamW state, to local disk and to the stack's S3 server; and the time from
SIGKILL of a worker to the first step after torchrun restarts it, with the steps lost.

  python bench/checkpoint_bench.py [--model gpt2-124m] [--repeats 2] [--no-s3] [--no-kill]

S3 needs `e2e/stack.sh up` (its env file is read for the endpoint and keys).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stack_env() -> dict[str, str] | None:
    out = subprocess.run([str(REPO / "e2e" / "stack.sh"), "env"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    env = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    return {"AWS_ENDPOINT_URL": env["CRUCIBLE_S3_ENDPOINT"], "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"], "AWS_DEFAULT_REGION": "us-east-1",
            "bucket": env["CRUCIBLE_S3_BUCKET"]}


def app_with_adam_state(cfg, env, mesh):
    """A sharded model after one AdamW step (so the optimizer state exists: a realistic
    checkpoint), wrapped as the trainer's AppState."""
    import torch

    from crucible.api.spec import TrainingSpec
    from crucible.trainer import optim, parallel
    from crucible.trainer.checkpoint import AppState

    model = parallel.build_sharded_model(cfg, env, mesh, precision="fp32", seed=0)
    opt = optim.build_optimizer(model, TrainingSpec(tokens=1))
    x = torch.randint(0, cfg.vocab_size, (1, 65))
    model(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    return AppState(model, opt, {})


def save_and_restore(model_name: str, uri: str, repeats: int) -> list[dict]:
    from crucible.api import arch
    from crucible.api.spec import CheckpointSpec
    from crucible.trainer import parallel
    from crucible.trainer.checkpoint import Checkpointer

    env = parallel.init_distributed()
    mesh = parallel.build_mesh(env)
    cfg = arch.preset(model_name)
    rows = []
    for mode in ("sync", "async"):
        app = app_with_adam_state(cfg, env, mesh)
        spec = CheckpointSpec(uri=f"{uri}/{mode}", keep=2, **{"async": mode == "async"})
        ckpt = Checkpointer(spec, job="bench", rank=0, world_size=1, local_rank=0,
                            model_hash="bench", config_hash="bench")
        for step in range(1, repeats + 1):
            started = time.perf_counter()
            blocking = ckpt.save(app, step, 0)
            ckpt.wait()
            rows.append({"uri": uri, "mode": mode, "blocking_s": blocking,
                         "commit_s": time.perf_counter() - started,
                         "bytes": ckpt.last_commit.bytes if ckpt.last_commit else 0})
        started = time.perf_counter()
        manifest = ckpt.load(app)
        rows[-1]["restore_s"] = time.perf_counter() - started
        assert manifest is not None and manifest["step"] == repeats
        del app
    return rows


def kill_and_resume(work: Path, extra_env: dict) -> dict:
    """Tiny model, 2 workers under torchrun --max-restarts: SIGKILL one after a commit."""
    import pydoc_data.topics as topics

    import yaml

    from crucible.api.launch import TORCHRUN_ENV
    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.encode import encode_to_shards

    docs = [topics.topics[k] for k in sorted(topics.topics)]
    tok = train_bpe(docs, 2048, work / "tok.json")
    encode_to_shards(tok, docs, work / "shards", val_fraction=0.1)
    cfg = {"name": "killbench", "outputDir": str(work / "run"),
           "model": {"preset": "tiny", "vocabSize": 2048},
           "data": {"train": str(work / "shards" / "train"), "val": str(work / "shards" / "val")},
           "training": {"tokens": 40 * 4096, "globalBatchTokens": 4096, "microBatch": 8,
                        "precision": "fp32", "warmupSteps": 5, "evalTokens": 4096},
           "checkpoint": {"uri": str(work / "ckpt"), "everySteps": 5, "everyMinutes": 0},
           "metrics": {"port": 0}}
    (work / "job.yaml").write_text(yaml.safe_dump(cfg))
    log = open(work / "kill.log", "w")
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=2", "--max-restarts=3", "--monitor-interval=0.5",
                              "-m", "crucible.trainer", "train", "--config", str(work / "job.yaml")],
                             cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, **TORCHRUN_ENV, **extra_env, "OMP_NUM_THREADS": "1"})
    jsonl = work / "run" / "metrics.jsonl"
    while not (jsonl.exists() and '"kind": "checkpoint", "step": 15' in jsonl.read_text()):
        if agent.poll() is not None:
            raise SystemExit((work / "kill.log").read_text()[-3000:])
        time.sleep(0.1)
    workers = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/status")
               if f"PPid:\t{agent.pid}\n" in p.read_text()]
    killed_at = time.time()
    os.kill(max(workers), signal.SIGKILL)
    agent.wait(timeout=600)
    records = [json.loads(l) for l in jsonl.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    after = [r for r in train if r["time"] > killed_at]
    reached = max(r["step"] for r in train if r["time"] <= killed_at)
    resumed = int(re.findall(r"\(step (\d+),", (work / "kill.log").read_text())[-1])
    return {"kill_to_step_s": after[0]["time"] - killed_at, "steps_lost": reached - resumed,
            "resumed_from": resumed, "rc": agent.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--no-kill", action="store_true")
    a = p.parse_args()
    s3 = None if a.no_s3 else stack_env()
    with tempfile.TemporaryDirectory() as tmp:
        targets = [str(Path(tmp) / "ckpt")]
        if s3:
            os.environ.update({k: v for k, v in s3.items() if k != "bucket"})
            targets.append(f"s3://{s3['bucket']}/bench/{int(time.time())}")
        rows = [r for uri in targets for r in save_and_restore(a.model, uri, a.repeats)]
        print(f"{a.model} on CPU, model + AdamW state, 1 process")
        print(f"{'target':<7}{'mode':<7}{'GB':>6}{'blocking s':>12}{'commit s':>10}{'restore s':>11}")
        for uri in targets:
            for mode in ("sync", "async"):
                sel = [r for r in rows if r["uri"] == uri and r["mode"] == mode]
                restore = next((r["restore_s"] for r in sel if "restore_s" in r), float("nan"))
                print(f"{'s3' if uri.startswith('s3://') else 'local':<7}{mode:<7}"
                      f"{sel[-1]['bytes'] / 1e9:>6.2f}{statistics.median(r['blocking_s'] for r in sel):>12.2f}"
                      f"{statistics.median(r['commit_s'] for r in sel):>10.2f}{restore:>11.2f}")
        if not a.no_kill:
            k = kill_and_resume(Path(tmp), {})
            print(f"SIGKILL of a worker (tiny, 2 procs, torchrun --max-restarts): first step after "
                  f"resume {k['kill_to_step_s']:.1f} s later, {k['steps_lost']} step(s) lost "
                  f"(resumed from step {k['resumed_from']}, exit {k['rc']})")


if __name__ == "__main__":
    main()
