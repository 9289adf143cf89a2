"""In-memory checkpoints with peer copies (CPU, `tiny`, torchrun, the stack's real S3 server).

Two torchrun agents on loopback stand for two nodes, each with a memory folder of its own (the
pod's /dev/shm). The tests kill a worker, a whole agent with its memory, and both copies, and
check where the restore read from, that storage gave 0 bytes when memory sufficed, and what was
lost. The pure restore planner is tested on its own first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time

import pytest

from crucible.trainer.memory_checkpoint import Held, plan_restore, ring_peer
from tests.support.services import eventually
from tests.trainer.chaos import TrainProcess, config, curve, stop_and_resume, train_records
from tests.trainer.chaos import ckpt  # noqa: F401 - a fixture: pytest finds it by its name here


def _held(step, shard, *, world=2, model="m", digest=None):
    return Held(step, shard, world, model, digest or f"d{step}-{shard}")


def test_ring_peer_is_the_same_local_rank_on_the_next_node():
    assert [ring_peer(r, 8, 2) for r in range(8)] == [2, 3, 4, 5, 6, 7, 0, 1]
    assert ring_peer(0, 4, 4) is None  # one node: no peer to copy to


def test_plan_prefers_own_memory_then_peers_then_gives_up():
    # Both nodes hold both shards of step 10: each rank reads its own.
    both = [[_held(10, 0), _held(10, 1)], [_held(10, 0), _held(10, 1)]]
    plan = plan_restore(both, 2, "m")
    assert (plan.step, plan.transfers, plan.source) == (10, (), "memory")
    # Node 1 was replaced (empty): its shard comes from node 0, which kept the copy.
    replaced = [[_held(10, 0), _held(10, 1)], []]
    plan = plan_restore(replaced, 2, "m")
    assert (plan.step, plan.transfers, plan.source) == (10, ((0, 1),), "peer")
    # Both copies of shard 1 gone: no step can be restored from memory.
    assert plan_restore([[_held(10, 0)], []], 2, "m") is None


def test_plan_takes_the_newest_complete_step_within_bounds_and_ignores_misfits():
    holdings = [[_held(8, 0), _held(8, 1), _held(12, 0)],
                [_held(8, 1), _held(8, 0), _held(12, 1, digest="x"), _held(12, 0, digest="y")]]
    # Step 12's shard 0 has two copies that disagree: not trusted; step 8 is whole.
    assert plan_restore(holdings, 2, "m").step == 8
    assert plan_restore(holdings, 2, "m", min_step=9) is None   # storage holds something newer
    assert plan_restore(holdings, 2, "m", max_step=7) is None   # a rollback needs older
    assert plan_restore(holdings, 2, "other-model") is None
    assert plan_restore([[_held(8, 0, world=1)], []], 2, "m") is None  # another world size


def test_plan_restores_only_onto_the_mesh_the_snapshot_was_taken_on():
    # Rank r's shard under HSDP 2 x 2 is another slice than under FSDP over 4 ranks: the same
    # world size is not enough.
    def held(mesh):
        return [[Held(8, shard, 4, "m", f"d{shard}", mesh_shape=mesh) for shard in range(4)]] * 4

    assert plan_restore(held((2, 2)), 4, "m", mesh_shape=(2, 2)).step == 8
    assert plan_restore(held((2, 2)), 4, "m", mesh_shape=(4,)) is None
    assert plan_restore(held((4,)), 4, "m", mesh_shape=(2, 2)) is None
    # A snapshot that recorded no mesh was taken on the 1-D mesh over the world.
    assert plan_restore(held(()), 4, "m", mesh_shape=(4,)).step == 8
    assert plan_restore(held(()), 4, "m", mesh_shape=(2, 2)) is None


# --- end to end -------------------------------------------------------------------------------
def test_resume_from_memory_equals_a_straight_run(corpus, tmp_path):
    """Stop after 8 steps and resume from the in-memory snapshot: per-step losses bitwise equal
    to a straight run (the state in memory is the whole state, as in a commit)."""
    env = {"CRUCIBLE_MEMORY_DIR": str(tmp_path / "shm")}
    straight = TrainProcess(config(corpus, tmp_path, "straight", str(tmp_path / "a"), steps=16,
                                   every=8), tmp_path / "straight.log", env=env)
    assert straight.finish() == 0, straight.text()[-3000:]
    cfg = config(corpus, tmp_path, "resumed", str(tmp_path / "b"), steps=16, every=8,
                 inMemoryEverySteps=4)
    second = stop_and_resume(cfg, tmp_path, 8, env=env)
    assert "restored step 8 from memory" in second, second[-3000:]
    assert not (tmp_path / "shm" / "chaos").exists()  # a finished run frees its memory
    b = train_records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 17))
    assert curve(tmp_path / "straight" / "metrics.jsonl") == \
           curve(tmp_path / "resumed" / "metrics.jsonl")

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TwoNodes:
    """Two torchrun agents (--nnodes=2, c10d on agent a), each with its own memory folder."""

    def __init__(self, cfg, tmp_path, env):
        self.cfg, self.tmp_path, self.env = cfg, tmp_path, env
        self.port = _free_port()
        self.agents: dict[str, TrainProcess] = {}

    def memory(self, name: str):
        return self.tmp_path / f"shm-{name}"

    def start(self, name: str, host: bool) -> TrainProcess:
        self.memory(name).mkdir(exist_ok=True)
        agent = TrainProcess(self.cfg, self.tmp_path / f"{name}.log", nproc=1, env={
            **self.env, "CRUCIBLE_MEMORY_DIR": str(self.memory(name))}, torchrun_args=[
            "--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
            "--rdzv-id=memory-test", f"--rdzv-conf=is_host={str(host).lower()}",
            "--max-restarts=3", "--monitor-interval=0.5"])
        self.agents[name] = agent
        return agent

    def text(self) -> str:
        """Every agent's output (rank 0, which logs, may be on any of them)."""
        return "\n".join(agent.text() for agent in self.agents.values())

    def close(self):
        for agent in self.agents.values():
            agent.close()


def _records(tmp_path, name="mem"):
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _wait_step(tmp_path, step: int, timeout_s: float = 180):
    jsonl = tmp_path / "mem" / "metrics.jsonl"
    eventually(lambda: jsonl.exists() and any(r["step"] >= step for r in train_records(jsonl)),
               timeout_s, f"step {step}", interval_s=0.1)


def _restores(tmp_path) -> list[dict]:
    return [r for r in _records(tmp_path) if r["kind"] == "restore"]


def _after(tmp_path, t: float) -> list[dict]:
    return [r for r in train_records(tmp_path / "mem" / "metrics.jsonl") if r["time"] > t]


EVERY = 2       # in-memory snapshot interval (steps)
S3_EVERY = 40   # persistent saves, rare: a restore from S3 would go back far


@pytest.fixture
def nodes(corpus, tmp_path, ckpt):
    uri, env = ckpt
    cfg = config(corpus, tmp_path, "mem", uri, steps=400, every=S3_EVERY,
                 inMemoryEverySteps=EVERY)
    two = TwoNodes(cfg, tmp_path, env)
    yield two
    two.close()


def _last_step_before(tmp_path, t: float) -> int:
    return max(r["step"] for r in train_records(tmp_path / "mem" / "metrics.jsonl")
               if r["time"] <= t)


@pytest.mark.stack
def test_sigkill_of_a_worker_restores_from_its_own_memory_without_storage(nodes, tmp_path):
    nodes.start("a", host=True)
    b = nodes.start("b", host=False)
    _wait_step(tmp_path, 12)
    assert list(nodes.memory("a").rglob("rank_1.pt")), "node a keeps a copy of rank 1's shard"
    victim = b.workers()[0]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    eventually(lambda: _restores(tmp_path), 120, "a restore record")
    restore = _restores(tmp_path)[-1]
    assert restore["source"] == "memory", nodes.text()[-3000:]
    first = eventually(lambda: _after(tmp_path, killed_at), 60, "a step after the kill")[0]
    lost = _last_step_before(tmp_path, killed_at) - restore["step"]
    assert first["step"] == restore["step"] + 1
    assert 0 <= lost <= EVERY + 1  # at most one snapshot interval (+ the step in flight)
    log = nodes.text()
    assert re.search(r"restored step \d+ from memory .* 0 from storage", log), log[-3000:]
    assert "restore of s3://" not in log  # nothing fetched from S3 (it logs every fetch)
    print(f"SIGKILL -> first step {first['time'] - killed_at:.1f}s, restore "
          f"{restore['seconds']:.2f}s from memory, steps lost {lost}")
    # How fast is a benchmark's question (bench/checkpoint_bench.py); here only *what* ended the
    # old group: torchrun's monitor, not the process group's 600 s collective timeout.
    assert first["time"] - killed_at < 300, "the restart waited on a collective timeout"


@pytest.mark.stack
def test_a_lost_node_comes_back_from_its_peers_copy_and_both_copies_lost_fall_back_to_s3(
        nodes, tmp_path):
    nodes.start("a", host=True)
    b = nodes.start("b", host=False)
    _wait_step(tmp_path, 12)
    b.kill_group()                          # the node dies...
    shutil.rmtree(nodes.memory("b"))        # ...and its memory with it
    killed_at = time.time()
    nodes.start("b2", host=False)           # its replacement, memory empty
    eventually(lambda: [r for r in _restores(tmp_path) if r["time"] > killed_at], 180,
               "a restore after the node loss")
    restore = [r for r in _restores(tmp_path) if r["time"] > killed_at][-1]
    log = nodes.text()
    assert restore["source"] == "peer", log[-3000:]
    assert re.search(r"restored step \d+ from peer in [\d.]+s: \d+ bytes from the nodes' own "
                     r"memory, [1-9]\d* from peers, 0 from storage", log), log[-3000:]
    lost = _last_step_before(tmp_path, killed_at) - restore["step"]
    assert 0 <= lost <= EVERY + 1

    # Now both nodes lose their memory at once: only S3 is left.
    _wait_step(tmp_path, restore["step"] + 2 * S3_EVERY)
    for agent in list(nodes.agents.values()):
        agent.close()
    for name in ("a", "b2"):
        shutil.rmtree(nodes.memory(name), ignore_errors=True)
    both_at = time.time()
    nodes.port = _free_port()  # a new c10d store
    nodes.start("c", host=True), nodes.start("d", host=False)
    eventually(lambda: [r for r in _restores(tmp_path) if r["time"] > both_at], 180,
               "a restore after both copies were lost")
    restore = [r for r in _restores(tmp_path) if r["time"] > both_at][-1]
    log = nodes.agents["c"].text() + nodes.agents["d"].text()
    assert restore["source"] == "s3", log[-3000:]
    assert "restore of s3://" in log  # shards were fetched from storage this time
    assert restore["step"] % S3_EVERY == 0


def test_a_guard_rollback_restores_an_older_snapshot_from_memory(corpus, tmp_path):
    """One update at 100x LR: the guard rolls back to a step at least rollbackMarginSteps before
    the spike. Snapshots every 2 steps (4 kept) are newer than any commit (every 20) that old, so
    the rollback reads memory, and the commits after the restored step are discarded."""
    from tests.support.training import job_config, run_crucible, write_config

    guard = {"minHistory": 16, "recoverSteps": 10, "rollbackMarginSteps": 3, "cooldownSteps": 20}
    cfg = job_config(corpus, tmp_path / "rb", name="rb", steps=70, evalTokens=4096)
    cfg["checkpoint"] = {"uri": str(tmp_path / "ckpt"), "everySteps": 20, "everyMinutes": 0,
                         "inMemoryEverySteps": 2, "inMemoryKeep": 4}
    cfg["faultTolerance"] = {"spikeGuard": guard}
    run = run_crucible("train", "--config", str(write_config(cfg, tmp_path / "rb.yaml")),
                       env={"CRUCIBLE_INJECT": "lr_x100@50",
                            "CRUCIBLE_MEMORY_DIR": str(tmp_path / "shm")})
    assert run.returncode == 0, run.stderr[-3000:]
    records = _records(tmp_path, "rb")
    verdict = next(r for r in records if r["kind"] == "guard" and r["verdict"] == "rollback")
    (back,) = [r for r in records if r["kind"] == "rollback"]
    (restore,) = [r for r in records if r["kind"] == "restore"]
    assert restore["source"] == "memory" and restore["step"] == back["to_step"]
    assert back["to_step"] <= verdict["onset"] - guard["rollbackMarginSteps"]
    assert back["to_step"] > 40 and back["to_step"] % 2 == 0   # newer than the commit at 40
    assert "restored step" in run.stdout + run.stderr


def test_an_unwritable_memory_folder_is_one_clear_line(corpus, tmp_path):
    from tests.support.training import job_config, run_crucible, write_config

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the memory folder should go")
    cfg = job_config(corpus, tmp_path / "out", name="shm", steps=4)
    cfg["checkpoint"] = {"uri": str(tmp_path / "ckpt"), "inMemoryEverySteps": 2}
    run = run_crucible("train", "--config", str(write_config(cfg, tmp_path / "c.yaml")),
                       env={"CRUCIBLE_MEMORY_DIR": str(blocker)})
    assert run.returncode != 0
    assert "CRUCIBLE_MEMORY_DIR" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
