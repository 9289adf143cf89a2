"""The step's speed features on CPU: compiled blocks train as eager ones do, the profiler writes
its traces, garbage collection keeps its cadence, a memory snapshot on CPU says it cannot.

Two real one-process runs of `crucible train` on the tiny preset, 20 steps each, without held-out
data (an eval would compile the blocks a second time, for no-grad): one eager with the profiler,
the GC cadence and a memory snapshot switched on, one with `compile: true` (forced: on CPU the
default is off). Inductor compiles the CPU kernels with the machine's C++ compiler.
"""

from __future__ import annotations

import gc
import json

import pytest

from crucible.api.spec import ProfileSpec
from crucible.trainer.cadence import GarbageCollection, gc_due, profile_range
from tests.support.training import job_config, run_crucible, write_config

STEPS = 20


def _train(corpus, out, **training) -> tuple[list[float], str]:
    cfg = job_config(corpus, out, steps=STEPS, **training)
    del cfg["data"]["val"]
    run = run_crucible("train", "--config", str(write_config(cfg, out.with_suffix(".yaml"))),
                       timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"], run.stdout + run.stderr


@pytest.fixture(scope="module")
def eager(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eager")
    losses, log = _train(corpus, out, gcEverySteps=4, profile={"startStep": 3, "steps": 2},
                         memorySnapshotStep=5)
    return out, losses, log


def test_compiled_blocks_follow_the_eager_loss_curve(corpus, tmp_path, eager):
    _, eager_losses, eager_log = eager
    compiled_losses, log = _train(corpus, tmp_path / "compiled", compile=True)
    assert "compile: on" in log and "compile: off (training.compile unset" in eager_log
    assert len(compiled_losses) == len(eager_losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(compiled_losses, eager_losses))
    print(f"compile vs eager: largest loss difference over {STEPS} steps {worst:.2e}")
    assert worst < 1e-4
    assert compiled_losses[-1] < compiled_losses[0] - 0.5  # it trained


def test_the_profiler_writes_one_trace_of_the_steps_asked_for(eager):
    out, _, log = eager
    (trace,) = (out / "profile" / "step3-4").glob("*.json")
    assert trace.name == "rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") for e in events)  # the model's matmuls ran in it
    assert "profile: trace of steps 3-4 written" in log


def test_gc_runs_on_its_cadence_and_a_cpu_memory_snapshot_says_why_not(eager):
    out, _, log = eager
    collected = [line for line in log.splitlines() if "gc: generation-1 collection" in line]
    assert [line.split("after step ")[1].split()[0] for line in collected] == \
           ["4", "8", "12", "16", "20"]
    assert "needs a CUDA device; this run is on cpu, so nothing is recorded" in log
    assert not (out / "memory_snapshot").exists()


def test_gc_cadence_turns_automatic_collection_off_and_restores_it():
    calls = []
    assert gc.isenabled()
    collector = GarbageCollection(50, log=calls.append, collect=lambda gen: calls.append(gen))
    try:
        assert not gc.isenabled() and calls == [1]  # off, after one collection at start
        for step in range(1, 101):
            collector.after(step)
        assert calls[1::2] == [1, 1] and "after step 50" in calls[2] and "step 100" in calls[4]
    finally:
        collector.close()
    assert gc.isenabled()
    assert not any(gc_due(step, 0) for step in range(1, 200))  # 0: Python's own GC


def test_the_profiler_warms_up_one_step_before_the_range_except_at_the_start():
    assert profile_range(ProfileSpec(start_step=10, steps=3)) == (9, 10, 12)
    assert profile_range(ProfileSpec(start_step=1, steps=2)) == (1, 1, 2)
