"""Tensor and pipeline parallelism end to end on CPU: `training.parallelism` `{tensor: 2}` and
`{pipeline: 2}` train as FSDP does, and their commits resume on FSDP alone and the reverse.

Four torchrun processes (gloo) on `llama-tiny` (RMSNorm, SwiGLU, grouped-query attention, an
untied head): FSDP over 2 ranks x tensor parallel over 2, FSDP over 2 x 2 pipeline stages
(1F1B over the step's two micro-batches), against FSDP over the 4. One straight 20-step run of
each layout, committing at steps 10 and 20 (a local folder), is shared by the tests of this
module. Tensor parallelism splits each matmul's sum over two ranks and adds the halves, so its
per-step losses differ from FSDP's by rounding only; a pipeline computes what FSDP computes,
stage by stage. A commit is one set of full tensors (DCP), so any layout's step-10 commit
continues another's curve.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml

from tests.trainer.chaos import TrainProcess, config, curve, stop_and_resume, train_records

STEPS, HALF, NPROC = 20, 10, 4
TP = {"parallelism": {"tensor": 2}}
LAYOUTS = {"tp": TP, "pp": {"parallelism": {"pipeline": 2}}, "fsdp": {}}
DESCRIBED = {"tp": "FSDP over 2 rank(s) x tensor parallel over 2",
             "pp": "FSDP over 2 rank(s) x 2 pipeline stages", "fsdp": "FSDP over 4 rank(s)"}
# The acceptance bound: per step, relative, over the 20 steps (measured: identical to 4
# decimals; see the printed figure).
CURVE_RTOL = 2e-3
# The first half's gradient and update norms (measured: within 3e-6).
SUMS_RTOL = 5e-5
# A commit loaded into the other layout: the weights are bit for bit the same, so the next
# step's loss differs only by the order the two layouts sum each matmul in.
NEXT_STEP_RTOL = 1e-5


def _config(corpus, tmp_path, name, uri, training, preset="llama-tiny", model=None, steps=STEPS,
            every=HALF):
    path = config(corpus, tmp_path, name, uri, steps=steps, every=every, training=training)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"] = {**cfg["model"], "preset": preset, **(model or {})}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(folder, name) -> np.ndarray:
    return np.array([r["loss"] for r in train_records(folder / name / "metrics.jsonl")])


def _evals(jsonl) -> list[dict]:
    return [r for r in map(json.loads, jsonl.read_text().splitlines()) if r["kind"] == "eval"]


def _train(corpus, folder, name, training, **kw):
    run = TrainProcess(_config(corpus, folder, name, str(folder / f"{name}-ckpt"), training, **kw),
                       folder / f"{name}.log", nproc=NPROC)
    assert run.finish() == 0, run.text()[-3000:]
    return run.text()


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The straight runs of every layout, each in a folder named after it: their folder."""
    folder = tmp_path_factory.mktemp("layouts")
    for name, training in LAYOUTS.items():
        log = _train(corpus, folder, name, training)
        assert DESCRIBED[name] in log, log[-3000:]
    return folder


@pytest.mark.parametrize("name", ["tp", "pp"])
def test_a_model_parallel_layout_follows_fsdp_step_by_step(straight, name):
    ours, fsdp = _losses(straight, name), _losses(straight, "fsdp")
    assert len(ours) == len(fsdp) == STEPS
    relative = float(np.max(np.abs(ours - fsdp) / fsdp))
    print(f"llama-tiny, {DESCRIBED[name]} vs FSDP over 4: max relative loss difference over "
          f"{STEPS} steps {relative:.2e}")
    assert relative <= CURVE_RTOL
    assert ours[-1] < ours[0] - 1  # it learned: the comparison is not of two flat lines
    # The step's other sums: the gradient norm over every stage and shard, and the AdamW update
    # norm, where a norm weight that every tensor-parallel rank holds counts once (counted twice
    # it was 4e-4 high from the first step). Over the first half: later the two runs' rounding
    # has grown enough for a gradient norm to differ by 5e-3 while the losses agree to 5e-6.
    for metric in ("grad_norm", "update_norm"):
        mine, theirs = (np.array([r[metric] for r in train_records(straight / run / "metrics.jsonl")
                                  ][:HALF]) for run in (name, "fsdp"))
        np.testing.assert_allclose(mine, theirs, rtol=SUMS_RTOL, err_msg=metric)
    # The held-out eval runs through the layout too (a pipeline's loss is on its last stage).
    evals, fsdp_evals = (_evals(straight / run / "metrics.jsonl") for run in (name, "fsdp"))
    assert evals and abs(evals[-1]["loss"] - fsdp_evals[-1]["loss"]) <= CURVE_RTOL * \
        fsdp_evals[-1]["loss"]
    assert evals[-1]["tokens"] == fsdp_evals[-1]["tokens"]  # counted once, not per stage or rank


@pytest.mark.parametrize("source, target", [("tp", "fsdp"), ("fsdp", "tp"), ("pp", "fsdp"),
                                            ("fsdp", "pp")])
def test_a_commit_resumes_in_the_other_layout(straight, corpus, tmp_path, source, target):
    shutil.copytree(straight / f"{source}-ckpt" / "step_10", tmp_path / "ckpt" / "step_10")
    run = TrainProcess(_config(corpus, tmp_path, target, str(tmp_path / "ckpt"), LAYOUTS[target],
                               every=STEPS),
                       tmp_path / f"{target}.log", nproc=NPROC)
    assert run.finish() == 0, run.text()[-3000:]
    assert "(step 10, saved by 4 ranks, now 4)" in run.text(), run.text()[-3000:]
    resumed = _losses(tmp_path, target)
    assert [r["step"] for r in train_records(tmp_path / target / "metrics.jsonl")] == \
        list(range(HALF + 1, STEPS + 1))
    before = _losses(straight, source)[HALF:]
    print(f"{source} step 10 -> {target}: step 11 loss {resumed[0]:.7f} vs {before[0]:.7f} "
          f"({abs(resumed[0] - before[0]) / before[0]:.1e} relative)")
    assert abs(resumed[0] - before[0]) <= NEXT_STEP_RTOL * before[0]
    np.testing.assert_allclose(resumed, before, rtol=CURVE_RTOL)


@pytest.mark.parametrize("name, tier", [("tp", "storage"), ("tp", "memory"), ("pp", "storage"),
                                        ("pp", "memory")])
def test_a_model_parallel_run_stopped_and_resumed_continues_its_curve_exactly(
        straight, corpus, tmp_path, name, tier):
    memory = {"inMemoryEverySteps": 5} if tier == "memory" else {}
    cfg = config(corpus, tmp_path, "resumed", str(tmp_path / "ckpt"), steps=STEPS, every=HALF,
                 training=LAYOUTS[name], **memory)
    doc = yaml.safe_load(cfg.read_text())
    doc["model"]["preset"] = "llama-tiny"
    cfg.write_text(yaml.safe_dump(doc))
    second = stop_and_resume(cfg, tmp_path, HALF, nproc=NPROC,
                             env={"CRUCIBLE_MEMORY_DIR": str(tmp_path / "shm")})
    where = "restored step 10 from memory" if tier == "memory" else "(step 10, saved by 4 ranks"
    assert where in second, second[-3000:]
    assert curve(straight / name / "metrics.jsonl") == curve(tmp_path / "resumed" / "metrics.jsonl")


def test_gpt_blocks_with_a_tied_head_learned_positions_biases_and_qk_norm(corpus, tmp_path):
    # The GPT side of the plan: the head shares the embedding's vocabulary rows, positions are
    # looked up row-wise too, the per-head norms see their rank's heads only.
    gpt = {"qkNorm": True, "position": "learned", "bias": True}
    for name, training in (("tp", TP), ("fsdp", {})):
        _train(corpus, tmp_path, name, training, preset="tiny", model=gpt, steps=4, every=4)
    tp, fsdp = _losses(tmp_path, "tp"), _losses(tmp_path, "fsdp")
    assert len(tp) == 4
    np.testing.assert_allclose(tp, fsdp, rtol=CURVE_RTOL)


def test_tensor_and_pipeline_together(corpus, tmp_path):
    # 2 stages of 2 tensor-parallel ranks (one data-parallel rank): the stages pass each other
    # one tensor-parallel rank's slice of the sequence.
    both = {"parallelism": {"tensor": 2, "pipeline": 2}}
    for name, training in (("both", both), ("fsdp", {})):
        _train(corpus, tmp_path, name, training, steps=4, every=4)
    np.testing.assert_allclose(_losses(tmp_path, "both"), _losses(tmp_path, "fsdp"),
                               rtol=CURVE_RTOL)


INTERLEAVED = {"parallelism": {"pipeline": 2, "schedule": "interleaved1F1B", "virtualStages": 2}}


def test_interleaved_1f1b_follows_fsdp_and_its_commit_resumes_on_fsdp(corpus, tmp_path):
    # llama-tiny with 4 layers: 2 pipeline ranks of 2 stages each (rank 0 holds layers 0 and
    # 2, rank 1 layers 1 and 3, the activations going round the ranks twice), FSDP over 2.
    four = {"layers": 4}
    log = _train(corpus, tmp_path, "interleaved", INTERLEAVED, model=four, steps=8, every=4)
    assert "FSDP over 2 rank(s) x 2 pipeline stages" in log, log[-3000:]
    assert "interleaved1F1B, 4 stages on 2 ranks; this rank holds stage(s) 0, 2, layers 0, 2" \
        in log, log[-3000:]
    _train(corpus, tmp_path, "fsdp", {}, model=four, steps=8, every=8)
    ours, fsdp = _losses(tmp_path, "interleaved"), _losses(tmp_path, "fsdp")
    assert len(ours) == len(fsdp) == 8
    print(f"llama-tiny 4 layers, interleaved 1F1B (2 x 2 stages) vs FSDP over 4: max relative "
          f"loss difference over 8 steps {float(np.max(np.abs(ours - fsdp) / fsdp)):.2e}")
    np.testing.assert_allclose(ours, fsdp, rtol=CURVE_RTOL)
    # The held-out eval passes activations round the ranks too: the same loss as FSDP's.
    evals = [r["loss"] for r in _evals(tmp_path / "interleaved" / "metrics.jsonl")]
    assert evals and np.allclose(evals, [r["loss"] for r in _evals(tmp_path / "fsdp" /
                                                                   "metrics.jsonl")],
                                 rtol=CURVE_RTOL), evals
    # Its step-4 commit, on FSDP alone: the next step is the interleaved run's step 5.
    shutil.copytree(tmp_path / "interleaved-ckpt" / "step_4", tmp_path / "ckpt" / "step_4")
    (tmp_path / "resumed").mkdir()
    run = TrainProcess(_config(corpus, tmp_path / "resumed", "fsdp", str(tmp_path / "ckpt"), {},
                               model=four, steps=8, every=8),
                       tmp_path / "resumed.log", nproc=NPROC)
    assert run.finish() == 0, run.text()[-3000:]
    assert "(step 4, saved by 4 ranks, now 4)" in run.text(), run.text()[-3000:]
    resumed = _losses(tmp_path / "resumed", "fsdp")
    print(f"interleaved step 4 -> FSDP: step 5 loss {resumed[0]:.7f} vs {ours[4]:.7f}")
    assert abs(resumed[0] - ours[4]) <= NEXT_STEP_RTOL * ours[4], (resumed[0], ours[4])
    # Stopped at step 4 and resumed from the in-memory tier: its own curve, bit for bit.
    cfg = _config(corpus, tmp_path / "resumed", "stopped", str(tmp_path / "stopped-ckpt"),
                  INTERLEAVED, model=four, steps=8, every=4)
    doc = yaml.safe_load(cfg.read_text())
    doc["checkpoint"]["inMemoryEverySteps"] = 2
    cfg.write_text(yaml.safe_dump(doc))
    second = stop_and_resume(cfg, tmp_path / "resumed", 4, nproc=NPROC,
                             env={"CRUCIBLE_MEMORY_DIR": str(tmp_path / "shm")})
    assert "restored step 4 from memory" in second, second[-3000:]
    assert curve(tmp_path / "interleaved" / "metrics.jsonl") == \
        curve(tmp_path / "resumed" / "stopped" / "metrics.jsonl")
