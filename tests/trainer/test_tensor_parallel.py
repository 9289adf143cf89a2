"""Tensor parallelism end to end on CPU: `training.parallelism.tensor: 2` trains as FSDP does, and
its commits resume on FSDP alone and the reverse.

Four torchrun processes (gloo) on `llama-tiny` (RMSNorm, SwiGLU, grouped-query attention, an
untied head): FSDP over 2 ranks x tensor parallel over 2, against FSDP over the 4. One straight
20-step run of each layout, committing at steps 10 and 20 (a local folder), is shared by the
tests of this module. Tensor parallelism splits each matmul's sum over two ranks and adds the
halves, so its per-step losses differ from FSDP's by rounding only; a commit is one set of full
tensors (DCP), so either layout's step-10 commit continues the other's curve.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import yaml

from tests.trainer.chaos import TrainProcess, config, curve, stop_and_resume, train_records

STEPS, HALF, NPROC = 20, 10, 4
TP = {"parallelism": {"tensor": 2}}
# The acceptance bound: per step, relative, over the 20 steps (measured: identical to 4
# decimals; see the printed figure).
CURVE_RTOL = 2e-3
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


def _train(corpus, folder, name, training, **kw):
    run = TrainProcess(_config(corpus, folder, name, str(folder / f"{name}-ckpt"), training, **kw),
                       folder / f"{name}.log", nproc=NPROC)
    assert run.finish() == 0, run.text()[-3000:]
    return run.text()


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The two straight runs, tensor parallel ("tp") and FSDP only ("fsdp"): their folder."""
    folder = tmp_path_factory.mktemp("tp")
    log = _train(corpus, folder, "tp", TP)
    assert "FSDP over 2 rank(s) x tensor parallel over 2" in log, log[-3000:]
    assert "FSDP over 4 rank(s)" in _train(corpus, folder, "fsdp", {})
    return folder


def test_tensor_parallel_follows_fsdp_step_by_step(straight):
    tp, fsdp = _losses(straight, "tp"), _losses(straight, "fsdp")
    assert len(tp) == len(fsdp) == STEPS
    relative = float(np.max(np.abs(tp - fsdp) / fsdp))
    print(f"llama-tiny, tensor 2 x FSDP 2 vs FSDP 4: max relative loss difference over {STEPS} "
          f"steps {relative:.2e}")
    assert relative <= CURVE_RTOL
    assert tp[-1] < tp[0] - 1  # it learned: the comparison is not of two flat lines


@pytest.mark.parametrize("source, target", [("tp", "fsdp"), ("fsdp", "tp")])
def test_a_commit_resumes_in_the_other_layout(straight, corpus, tmp_path, source, target):
    shutil.copytree(straight / f"{source}-ckpt" / "step_10", tmp_path / "ckpt" / "step_10")
    run = TrainProcess(_config(corpus, tmp_path, target, str(tmp_path / "ckpt"),
                               TP if target == "tp" else {}, every=STEPS),
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


@pytest.mark.parametrize("tier", ["storage", "memory"])
def test_tensor_parallel_stopped_and_resumed_continues_its_curve_exactly(straight, corpus,
                                                                         tmp_path, tier):
    memory = {"inMemoryEverySteps": 5} if tier == "memory" else {}
    cfg = config(corpus, tmp_path, "resumed", str(tmp_path / "ckpt"), steps=STEPS, every=HALF,
                 training=TP, **memory)
    doc = yaml.safe_load(cfg.read_text())
    doc["model"]["preset"] = "llama-tiny"
    cfg.write_text(yaml.safe_dump(doc))
    second = stop_and_resume(cfg, tmp_path, HALF, nproc=NPROC,
                             env={"CRUCIBLE_MEMORY_DIR": str(tmp_path / "shm")})
    where = "restored step 10 from memory" if tier == "memory" else "(step 10, saved by 4 ranks"
    assert where in second, second[-3000:]
    assert curve(straight / "tp" / "metrics.jsonl") == curve(tmp_path / "resumed" / "metrics.jsonl")


def test_gpt_blocks_with_a_tied_head_learned_positions_biases_and_qk_norm(corpus, tmp_path):
    # The GPT side of the plan: the head shares the embedding's vocabulary rows, positions are
    # looked up row-wise too, the per-head norms see their rank's heads only.
    gpt = {"qkNorm": True, "position": "learned", "bias": True}
    for name, training in (("tp", TP), ("fsdp", {})):
        _train(corpus, tmp_path, name, training, preset="tiny", model=gpt, steps=4, every=4)
    tp, fsdp = _losses(tmp_path, "tp"), _losses(tmp_path, "fsdp")
    assert len(tp) == 4
    np.testing.assert_allclose(tp, fsdp, rtol=CURVE_RTOL)
