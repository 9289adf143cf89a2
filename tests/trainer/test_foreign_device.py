"""The foreign-device tier: the trainer's state paths with the model on a device that is not the
host's, as on a GPU, on a machine that has none.

On the CPU the compute device is the host, so a tensor on the wrong side goes unnoticed; on a GPU
it crashes (the in-memory restore once handed `torch.set_rng_state` a CUDA tensor: every restart
would have crash-looped). No GPU runs here, so tests/support/foreign_device.py stands in for one
(a mock: a dispatch mode whose tensors report another device, compute on the CPU and obey CUDA's
placement rules). The first tests check that stand-in itself; then one process runs each state
path (a training step, the in-memory snapshot and restore, a storage save, load and rollback,
eval, the export's full state, bf16 parameters under stochastic rounding, whose random bits
must be drawn by a generator of the device) with the model on it, and each test reads its path's
result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.foreign_device import FOREIGN, ForeignTensor, foreign_device, on_host
from tests.support.repo import REPO
from tests.support.training import run_probe


# --- the stand-in holds CUDA's rules (else the tier below would prove nothing) ------------------
def test_the_foreign_device_refuses_what_cuda_refuses():
    with foreign_device():
        x = torch.ones(3, device=FOREIGN)
        assert isinstance(x, ForeignTensor) and x.device == FOREIGN
        assert torch.equal(on_host(x * 2 + torch.tensor(1.0)), torch.full((3,), 3.0))  # 0-dim mixes
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(3)                       # a host tensor of 1+ dimensions does not
        with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
            torch.set_rng_state(torch.get_rng_state().to(FOREIGN))
        model = torch.nn.Linear(4, 2).to(FOREIGN)
        with pytest.raises(RuntimeError, match="same device"):
            model(torch.ones(1, 4))                 # input left on the host
        with pytest.raises(RuntimeError, match="same device"):
            torch.stack([x.sum(), torch.tensor(1.0)])   # joining takes no host scalar
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(()).add_(x.sum())           # a host tensor written from the device
        with pytest.raises(RuntimeError, match="'foreign' device type for generator"):
            torch.randint(0, 9, (3,), device=FOREIGN, generator=torch.Generator())
        with pytest.raises(RuntimeError, match="'foreign' device type for generator"):
            x.random_(0, 9, generator=torch.Generator())   # a host generator on device values
        with pytest.raises(RuntimeError, match="'cpu' device type for generator"):
            torch.randint(0, 9, (3,), generator=torch.Generator(device=FOREIGN))
        drawn = torch.randint(0, 9, (3,), device=FOREIGN,
                              generator=torch.Generator(device=FOREIGN).manual_seed(0))
        assert torch.equal(on_host(drawn), torch.randint(0, 9, (3,), generator=torch.Generator(
            ).manual_seed(0)))                      # the device's draw is the host's, seeded alike


def test_the_foreign_device_records_what_would_block_the_host():
    with foreign_device() as dev:
        x = torch.arange(6.0).to(FOREIGN)           # pageable host memory -> device
        assert [s.kind for s in dev.syncs] == ["pageable-copy"]
        mark = dev.mark()
        torch.as_tensor(0.5, device=FOREIGN)        # a Python number made into a device tensor
        pinned = torch.ones(4)
        if torch.cuda.is_available():               # pinning needs a CUDA driver
            pinned = pinned.pin_memory()
        y = (x * 2).sum()                           # device work: no sync
        y.item()                                    # a read
        x[x > 2]                                    # size depends on the values
        x.to("cpu")                                 # device -> host
        x.tolist()                                  # read without the dispatcher
        x.new_zeros(()).copy_(torch.tensor(2.0))    # even one number from pageable memory
        kinds = [s.kind for s in dev.since(mark)]
        assert kinds == ["pageable-copy", "read", "data-dependent", "read", "read",
                         "pageable-copy"], kinds


# --- the trainer's state paths on it ----------------------------------------------------------------
@pytest.fixture(scope="module")
def paths(corpus, tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("foreign")
    run = subprocess.run([sys.executable, "-m", "tests.trainer.foreign_probe", str(work),
                          str(corpus.val)], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["path"]: r for r in results}


def _ok(result: dict) -> dict:
    assert result["ok"], f"{result['path']} failed on the foreign device: {result['error']}\n" \
        f"{result.get('where', '')}"
    return result


def test_a_training_step_keeps_parameters_and_optimizer_state_on_the_device(paths):
    step = _ok(paths["step"])
    assert step["fused"], "an accelerator's AdamW is the fused one (step counts on the device)"
    assert step["placement"] == []
    assert step["update_norm_syncs"] == [], "the update norm waited for the device"


def test_the_in_memory_restore_puts_state_back_where_it_was(paths):
    memory = _ok(paths["memory"])
    assert memory["restored"] == 1
    assert memory["values"] and memory["rng"] and memory["train_step"] == 1
    assert memory["placement"] == [], "restored state on the wrong side of the device"


def test_a_storage_restore_and_a_rollback_on_the_device(paths):
    storage = _ok(paths["storage"])
    assert (storage["latest"], storage["rollback"]) == (4, 3)
    assert storage["latest_values"] and storage["rollback_values"] and storage["rng"]
    assert storage["train_step"] == 3
    assert storage["placement"] == []


def test_eval_on_the_device_scores_as_on_the_host(paths):
    result = _ok(paths["eval"])
    assert result["tokens"] > 0
    assert result["loss"] == pytest.approx(result["cpu_loss"], rel=1e-5)


def test_stochastic_rounding_draws_on_the_device_and_rounds_as_the_host_does(paths):
    result = _ok(paths["rounding"])
    assert result["placement"] == [], "a parameter or optimizer state off the device"
    assert result["syncs"] == [[], []], "the rounding step or its update norm waited for the device"
    assert result["same_as_host"], "the device's rounding differs from the host's, seeded alike"
    assert result["dtypes"] == ["torch.bfloat16"] and result["moments"] == ["torch.float32"]


def test_the_export_state_is_on_the_host(paths):
    export = _ok(paths["export"])
    assert export["tensors"] > 0 and export["values"]
    assert export["off_host"] == []


# --- FSDP2 over it: the sharded paths on two ranks ---------------------------------------------------
@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> list[dict[str, dict]]:
    """tests/trainer/foreign_fsdp_probe.py on two ranks (gloo for both devices): each rank's
    results by path."""
    work = tmp_path_factory.mktemp("foreign-fsdp")
    run_probe("tests.trainer.foreign_fsdp_probe", work)
    return [{r["path"]: r for r in json.loads((work / f"fsdp.{rank}.json").read_text())}
            for rank in (0, 1)]


def test_fsdp_builds_the_sharded_model_on_the_device_as_on_the_host(sharded):
    for rank in sharded:
        build = _ok(rank["build"])
        assert build["placement"] == [], "a shard or optimizer state off the device"
        assert build["same_init"], "the device's initial shards differ from the host's"


def test_a_sharded_step_on_the_device_reads_back_once_and_trains_as_on_the_host(sharded):
    for rank in sharded:
        step = _ok(rank["step"])
        assert step["placement"] == []
        # The packed all-reduce's read, and nothing else: no scalar made from Python, no
        # pageable copy, no data-dependent op in FSDP's step or the trainer's.
        assert step["syncs"] == [["read tolist"], ["read tolist"]], step["syncs"]
        # Attention takes the math kernel on the device and the fused CPU one on the host.
        assert step["losses"] == pytest.approx(step["host_losses"], rel=1e-4)
        assert step["max_update_gap"] < 4 * 6e-4   # two AdamW steps at the default peak LR
    assert sharded[0]["step"]["losses"] == sharded[1]["step"]["losses"]   # all-reduced


def test_the_sharded_memory_restore_and_storage_load_on_the_device(sharded):
    for rank in sharded:
        memory = _ok(rank["memory"])
        assert memory["values"] and memory["placement"] == []
        assert memory["snapshot_on_device"] == [], "the snapshot kept device memory"
        assert memory["restored_on_host"] == [], "the restore left state on the host"
        storage = _ok(rank["storage"])
        assert storage["changed"] and storage["loaded"] == 3
        assert storage["values"] and storage["placement"] == []


def test_sharded_stochastic_rounding_on_the_device_reads_back_once_and_rounds_near_the_host(
        sharded):
    for rank in sharded:
        result = _ok(rank["rounding"])
        assert result["placement"] == [] and result["changed"]
        assert result["dtypes"] == ["torch.bfloat16"]
        # The packed all-reduce's read alone: the rounding's seeds are made on the host from
        # numbers it holds, and its bits are drawn on the device.
        assert result["syncs"] == [["read tolist"], ["read tolist"]], result["syncs"]
        assert result["apart"] == [], "shards farther from the host's than rounding explains"


# --- Tensor and pipeline parallelism over it: two ranks, one data-parallel rank ------------------
@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory) -> list[dict[str, dict]]:
    """tests/trainer/foreign_model_parallel_probe.py on two ranks: each rank's results by
    layout (tensor 2, pipeline 2 under 1F1B, 2 x 2 stages under interleaved 1F1B)."""
    work = tmp_path_factory.mktemp("foreign-model-parallel")
    run_probe("tests.trainer.foreign_model_parallel_probe", work)
    return [{r["path"]: r for r in json.loads((work / f"model_parallel.{rank}.json").read_text())}
            for rank in (0, 1)]


@pytest.mark.parametrize("layout", ["tp", "pp", "interleaved"])
def test_a_model_parallel_step_on_the_device_trains_as_on_the_host(model_parallel, layout):
    for rank in model_parallel:
        step = _ok(rank[layout])
        assert step["placement"] == [], "a shard or optimizer state off the device"
        # After the first step, the packed all-reduce's read and nothing else: no host read in
        # the vocabulary-parallel loss, the sequence-parallel norms, the schedule's sends and
        # receives or the stages' gradient norm. A pipeline's first step (each schedule's, one
        # per micro-batch count) infers its stages' shapes by exchanging them through the host.
        assert step["syncs"][1] == ["read tolist"], step["syncs"]
        assert step["syncs"][0][-1] == "read tolist"
        if layout == "tp":
            assert step["syncs"][0] == ["read tolist"], step["syncs"]
        assert step["losses"] == pytest.approx(step["host_losses"], rel=1e-4)
        assert step["max_update_gap"] < 4 * 6e-4   # two AdamW steps at the default peak LR
        # The held-out loss, passed stage to stage (round the ranks twice when interleaved):
        # the probe's own read of it, and a stage's read of each received activation's shape.
        assert step["eval"] == pytest.approx(step["host_eval"], rel=1e-4)
        reads = [s for s in step["eval_syncs"] if s.startswith("read")]
        assert reads[-1] == "read aten._local_scalar_dense.default" and all(
            s == "read tolist" for s in reads[:-1]), step["eval_syncs"]
    assert model_parallel[0][layout]["losses"] == model_parallel[1][layout]["losses"]
