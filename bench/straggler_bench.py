"""Straggler detection on CPU: the delay to flag a rank made slower, and false alarms over a long
healthy run, with `tiny` on 2 processes under torchrun (the defaults: factor 1.2, window 30,
patience 10).

  python bench/straggler_bench.py [--healthy-steps 2000] [--slow-steps 120] [--slowdown 1.3]
                                  [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def corpus(work: Path) -> tuple[Path, Path]:
    import pydoc_data.topics as topics

    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.encode import encode_to_shards

    docs = [topics.topics[k] for k in sorted(topics.topics)]
    tok = train_bpe(docs, 2048, work / "tok.json")
    encode_to_shards(tok, docs, work / "shards", val_fraction=0.1)
    return tok, work / "shards"


def train(work: Path, name: str, steps: int, env_extra: dict) -> list[dict]:
    import yaml

    from crucible.api.launch import TORCHRUN_ENV

    cfg = {"name": name, "outputDir": str(work / name),
           "model": {"preset": "tiny", "vocabSize": 2048},
           "data": {"train": str(work / "shards" / "train"), "val": str(work / "shards" / "val")},
           "training": {"tokens": steps * 4096, "globalBatchTokens": 4096, "microBatch": 8,
                        "precision": "fp32", "warmupSteps": 5, "evalTokens": 4096,
                        "logEvery": 100},
           # Stragglers only: the tiny model overfits pydoc within ~1,400 steps, and the stability
           # guard would stop a run without checkpoints at that (slow divergence).
           "faultTolerance": {"spikeGuard": {"enabled": False}},
           "metrics": {"port": 0}}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    started = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        code = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "-m", "crucible.trainer", "train", "--config", str(work / f"{name}.yaml")],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **TORCHRUN_ENV, **env_extra, "OMP_NUM_THREADS": "1"}).returncode
    if code != 0:
        raise SystemExit((work / f"{name}.log").read_text()[-3000:])
    print(f"  {name}: {steps} steps in {time.perf_counter() - started:.0f} s", flush=True)
    return [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--healthy-steps", type=int, default=2000)
    p.add_argument("--slow-steps", type=int, default=120)
    p.add_argument("--slowdown", type=float, default=1.3)
    p.add_argument("--runs", type=int, default=3, help="slowed runs (detection delay spread)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "straggler_bench.json"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus(work)
        delays = []
        for run in range(a.runs):
            records = train(work, f"slow{run}", a.slow_steps,
                            {"CRUCIBLE_SLOW_RANK": f"1:{a.slowdown}"})
            flagged = [r for r in records if r["kind"] == "straggler" and r["flagged"]]
            delays.append(flagged[0]["step"] if flagged and flagged[0]["rank"] == 1 else None)
        healthy = train(work, "healthy", a.healthy_steps, {})
        false = [r for r in healthy if r["kind"] == "straggler" and r["flagged"]]
    result = {"slowdown": a.slowdown, "detected_at_step": delays,
              "healthy_steps": a.healthy_steps, "false_alarms": len(false),
              "false_alarm_steps": [r["step"] for r in false]}
    Path(a.out).write_text(json.dumps(result, indent=1))
    # The detector judges once its window is full (30 steps) and flags after patience (10)
    # judgements in a row: step 30 + 10 - 1 = 39 is the earliest a slow-from-the-start rank
    # can be flagged.
    print(f"rank 1 made {a.slowdown}x slower: flagged at step {delays} (39 at the earliest)")
    print(f"healthy: {len(false)} false alarm(s) in {a.healthy_steps} steps")


if __name__ == "__main__":
    main()
