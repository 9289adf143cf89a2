"""`crucible review` of torchtitan's published runs against the memory their authors report.

The configs in data/torchtitan/ are torchtitan's own (BSD 3-Clause, LICENSE beside them), set
as each benchmark's text describes its runs; every file's header names its commit and what was
changed. The figures are per-GPU peak memory as torchtitan logs it, the allocator's reserved
bytes (`max_reserved`), the fullest GPU of the run:
- benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, Dec 2024): Llama 3.1 on
  H100s with 96 GB of HBM2e, Tables 1 to 5;
- benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (torchtitan e7c0cae, June 2025):
  Llama 3.1 8B on 32 and 64 H200s.
Review counts what autograd and the allocator hold (allocated, not reserved), so it may fall
somewhat short of these; the acceptance bar is 10% either way, and no published run that
worked may be called an out-of-memory.
"""

import dataclasses
from pathlib import Path

import pytest

from crucible.trainer.hardware import accelerator
from crucible.trainer.plan import configs
from crucible.trainer.plan import review as rv

DATA = Path(__file__).parent / "data" / "torchtitan"
GIB = 2**30
# The benchmark's H100s: 96 GB of HBM2e, in the binary units HBM stacks come in (six 16 GiB
# stacks), where the table's H100 has the SXM part's 80 GB.
H100_96 = dataclasses.replace(accelerator("h100"), memory_bytes=96 * GIB)
H200 = accelerator("h200")

# (config, GPUs, reported GiB, GPU): within 10%.
MATCHED = [
    ("llama3_8b_fsdp.toml", 8, 82.4, H100_96),               # Table 1, FSDP
    ("llama3_8b_fsdp_compile.toml", 8, 77.0, H100_96),       # Table 1, + torch.compile
    ("llama3_8b_fsdp.toml", 128, 67.0, H100_96),             # Table 3, FSDP
    ("llama3_8b_fsdp_compile.toml", 128, 62.0, H100_96),     # Table 3, + torch.compile
    ("llama3_8b_cp1.toml", 8, 83.9, H100_96),                # Table 2, seq 32K, FSDP 8
    ("llama3_8b_cp2.toml", 8, 84.2, H100_96),                # Table 2, seq 64K, FSDP 4 × CP 2
    ("llama3_8b_cp4.toml", 8, 84.0, H100_96),                # Table 2, seq 128K, FSDP 2 × CP 4
    ("llama3_8b_cp8.toml", 8, 84.5, H100_96),                # Table 2, seq 256K, CP 8
    ("llama3_405b_3d_interleaved1f1b.toml", 512, 72.7, H100_96),   # Table 5, interleaved
    ("llama3_8b_h200.toml", 32, 47.96, H200),                # Trainy, 4 nodes
    ("llama3_8b_h200.toml", 64, 46.97, H200),                # Trainy, 8 nodes
]
# Counted short by more than 10% (see the test below).
SHORT = [
    ("llama3_70b_2d.toml", 256, 71.9, H100_96),              # Table 4, FSDP 32 × TP 8
    ("llama3_405b_3d_1f1b.toml", 512, 82.5, H100_96),        # Table 5, 1F1B
]


def _review(name: str, gpus: int, gpu):
    setup = configs.load(DATA / name, gpus=gpus)
    ctx = rv.Context(gpu)
    return setup, rv.memory_estimate(setup, ctx), {f.code for f in rv.review(setup, ctx)}


@pytest.mark.parametrize("name, gpus, reported, gpu", MATCHED + SHORT)
def test_review_never_calls_a_published_working_run_out_of_memory(name, gpus, reported, gpu):
    _, est, codes = _review(name, gpus, gpu)
    assert "does-not-fit" not in codes
    assert est.fits


@pytest.mark.parametrize("name, gpus, reported, gpu", MATCHED)
def test_review_counts_a_published_runs_memory_within_10_percent(name, gpus, reported, gpu):
    _, est, _ = _review(name, gpus, gpu)
    assert est.total_bytes / GIB == pytest.approx(reported, rel=0.10)


@pytest.mark.parametrize("name, gpus, reported, gpu", SHORT)
def test_two_published_runs_are_counted_short(name, gpus, reported, gpu):
    """70B with 8-way tensor parallelism and 405B under the plain 1F1B schedule: review counts
    17% and 18% less than torchtitan reserved. Nothing in the memory model accounts for the
    gap: the vocabulary-parallel loss, the gathered sequence-parallel inputs, the recomputed
    block, what torch 2.6's pipeline stages kept to the step's end, and the pipelined stages'
    gathered parameters and fp32 gradients are counted, and the same 405B config under
    interleaved 1F1B, which by the schedules' own orders holds as much or more, is matched
    within 3% (torchtitan reports 10 GiB less for it). The benchmark's own figures for runs
    that keep the same tensors differ as much: Table 6's first row (405B, the same layout and
    1F1B, micro-batches of one 32K sequence where Table 5's are four of 8K) reports 75.3 GiB
    to Table 5's 82.5. What a tensor-parallel rank keeps, blocks and loss, is measured on two
    ranks and matches the count to 0.1% (tests/trainer/test_model_parallel_memory.py), and a
    whole step of the trainer's own under each layout is within 10% of the estimate
    (tests/trainer/test_step_memory.py). Held here so that a change that closes, or widens,
    the gap is seen."""
    _, est, _ = _review(name, gpus, gpu)
    assert 0.75 * reported < est.total_bytes / GIB < 0.9 * reported


def test_the_2024_layout_of_torchtitans_configs_is_read():
    """Before March 2025 torchtitan kept the degrees in [training] and [experimental] and its
    `training.compile` compiled each block but not the loss."""
    setup = configs.load(DATA / "llama3_70b_2d.toml", gpus=256)
    assert (setup.dp, setup.tp, setup.pp, setup.micro_batch) == (32, 8, 1, 16)
    assert (setup.compiled, setup.compiled_loss, setup.loss_parallel) == (True, False, True)
    assert setup.warmup_steps == 200                         # [training] warmup_steps
    assert any("Float8" in note for note in setup.notes)
    pipelined = configs.load(DATA / "llama3_405b_3d_interleaved1f1b.toml", gpus=512)
    # Eight micro-batches (the pipeline degree, torchtitan's default then) of 4 sequences.
    assert (pipelined.pp, pipelined.pp_microbatches, pipelined.micro_batch) == (8, 8, 4)
    assert (pipelined.pp_schedule, pipelined.virtual_stages) == ("interleaved1F1B", 2)
    # It ran torch 2.6's stages, which kept every stage's outputs to the step's end.
    assert pipelined.pp_outputs_kept == "all"
    context = configs.load(DATA / "llama3_8b_cp4.toml", gpus=8)
    assert (context.cp, context.dp, context.model.seq_len) == (4, 2, 131072)
    # June 2025: training.compile compiles the loss too.
    h200 = configs.load(DATA / "llama3_8b_h200.toml", gpus=32)
    assert (h200.compiled, h200.compiled_loss, h200.dp) == (True, True, 32)


def test_each_published_config_names_its_origin_and_licence():
    assert "BSD 3-Clause License" in (DATA / "LICENSE").read_text()
    for path in DATA.glob("*.toml"):
        head = path.read_text()[:600]
        assert "pytorch/torchtitan" in head and "commit" in head and "LICENSE" in head, path
