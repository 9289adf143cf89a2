"""Restore times by source for GPT-2 124M with its AdamW state on CPU: each rank's own memory,
a replaced node's shards from its peer, S3 (or local disk), and a guard rollback to the
snapshot before the newest; and the in-memory snapshot's blocking and background times beside
an async S3 save's.

Two processes stand for two nodes (each its own memory folder, LOCAL_WORLD_SIZE=1), so the peer
copy really travels between them over the tier's gloo group.

  python bench/restore_bench.py [--model gpt2-124m] [--repeats 3] [--no-s3] [--out FILE.json]

It starts itself under torchrun. S3 needs `e2e/stack.sh up` (its env file is read for the
endpoint and keys); without it the storage restore reads local disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from checkpoint_bench import app_with_adam_state, stack_env  # noqa: E402 - shared with it


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from crucible.api import arch
    from crucible.api.spec import CheckpointSpec
    from crucible.trainer import parallel
    from crucible.trainer.checkpoint import Checkpointer
    from crucible.trainer.memory_checkpoint import MemoryTier

    env = parallel.init_distributed()
    mesh = parallel.build_mesh(env)
    app = app_with_adam_state(arch.preset(a.model), env, mesh)
    root = Path(a.work) / f"node{env.rank}"
    tier = MemoryTier(job="bench", rank=env.rank, world_size=env.world_size,
                      local_world_size=1, model_hash="bench", keep=2, root=str(root))
    rows: dict[str, list[float]] = {k: [] for k in (
        "snapshot_blocking_s", "snapshot_background_s", "restore_memory_s", "restore_peer_s",
        "restore_storage_s", "save_blocking_s", "save_commit_s", "rollback_memory_s")}
    spec = CheckpointSpec(uri=a.uri, keep=2, **{"async": True})
    ckpt = Checkpointer(spec, job="bench", rank=env.rank, world_size=env.world_size,
                        local_rank=0, model_hash="bench", config_hash="bench")
    for step in range(1, a.repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        rows["snapshot_blocking_s"].append(tier.snapshot(app, step))
        tier.wait()
        rows["snapshot_background_s"].append(time.perf_counter() - started
                                             - rows["snapshot_blocking_s"][-1])
        dist.barrier()
        report = tier.restore(app, mesh, env.device)
        assert report is not None and report.source == "memory", report
        rows["restore_memory_s"].append(report.seconds)
        if step > 1:
            # A guard rollback: the snapshot before the newest, as Run.rollback asks for it.
            report = tier.restore(app, mesh, env.device, max_step=step - 1)
            assert report is not None and report.step == step - 1, report
            assert report.source == "memory", report
            rows["rollback_memory_s"].append(report.seconds)
        # Node 1 replaced: its folder gone, its shard comes from node 0's copy. The folder is
        # moved aside and back afterwards, so that later rollbacks still find both nodes whole.
        dist.barrier()
        if env.rank == 1:
            (root / "bench").rename(root / "bench.away")
            (root / "bench").mkdir(parents=True)
        dist.barrier()
        report = tier.restore(app, mesh, env.device)
        assert report is not None and report.source == "peer", report
        rows["restore_peer_s"].append(report.seconds)
        dist.barrier()
        if env.rank == 1:
            shutil.rmtree(root / "bench")
            (root / "bench.away").rename(root / "bench")
        started = time.perf_counter()
        rows["save_blocking_s"].append(ckpt.save(app, step, 0))
        ckpt.wait()
        rows["save_commit_s"].append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        assert ckpt.load(app) is not None
        rows["restore_storage_s"].append(time.perf_counter() - started)
    shard_bytes = sum(p.stat().st_size for p in (root / "bench").rglob("rank_*.pt"))
    dist.barrier()
    if env.rank == 0:
        from crucible.trainer import storage

        storage.delete_tree(a.uri)  # the bench's commits: gigabytes nobody needs
    medians = {k: statistics.median(v) for k, v in rows.items()}
    all_medians = [None] * env.world_size
    dist.all_gather_object(all_medians, medians)
    if env.rank == 0:
        # What a job waits for is its slowest rank.
        result = {"model": a.model, "ranks": env.world_size, "repeats": a.repeats,
                  "storage": "s3" if a.uri.startswith("s3://") else "local disk",
                  "node_memory_bytes": shard_bytes,
                  **{k: max(m[k] for m in all_medians) for k in rows}}
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"{a.model} + AdamW on CPU, {env.world_size} ranks as 2 nodes, median of "
              f"{a.repeats}, slowest rank:")
        for key in rows:
            print(f"  {key:<24}{result[key]:8.2f} s")
        print(f"  node memory (own + peer shards, {tier.keep} newest steps): {shard_bytes / 1e9:.2f} GB")
        print(f"  storage restore / memory restore: "
              f"{result['restore_storage_s'] / result['restore_memory_s']:.1f}x, "
              f"/ peer restore: {result['restore_storage_s'] / result['restore_peer_s']:.1f}x")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--repeats", type=int, default=3, help="at least 2 (a rollback needs an "
                   "older snapshot)")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "restore_bench.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    from crucible.api.launch import TORCHRUN_ENV

    s3 = None if a.no_s3 else stack_env()
    env = {**os.environ, **TORCHRUN_ENV, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm, \
            tempfile.TemporaryDirectory() as disk:
        uri = str(Path(disk) / "ckpt")
        if s3:
            env.update({k: v for k, v in s3.items() if k != "bucket"})
            uri = f"s3://{s3['bucket']}/bench/restore-{int(time.time())}"
        # The worker passes local_world_size=1 to the tier itself (torchrun says 2): that is
        # what makes the two processes two nodes.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               __file__, "--worker", "--work", shm, "--uri", uri, "--model", a.model,
               "--repeats", str(a.repeats), "--out", a.out]
        raise SystemExit(subprocess.run(cmd, cwd=REPO, env=env).returncode)


if __name__ == "__main__":
    main()
