"""The planner's per-GPU estimate against the allocator's fullest point in a whole training
step of the trainer's own, per layout, on CPU (tests/trainer/step_memory_probe.py, two gloo
ranks): what the model states, FSDP's gathered parameters and whole gradients, the activations
a layout keeps, the pipeline's schedule and the loss add up to, at the moment they do.

The parts are measured alone, each within 5% (test_activation_memory.py,
test_model_parallel_memory.py); this holds their sum, at most 10% under (what would run out of
memory) and 15% over: at these four-block models what the estimate does not count, or counts
whole for longer than it lives, weighs more than at a real one. Measured: FSDP 1% under,
tensor parallelism 2% over; the pipelines 1% to 5% over, 10% under full recomputation (its
recomputed block is counted whole for the span of a backward).
"""

from __future__ import annotations

import json

import pytest

from crucible.trainer.plan import memory as mem
from tests.support.training import run_probe
from tests.trainer.step_memory_probe import BATCH, CASES, config

UNDER, OVER = 0.10, 0.15


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    work = tmp_path_factory.mktemp("step_memory")
    run_probe("tests.trainer.step_memory_probe", work)
    ranks = [json.loads((work / f"step_memory.{rank}.json").read_text()) for rank in (0, 1)]
    # The fuller rank (the estimate is of the fullest GPU), at the least of its steps' peaks
    # (the probe's docstring says why).
    return {name: max(rank[name]["before"] + min(rank[name]["peaks"]) for rank in ranks)
            for name in CASES}


def _estimate(name: str) -> mem.MemoryEstimate:
    spec, recompute, kind, micro_batches = CASES[name]
    tp, pp = spec.get("tensor", 1), spec.get("pipeline", 1)
    return mem.estimate(config(kind), micro_batch=BATCH, capacity_bytes=1e12, stage=3,
                        dp=2 // (tp * pp), tp=tp, pp=pp, recompute=recompute,
                        precision=mem.PRECISIONS["bf16"], flash_attention=True,
                        microbatches=micro_batches,
                        virtual_stages=spec.get("virtual_stages", 1),
                        schedule=spec.get("schedule", "1F1B"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_whole_steps_fullest_point_is_the_estimate(measured, name):
    """Under a pipeline this holds when the stage's gradients come with its first backward:
    counted through the whole step, beside every micro-batch in flight, "pipeline" is 19%
    over."""
    assert 1 - UNDER < _estimate(name).total_bytes / measured[name] < 1 + OVER
