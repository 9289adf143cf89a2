"""What each precision keeps a parameter, and that `crucible plan` and `crucible review` count it.

- Mixed precision: 2 + 2 + 12 (fp32 master, m, v) = 16 bytes (ZeRO §3.1, Micikevicius 2018).
- Stochastic rounding (training.optimizer.bf16StochasticRounding): bf16 parameters and
  gradients, fp32 m and v, no master: 2 + 2 + 8 = 12.
- Pure bf16 (torchtitan's training.dtype = "bfloat16"): 2 + 2 + 4 = 8.
- FSDP's reduce dtype (torchtitan's mixed_precision_reduce) sizes the whole gradients waiting
  for their reduce-scatter and the reduce-scatter itself, not the sharded gradients.
"""

import copy
import json

import pytest
import yaml

from crucible.api import arch
from crucible.trainer.cli import main
from crucible.trainer.hardware import accelerator
from crucible.trainer.plan import configs
from crucible.trainer.plan import memory as mem
from crucible.trainer.plan import parallelism as par
from crucible.trainer.plan import review as rv
from crucible.trainer.plan.precision import PRECISIONS, with_reduce_dtype


@pytest.mark.parametrize("name, params, grads, moments, master, total, checkpoint", [
    ("bf16", 2, 2, 8, 4, 16, 12),
    ("fp32", 4, 4, 8, 0, 16, 12),
    ("bf16-pure", 2, 2, 4, 0, 8, 6),
    ("bf16-sr", 2, 2, 8, 0, 12, 10),
])
def test_each_precision_keeps_its_bytes_a_parameter(name, params, grads, moments, master,
                                                    total, checkpoint):
    p = PRECISIONS[name]
    assert (p.param_bytes, p.grad_bytes, p.moment_bytes, p.master_bytes) == \
        (params, grads, moments, master)
    assert p.state_bytes == total and p.checkpoint_bytes == checkpoint
    assert p.optimizer_bytes == moments + master     # ZeRO's K
    assert p.reduce_bytes == 4                        # FSDP reduces in fp32 by default


def test_stochastic_rounding_keeps_three_quarters_of_mixed_precisions_states():
    n, dp = 8e9, 8
    mixed = mem.model_states(n, 3, dp, PRECISIONS["bf16"])
    sr = mem.model_states(n, 3, dp, PRECISIONS["bf16-sr"])
    assert sr.total_bytes == pytest.approx(12 * n / dp)
    assert mixed.total_bytes - sr.total_bytes == pytest.approx(4 * n / dp)   # the fp32 master
    # The step in backward frees each bf16 gradient as soon as it is applied.
    cfg = arch.preset("llama-1b")
    kept = mem.estimate(cfg, micro_batch=1, capacity_bytes=80e9, stage=3, dp=dp,
                        precision=PRECISIONS["bf16-sr"])
    freed = mem.estimate(cfg, micro_batch=1, capacity_bytes=80e9, stage=3, dp=dp,
                         precision=PRECISIONS["bf16-sr"], step_in_backward=True)
    assert kept.total_bytes - freed.total_bytes == pytest.approx(2 * arch.param_count(cfg) / dp)


def test_the_reduce_dtype_sizes_the_whole_gradients_and_the_reduce_scatter():
    cfg = arch.preset("llama-8b")
    fp32, bf16 = PRECISIONS["bf16"], with_reduce_dtype(PRECISIONS["bf16"], "bfloat16")
    assert (bf16.reduce_bytes, bf16.name) == (2, "bf16, bfloat16 reduce")
    assert with_reduce_dtype(fp32, "float32") is fp32
    with pytest.raises(ValueError, match="reduce dtype"):
        with_reduce_dtype(fp32, "float8")
    block = arch.block_params(cfg)
    root = arch.param_count(cfg) - cfg.layers * block
    # The working set's whole gradients (the root's, the larger here) halve...
    assert (mem.fsdp_working_bytes(cfg, fp32) - mem.fsdp_working_bytes(cfg, bf16)
            == pytest.approx(2 * max(root, block)))
    # ...and so do unsynchronised accumulated gradients, while the sharded ones stay bf16.
    n = arch.param_count(cfg)
    assert mem.accumulated_grad_bytes(n, 1, bf16.reduce_bytes) == pytest.approx(2 * n)
    assert mem.model_states(n, 3, 8, fp32) == mem.model_states(n, 3, 8, bf16)
    # On the wire ZeRO-3 gathers bf16 parameters twice and reduce-scatters once.
    assert par.dp_bytes_per_param(3, fp32) == 2 * 2 + 4
    assert par.dp_bytes_per_param(3, bf16) == 2 * 2 + 2
    h100 = accelerator("h100")
    lay = par.Layout(dp=16, tp=1, pp=1, stage=3, recompute="full")

    def traffic(precision):
        return par.cost_layout(cfg, lay, h100, global_batch_tokens=2**21, micro_batch=1,
                               mfu=0.4, precision=precision).dp_bytes
    assert traffic(fp32) / traffic(bf16) == pytest.approx(8 / 6)


JOB = {
    "apiVersion": "crucible.dev/v1alpha1",
    "kind": "PretrainJob",
    "metadata": {"name": "rounded"},
    "spec": {
        "image": "registry.example/crucible-trainer:0.1",
        "nodes": {"min": 1, "max": 1},
        "procsPerNode": 8,
        "resources": {"limits": {"nvidia.com/gpu": 8}},
        "model": {"preset": "llama-1b"},
        "data": {"train": "s3://bucket/tokens/train", "val": "s3://bucket/tokens/val",
                 "tokenizer": "s3://bucket/tokenizer.json"},
        "training": {"tokens": 2e10, "globalBatchTokens": 1048576, "microBatch": 2,
                     "optimizer": {"bf16StochasticRounding": True}},
        "checkpoint": {"uri": "s3://bucket/runs/rounded", "everyMinutes": 10, "async": True},
    },
}


def _job(tmp_path, rounding: bool):
    doc = copy.deepcopy(JOB)
    doc["spec"]["training"]["optimizer"]["bf16StochasticRounding"] = rounding
    path = tmp_path / f"job-{rounding}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _plan(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    return {key.split(".", 1)[1]: f["value"] for key, f in figures.items()
            if key.startswith("memory_per_gpu") or key.startswith("checkpointing")}


def test_a_job_that_rounds_stochastically_is_planned_with_twelve_bytes_a_parameter(
        tmp_path, capsys):
    n, gpus = arch.param_count(arch.preset("llama-1b")), 8
    rounded = _plan(capsys, "--model", str(_job(tmp_path, True)), "--gpus", str(gpus))
    mixed = _plan(capsys, "--model", str(_job(tmp_path, False)), "--gpus", str(gpus))
    assert rounded["state_bytes_per_param"] == 12 and mixed["state_bytes_per_param"] == 16
    # No fp32 master: 4 bytes a parameter fewer, sharded over the 8 GPUs, in the ZeRO-3 line
    # and in the total of the FSDP layout Crucible's trainer runs.
    assert mixed["states.zero3"] - rounded["states.zero3"] == pytest.approx(4 * n / gpus)
    assert mixed["crucible_fsdp"] - rounded["crucible_fsdp"] == pytest.approx(4 * n / gpus)
    # A checkpoint saves the bf16 weights and fp32 moments: 10 bytes a parameter, not 12.
    assert rounded["save"] / mixed["save"] == pytest.approx(10 / 12)
    # --precision still overrides what the file asks for.
    forced = _plan(capsys, "--model", str(_job(tmp_path, True)), "--gpus", str(gpus),
                   "--precision", "bf16")
    assert forced["crucible_fsdp"] == pytest.approx(mixed["crucible_fsdp"])


def test_an_emitted_job_keeps_stochastic_rounding(capsys):
    assert main(["plan", "--model", "llama-1b", "--gpus", "8", "--precision", "bf16-sr",
                 "--emit-job", "--name", "rounded"]) == 0
    training = yaml.safe_load(capsys.readouterr().out)["spec"]["training"]
    assert training["precision"] == "bf16"
    assert training["optimizer"] == {"bf16StochasticRounding": True}


def test_review_counts_what_a_stochastically_rounded_job_keeps(tmp_path):
    ctx = rv.Context(accelerator("h100"))
    rounded = configs.load(_job(tmp_path, True))
    mixed = configs.load(_job(tmp_path, False))
    assert (rounded.precision, mixed.precision) == ("bf16-sr", "bf16")
    n = rounded.params
    a, b = rv.memory_estimate(rounded, ctx), rv.memory_estimate(mixed, ctx)
    assert a.states.total_bytes == pytest.approx(12 * n / 8)
    assert b.total_bytes - a.total_bytes == pytest.approx(4 * n / 8)
    # No accuracy warning: unlike pure bf16, no update is lost to rounding on average.
    assert "bf16-pure" not in {f.code for f in rv.review(rounded, ctx)}


TORCHTITAN = """
[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
seq_len = 8192
mixed_precision_reduce = "{reduce}"
[parallelism]
data_parallel_shard_degree = -1
[activation_checkpoint]
mode = "full"
"""


def test_review_reads_torchtitans_reduce_dtype(tmp_path):
    def load(reduce: str):
        path = tmp_path / f"{reduce}.toml"
        path.write_text(TORCHTITAN.format(reduce=reduce))
        return configs.load(path, gpus=8)
    ctx = rv.Context(accelerator("h200"))
    fp32, bf16, odd = load("float32"), load("bfloat16"), load("int4")
    assert (fp32.reduce_dtype, bf16.reduce_dtype, odd.reduce_dtype) == \
        ("float32", "bfloat16", "float32")
    assert any("int4" in note for note in odd.notes)
    assert any("accepts only float32" in note for note in bf16.notes)
    cfg = fp32.model
    block = arch.block_params(cfg)
    root = arch.param_count(cfg) - cfg.layers * block
    assert (rv.memory_estimate(fp32, ctx).total_bytes - rv.memory_estimate(bf16, ctx).total_bytes
            == pytest.approx(2 * max(root, block)))
