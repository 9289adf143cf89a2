"""The GPU path end to end, in one short run: NCCL training, save, SIGKILL, resume, rollback, eval.

Every trainer test runs on gloo; this script runs the same stages where users run them, on CUDA
with NCCL (one process per GPU, at most 2), and prints PASS or FAIL per stage with the losses:

  data      a BPE tokenizer and shards from Python's own reference docs (CPU)
  train     30 steps, a commit every 10 steps
  kill      the run goes on with its next save held back; SIGKILL while it is in flight
  resume    from the last commit (step 30), with one update at 100x LR injected at step 45:
            the stability guard must roll back to an earlier commit and the run must finish
  eval      `crucible eval` scores the newest commit on held-out text
  memory    a fresh run with in-memory snapshots every 2 steps: one worker is SIGKILLed, torchrun
            restarts the workers and they must restore from host memory, not storage

On a machine without CUDA it prepares the data, says where CUDA is required, and stops (exit 0).
`--cpu` runs every stage on CPU with gloo instead, to check the script itself.

  python bench/gpu_check.py [--cpu] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

STEPS, FIRST_STOP, EVERY, BAD_LR_STEP = 60, 30, 10, 45
GUARD = {"minHistory": 16, "recoverSteps": 10, "rollbackMarginSteps": 5, "cooldownSteps": 20}


def prepare_data(root: Path) -> dict:
    import pydoc_data.topics as topics

    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.encode import encode_to_shards

    docs = [topics.topics[key] for key in sorted(topics.topics)]
    tok = train_bpe(docs, 2048, root / "tokenizer.json")
    encode_to_shards(tok, docs, root / "shards", val_fraction=0.1, seed=0)
    return {"train": str(root / "shards" / "train"), "val": str(root / "shards" / "val"),
            "tokenizer": str(tok)}


def write_config(root: Path, data: dict, nproc: int, cpu: bool, name: str = "gpu-check",
                 in_memory_every: int = 0) -> Path:
    cfg = {"name": name, "outputDir": str(root / name),
           "model": {"preset": "tiny", "vocabSize": 2048}, "data": data,
           "training": {"tokens": STEPS * 8 * 128 * nproc, "globalBatchTokens": 8 * 128 * nproc,
                        "microBatch": 8, "warmupSteps": 5, "lr": 3e-3,
                        "precision": "fp32" if cpu else "bf16", "evalTokens": 8192},
           "checkpoint": {"uri": str(root / name / "ckpt"), "everySteps": EVERY,
                          "everyMinutes": 0, "keep": 4, "keepEvery": EVERY,
                          "inMemoryEverySteps": in_memory_every},
           "faultTolerance": {"spikeGuard": GUARD}, "metrics": {"port": 0}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_cmd(config: Path, nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "crucible.trainer", "train", "--config",
            str(config), *extra]


def records(root: Path, kind: str, name: str = "gpu-check") -> list[dict]:
    path = root / name / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step_"))
                  for p in (root / "gpu-check" / "ckpt").glob("step_*/manifest.json"))


def _alive(pids: list[int], wait_s: float = 10) -> list[int]:
    """Those of `pids` still running after up to `wait_s` (a zombie counts as gone)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                left.append(pid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run every stage on CPU with gloo")
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temp folder)")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="crucible-gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    results: list[tuple[str, bool, str]] = []

    def stage(name: str, ok: bool, detail: str) -> bool:
        results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name:<7} {detail}", flush=True)
        return ok

    data = prepare_data(root)
    stage("data", True, f"shards under {root / 'shards'}")
    import torch

    from crucible.trainer.commands.demo import kill_a_worker_after, torchrun_workers

    if not args.cpu and not torch.cuda.is_available():
        print("CUDA is required from here (NCCL training, save, SIGKILL, resume, rollback, "
              "eval): no CUDA device on this machine, stopping. `--cpu` runs the stages on gloo.")
        return 0
    nproc = 2 if args.cpu else max(1, min(2, torch.cuda.device_count()))
    device = "cpu (gloo)" if args.cpu else f"{torch.cuda.get_device_name(0)} x{nproc} (NCCL)"
    print(f"device: {device}; torch {torch.__version__}", flush=True)
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    config = write_config(root, data, nproc, args.cpu)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)

    # train: the first 30 steps, commits at 10, 20, 30.
    run = subprocess.run(train_cmd(config, nproc, "--max-steps", str(FIRST_STOP)), env=env,
                         capture_output=True, text=True, timeout=900)
    (logs / "train.log").write_text(run.stdout + run.stderr)
    losses = [round(r["loss"], 3) for r in records(root, "train")]
    if not stage("train", run.returncode == 0 and committed(root)[-1:] == [FIRST_STOP],
                 f"exit {run.returncode}, commits {committed(root)}, loss {losses[:1]} -> "
                 f"{losses[-1:]}"):
        return report(results, root)

    # kill: the next save (step 40) is held back before its upload; SIGKILL while it waits.
    with open(logs / "kill.log", "w") as out:
        proc = subprocess.Popen(train_cmd(config, nproc), env={
            **env, "CRUCIBLE_FAILPOINT": "before_upload:600"}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None and not any(
                r["step"] > FIRST_STOP + EVERY for r in records(root, "train")):
            time.sleep(0.2)
        # As a node dying would: the agent and its workers (each in a session of its own; one
        # left behind would finish the held-back save while the next stages run).
        workers = torchrun_workers(proc.pid)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = _alive(workers)
    stage("kill", committed(root)[-1:] == [FIRST_STOP] and len(workers) == nproc and not left,
          f"SIGKILL after step {max(r['step'] for r in records(root, 'train'))} to the agent "
          f"and {len(workers)} workers ({len(left)} still alive), newest commit still "
          f"{committed(root)[-1:]}")

    # resume: from step 30, with one bad update the guard must roll back.
    run = subprocess.run(train_cmd(config, nproc), env={
        **env, "CRUCIBLE_INJECT": f"lr_x100@{BAD_LR_STEP}"}, capture_output=True, text=True,
        timeout=900)
    text = run.stdout + run.stderr
    (logs / "resume.log").write_text(text)
    rollbacks = [r for r in records(root, "guard") if r["verdict"] == "rollback"]
    final = [r for r in records(root, "train") if r["step"] == STEPS]
    stage("resume", run.returncode == 0 and f"(step {FIRST_STOP}," in text and bool(final),
          f"exit {run.returncode}, resumed from step {FIRST_STOP}: "
          f"{f'(step {FIRST_STOP},' in text}, final loss "
          f"{round(final[-1]['loss'], 3) if final else None}")
    # Each restore is reported with its source; the newest is the rollback's.
    restores = [(r["source"], r["step"]) for r in records(root, "restore")]
    to_steps = [r["to_step"] for r in records(root, "rollback")]
    stage("rollback", bool(rollbacks) and restores[-1:] == [("disk", to_steps[-1])],
          f"{len(rollbacks)} rollback(s) after the bad update at step {BAD_LR_STEP}"
          + (f", to before step {rollbacks[0]['onset']}" if rollbacks else "")
          + f"; restores (source, step) {restores}")

    # eval: the newest commit on held-out text.
    run = subprocess.run([sys.executable, "-m", "crucible.trainer", "eval", "--config",
                          str(config), "--json"], env=env, capture_output=True, text=True,
                         timeout=600)
    (logs / "eval.log").write_text(run.stdout + run.stderr)
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {}
    stage("eval", run.returncode == 0 and "loss" in result,
          f"exit {run.returncode}, held-out loss {result.get('loss')}, "
          f"{result.get('bits_per_byte')} bits/byte")

    # memory: the in-memory tier on the device (snapshot copies device to host, its own gloo
    # group beside NCCL), survived from host memory after a worker is killed at step 15.

    mem_config = write_config(root, data, nproc, args.cpu, name="memory", in_memory_every=2)
    with open(logs / "memory.log", "w") as out:
        cmd = train_cmd(mem_config, nproc)
        cmd[3:3] = ["--max-restarts=1", "--monitor-interval=0.5"]
        agent = subprocess.Popen(cmd, env={**env, "CRUCIBLE_MEMORY_DIR": str(root / "shm")},
                                 stdout=out, stderr=subprocess.STDOUT)
        killed = kill_a_worker_after(agent, root / "memory" / "metrics.jsonl", 15)
        code = agent.wait(timeout=900)
    restores = records(root, "restore", "memory")
    final = [r for r in records(root, "train", "memory") if r["step"] == STEPS]
    stage("memory", code == 0 and killed is not None and bool(final) and
          [r["source"] for r in restores] == ["memory"] and restores[0]["step"] >= 14,
          f"exit {code}, worker killed after step 15, restores "
          f"{[(r['source'], r['step'], round(r['seconds'], 2)) for r in restores]}")
    return report(results, root)


def report(results: list[tuple[str, bool, str]], root: Path) -> int:
    failed = [name for name, ok, _ in results if not ok]
    print(f"{'FAIL' if failed else 'PASS'}: {len(results) - len(failed)}/{len(results)} stages"
          + (f" (failed: {', '.join(failed)}; logs under {root / 'logs'})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
