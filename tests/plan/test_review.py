"""`crucible review` finds each seeded flaw, passes a sound config, and reads the foreign formats.

Seeded flaws: 10× under-trained (Chinchilla Table 3's ≈20 tokens/parameter), LR with no
warmup (GPT-3 App. B), vocab not a multiple of 64 (nanoGPT pads 50257 to 50304), checkpoints
every 6 h against a 3 h MTBF (Young 1974 / Daly 2006), a model that cannot fit (ZeRO §3.1 +
Korthikanti Table 2).
"""

import copy
import dataclasses

import pytest
import yaml

from crucible.trainer.cli import main
from crucible.trainer.hardware import accelerator
from crucible.trainer.plan import configs
from crucible.trainer.plan import memory as mem
from crucible.trainer.plan import review as rv

SOUND = {
    "apiVersion": "crucible.dev/v1alpha1",
    "kind": "PretrainJob",
    "metadata": {"name": "gpt2-small"},
    "spec": {
        "image": "registry.example/crucible-trainer:0.1",
        "nodes": {"min": 1, "max": 1},
        "procsPerNode": 8,
        "resources": {"limits": {"nvidia.com/gpu": 8}},
        "model": {"preset": "gpt2-124m"},
        "data": {"train": "s3://bucket/tokens/train", "val": "s3://bucket/tokens/val",
                 "tokenizer": "s3://bucket/tokenizer.json"},
        "training": {"tokens": 2.5e9, "globalBatchTokens": 524288, "microBatch": 8, "lr": 6e-4,
                     "warmupSteps": 700, "schedule": "cosine", "evalEvery": 250},
        "checkpoint": {"uri": "s3://bucket/runs/gpt2", "everyMinutes": 10, "async": True},
        "faultTolerance": {"maxRestarts": 20},
    },
}


def _review(tmp_path, doc, **ctx):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    setup = configs.load(path)
    return rv.review(setup, rv.Context(accelerator(ctx.pop("gpu", "h100")), **ctx))


def _mutate(**changes):
    doc = copy.deepcopy(SOUND)
    for dotted, value in changes.items():
        node = doc["spec"]
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        node[last] = value
    return doc


def _codes(findings, severity=None):
    return {f.code for f in findings if severity is None or f.severity == severity}


def test_sound_config_has_no_error_or_warning(tmp_path):
    findings = _review(tmp_path, SOUND)
    assert not [f for f in findings if f.severity in ("error", "warning")], findings


@pytest.mark.parametrize("changes, ctx, code, severity", [
    ({"training__tokens": 2.5e8}, {}, "under-trained", "error"),           # 2 tokens/param
    ({"training__warmupSteps": 0}, {}, "no-warmup", "error"),
    ({"model": {"preset": "gpt2-124m", "vocabSize": 50257}}, {}, "vocab-not-64", "warning"),
    ({"checkpoint__everyMinutes": 360}, {"mtbf_s": 3 * 3600}, "interval-vs-mtbf", "error"),
    ({"model": {"layers": 96, "heads": 96, "dim": 12288, "seqLen": 2048, "vocabSize": 50304}},
     {}, "does-not-fit", "error"),
    ({"training__schedule": "constant"}, {}, "no-decay", "warning"),
    ({"training__precision": "fp32"}, {}, "fp32", "warning"),
    ({"resources": {"limits": {"nvidia.com/gpu": 4}}}, {}, "procs-vs-gpus", "error"),
    ({"training__globalBatchTokens": 500000}, {}, "batch-not-divisible", "error"),
    ({"checkpoint__everyMinutes": 600}, {"mtbf_s": 24 * 3600}, "interval-long", "warning"),
    ({"faultTolerance": {"maxRestarts": 0}}, {}, "no-restarts", "warning"),
])
def test_seeded_flaw_is_found(tmp_path, changes, ctx, code, severity):
    findings = _review(tmp_path, _mutate(**changes), **ctx)
    found = [f for f in findings if f.code == code]
    assert found, _codes(findings)
    assert found[0].severity == severity
    assert found[0].reason and found[0].source  # every finding says why and who says so


def test_all_seeded_flaws_at_once(tmp_path):
    doc = _mutate(training__tokens=2.5e8, training__warmupSteps=0,
                  model={"preset": "gpt2-124m", "vocabSize": 50257}, checkpoint__everyMinutes=360)
    codes = _codes(_review(tmp_path, doc, mtbf_s=3 * 3600))
    assert {"under-trained", "no-warmup", "vocab-not-64", "interval-vs-mtbf"} <= codes


def test_a_batch_ramp_counts_its_smaller_steps_but_not_more_time(tmp_path):
    from crucible.api.batch_ramp import BatchRamp, BatchSchedule

    def load(doc, name):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(doc))
        return configs.load(path)

    plain = load(SOUND, "plain.yaml")
    ramped = load(_mutate(training__batchRamp={"startTokens": 32768, "rampTokens": 1e9}),
                  "ramped.yaml")
    # GPT-2 small on 8 GPUs: micro-batches of 8 x 1024 tokens on 8 ranks, 8 of them a full step.
    ramp = BatchRamp.of(524288, 8 * 1024 * 8, 32768, 1e9)
    assert ramped.total_steps == BatchSchedule(ramp, 2.5e9).total_steps
    assert ramped.total_steps > plain.total_steps + 1000
    ctx = rv.Context(accelerator("h100"))
    # The same tokens take the same compute: the ramp's steps are each as much smaller.
    assert rv._run_s(ramped, ctx) == pytest.approx(rv._run_s(plain, ctx), rel=1e-3)
    assert plain.full_batch_steps is None


def test_cli_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(SOUND))
    bad.write_text(yaml.safe_dump(_mutate(training__warmupSteps=0)))
    assert main(["review", str(good)]) == 0
    assert main(["review", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "no warmup" in out
    assert main(["review", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_json(tmp_path, capsys):
    import json

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_mutate(training__tokens=2.5e8)))
    assert main(["review", str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["errors"] >= 1 and doc["format"] == "PretrainJob"
    assert {"severity", "stage", "code", "message", "reason", "source"} <= doc["findings"][0].keys()


@pytest.mark.parametrize("text, words", [
    ("kind: PretrainJob\nspec: {image: x}\n", "problem"),
    ("a: [1, 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "mapping"),
    ("foo: 1\n", "not a PretrainJob"),
])
def test_bad_files_give_clear_errors(tmp_path, text, words):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(configs.ConfigReadError, match=words):
        configs.load(path)


# Keys and values as in torchtitan's torchtitan/models/llama3/train_configs/llama3_8b.toml.
TORCHTITAN = """
[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/tokenizer/original/tokenizer.model"
[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8
[lr_scheduler]
warmup_steps = 200
[training]
batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 1000
dataset = "c4"
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
[checkpoint]
enable_checkpoint = false
interval = 500
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def test_torchtitan_config(tmp_path):
    path = tmp_path / "llama3_8b.toml"
    path.write_text(TORCHTITAN)
    setup = configs.load(path, gpus=64)
    assert setup.source == "torchtitan"
    assert setup.params == pytest.approx(8.03e9, rel=0.01)  # Llama 3 8B
    assert setup.global_batch_tokens == 64 * 8192
    findings = rv.review(setup, rv.Context(accelerator("a100-80g")))
    codes = _codes(findings)
    assert "under-trained" in codes  # 1000 steps × 0.5M tokens for 8B: a throughput benchmark
    assert "does-not-fit" not in codes  # FSDP over 64 GPUs + selective AC fits in 80 GB
    assert "no-checkpoints" in codes


@pytest.mark.parametrize("degrees, gpus, words", [
    ("tensor_parallel_degree = 8\npipeline_parallel_degree = 200", 512,
     "512 GPUs do not form data parallel 0 × tensor 8 × pipeline 200"),
    ("data_parallel_shard_degree = 8\ntensor_parallel_degree = 8", 128,
     "128 GPUs do not form data parallel 8 × tensor 8 × pipeline 1 × context 1 (64 ranks)"),
    ("tensor_parallel_degree = 4", 62, "62 GPUs do not form data parallel 15 × tensor 4"),
    ("pipeline_parallel_degree = 64", 64, "64 pipeline stages (64 ranks × 1) for 32 layers"),
])
def test_degrees_the_gpus_cannot_take_are_an_error_not_a_memory_figure(tmp_path, degrees, gpus,
                                                                      words):
    """torch's DeviceMesh takes one rank per place, and a stage needs a layer: such a file
    does not start, so its memory is not counted (an out-of-memory would be the wrong
    reason)."""
    text = TORCHTITAN.replace("data_parallel_shard_degree = -1\ntensor_parallel_degree = 1\n"
                              "pipeline_parallel_degree = 1\n", "")
    path = tmp_path / "misfit.toml"
    path.write_text(text.replace("[parallelism]\n", f"[parallelism]\n{degrees}\n"))
    setup = configs.load(path, gpus=gpus)
    ctx = rv.Context(accelerator("h100"))
    findings = {f.code: f for f in rv.review(setup, ctx)}
    assert words in findings["layout-misfit"].message
    assert findings["layout-misfit"].severity == "error"
    assert "does-not-fit" not in findings and rv.memory_estimate(setup, ctx) is None
    fitting = tmp_path / "fits.toml"
    fitting.write_text(TORCHTITAN)
    assert "layout-misfit" not in _codes(rv.review(configs.load(fitting, gpus=64), ctx))


NANOGPT = """
# config for training GPT-2 (124M) down to very nice loss of ~2.85 on 1 node of 8X A100 40GB
wandb_log = True
wandb_project = 'owt'
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8
max_iters = 600000
lr_decay_iters = 600000
eval_interval = 1000
eval_iters = 200
log_interval = 10
weight_decay = 1e-1
"""


def test_nanogpt_config_is_parsed_without_executing(tmp_path):
    path = tmp_path / "train_gpt2.py"
    path.write_text(NANOGPT + "\nimport os\nos.system('false')\nmystery = os.getcwd()\n")
    setup = configs.load(path, gpus=8)
    assert setup.source == "nanoGPT"
    assert setup.global_batch_tokens == 40 * 12 * 1024  # 491,520 tokens per iteration
    assert setup.tokens == 491520 * 600000
    assert setup.model.vocab_size == 50304
    assert any("mystery" in note for note in setup.notes)
    findings = rv.review(setup, rv.Context(accelerator("a100-80g")))
    assert not _codes(findings, "error"), findings


def test_nanogpt_seeded_vocab_and_warmup(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(NANOGPT + "vocab_size = 50257\nwarmup_iters = 0\n")
    codes = _codes(rv.review(configs.load(path, gpus=8), rv.Context(accelerator("h100"))))
    assert {"vocab-not-64", "no-warmup"} <= codes


def test_last_micro_batch_gradients_can_break_the_fit(tmp_path):
    """gradientSync: lastMicroBatch keeps the whole model's fp32 gradients on every rank across
    the micro-batches (32 GB at 8B): a layout that fits with everyMicroBatch may not."""
    doc = _mutate(model={"preset": "llama-8b"}, nodes={"min": 1, "max": 1}, procsPerNode=4,
                  resources={"limits": {"nvidia.com/gpu": 4}},
                  training__microBatch=1, training__activationCheckpointing="full")
    assert "does-not-fit" not in _codes(_review(tmp_path, doc))
    doc["spec"]["training"]["gradientSync"] = "lastMicroBatch"
    findings = _review(tmp_path, doc)
    fit = [f for f in findings if f.code == "does-not-fit"]
    assert fit and "lastMicroBatch" in fit[0].message, findings
    # One micro-batch a step: nothing is held across micro-batches.
    doc["spec"]["training"]["globalBatchTokens"] = 4 * 8192
    assert "does-not-fit" not in _codes(_review(tmp_path, doc))


def test_a_compiled_job_is_counted_with_what_compiled_blocks_keep(tmp_path):
    """training.compile (unset: on, as on CUDA) keeps fewer activations: llama-1b at
    micro-batch 4 × 8,192 on 8 H100s fits compiled (64 GB by the planner) but not eager (110 GB
    against 72 GB usable: the eager loss's fp32 copies of 128K-wide logits are 34 GB of it)."""
    doc = _mutate(model={"preset": "llama-1b"}, training__microBatch=4,
                  training__globalBatchTokens=8 * 4 * 8192)
    assert "does-not-fit" not in _codes(_review(tmp_path, doc))
    doc["spec"]["training"]["compile"] = False
    assert "does-not-fit" in _codes(_review(tmp_path, doc))


@pytest.mark.parametrize("source, text, compiled", [
    ("train.py", NANOGPT, True),                              # nanoGPT's own default
    ("train.py", NANOGPT + "compile = False\n", False),
    ("t.toml", "[compile]\nenable = true\n", True),
    ("t.toml", "[training]\nsteps = 10\n", False),
])
def test_other_frameworks_compile_setting_is_read(tmp_path, source, text, compiled):
    path = tmp_path / source
    path.write_text(text)
    assert configs.load(path, gpus=8).compiled is compiled


def test_pure_bf16_and_the_step_in_backward_are_counted_as_torchtitan_keeps_them(tmp_path):
    """torchtitan's `training.dtype = "bfloat16"` keeps parameters, gradients and AdamW's
    moments all in bf16 (8 bytes a parameter, not 16), and `early_step_in_backward` frees each
    gradient once it is applied. The review says what pure bf16 costs in accuracy, and counts
    what it saves."""
    def load(text: str):
        path = tmp_path / "llama3_8b.toml"
        path.write_text(text)
        setup = configs.load(path, gpus=8)
        return setup, _codes(rv.review(setup, rv.Context(accelerator("h100"))))

    mixed, mixed_codes = load(TORCHTITAN)
    pure, pure_codes = load(TORCHTITAN.replace("[training]\n", '[training]\ndtype = "bfloat16"\n'))
    early, _ = load(TORCHTITAN.replace("[optimizer]\n", "[optimizer]\nearly_step_in_backward = true\n"))
    assert (mixed.precision, pure.precision) == ("bf16", "bf16-pure")
    assert not mixed.step_in_backward and early.step_in_backward
    assert "bf16-pure" in pure_codes and "bf16-pure" not in mixed_codes
    n, dp = pure.params, 8

    def estimate(precision: str, step_in_backward: bool = False):
        return mem.estimate(pure.model, micro_batch=1, capacity_bytes=80e9, stage=3, dp=dp,
                            precision=mem.PRECISIONS[precision], recompute="selective",
                            step_in_backward=step_in_backward)
    assert estimate("bf16").states.total_bytes == pytest.approx(16 * n / dp)
    assert estimate("bf16-pure").states.total_bytes == pytest.approx(8 * n / dp)
    # The gradients a step in backward never keeps: bf16's 2 bytes a parameter, sharded.
    assert (estimate("bf16-pure").total_bytes - estimate("bf16-pure", True).total_bytes
            == pytest.approx(2 * n / dp))
    # FSDP still reduce-scatters in fp32 (torchtitan's only mixed_precision_reduce): the
    # working set's whole gradients are as large as in a mixed run.
    assert (mem.fsdp_working_bytes(pure.model, mem.PRECISIONS["bf16"])
            == mem.fsdp_working_bytes(pure.model, mem.PRECISIONS["bf16-pure"]))


def test_torchtitans_own_8b_memory_figure_is_matched_within_10_percent(tmp_path):
    """torchtitan's docs/performance.md, Table 1: Llama 3.1 8B on 8 H100s (96 GB), FSDP,
    local batch 2, selective (per-op) AC, no compile: 82.4 GiB reserved by the allocator.
    Review counts the config with torchtitan's own block (separate q, k, v, gate and up
    matmuls) and what the per-op policy keeps of it: allocated, so at most what is reserved
    and, the allocator's slack aside, not much less."""
    path = tmp_path / "llama3_8b.toml"
    path.write_text(TORCHTITAN.replace("batch_size = 1", "local_batch_size = 2"))
    setup = configs.load(path, gpus=8)
    assert setup.recompute == "selective-op" and setup.micro_batch == 2
    assert (setup.model.mlp, setup.model.norm, setup.model.kv_heads) == ("swiglu", "rmsnorm", 8)
    assert setup.unfused_linears
    est = mem.estimate(setup.model, micro_batch=2, capacity_bytes=96e9, stage=3, dp=8,
                       recompute=setup.recompute, flash_attention=True, compiled=False,
                       unfused_linears=True)
    assert 0.9 * 82.4 <= est.total_bytes / 2**30 <= 82.4
    # The published config itself (local batch 1) is not called an OOM on an 80 GB H100.
    path.write_text(TORCHTITAN)
    codes = _codes(rv.review(configs.load(path, gpus=8), rv.Context(accelerator("h100"))))
    assert "does-not-fit" not in codes


def test_a_jobs_model_parallelism_is_counted(tmp_path):
    """training.parallelism: the data-parallel ranks are what tensor and pipeline parallelism
    leave of the world, and under tensor parallelism the vocabulary-parallel loss stays eager
    (trainer/parallel.py does not compile it) with DTensor's 16 bytes a logit."""
    doc = _mutate(model={"preset": "llama-1b", "tiedEmbeddings": False},
                  training__microBatch=1, training__globalBatchTokens=8 * 8192)
    doc["spec"]["training"]["parallelism"] = {"tensor": 4, "pipeline": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    setup = configs.load(path)
    assert (setup.gpus, setup.dp, setup.tp, setup.pp) == (8, 1, 4, 2)
    assert (setup.compiled, setup.compiled_loss) == (True, False)
    est = rv.memory_estimate(setup, rv.Context(accelerator("h100")))
    cfg = setup.model
    assert est.loss_transient_bytes == pytest.approx(12 * cfg.seq_len * cfg.vocab_size / 4)


def _pipelined_job(tmp_path, name, ramp=None, schedule="interleaved1F1B", microbatches=8):
    """llama-1b on 8 GPUs as 4 pipeline stages × 2 data-parallel ranks; a full step is
    `microbatches` micro-batches of one 8192-token sequence a rank."""
    doc = _mutate(model={"preset": "llama-1b", "tiedEmbeddings": False},
                  training__microBatch=1, training__globalBatchTokens=microbatches * 2 * 8192)
    doc["spec"]["training"]["parallelism"] = (
        {"pipeline": 4, "schedule": schedule, "virtualStages": 2}
        if schedule == "interleaved1F1B" else {"pipeline": 4, "schedule": schedule})
    if ramp:
        doc["spec"]["training"]["batchRamp"] = ramp
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return configs.load(path)


RAMP_FROM_HALF = {"startTokens": 4 * 2 * 8192, "rampTokens": 1e8}


def test_a_pipelines_memory_is_counted_at_the_fullest_step_of_its_batch_ramp(tmp_path):
    """Interleaved 1F1B on 4 ranks, 2 stages each: torch's schedule runs one round of m
    forwards while m < 2p, so its first rank warms up (v − 1)·m + 2(p − 1) + 1 stage forwards
    before its first backward: 14 stages (7 micro-batches through both) at m = 7, where the
    full step of m = 8 runs rounds of 4 and holds 11 (5.5). A ramp from 4 micro-batches a rank
    passes through 7: it is counted as a run of 7-micro-batch steps is."""
    ctx = rv.Context(accelerator("h100"))
    plain = _pipelined_job(tmp_path, "plain.yaml")
    ramped = _pipelined_job(tmp_path, "ramped.yaml", RAMP_FROM_HALF)
    seven = _pipelined_job(tmp_path, "seven.yaml", microbatches=7)
    assert ramped.ramp_microbatches == (4, 5, 6, 7, 8) and plain.ramp_microbatches == ()
    full, fullest = rv.memory_estimate(plain, ctx), rv.memory_estimate(ramped, ctx)
    assert (full.microbatches, fullest.microbatches) == (8, 7)
    assert fullest.total_bytes > 1.1 * full.total_bytes
    assert fullest == rv.memory_estimate(seven, ctx)
    # 1F1B holds min(p, m) micro-batches: its full step is its fullest.
    one_f_one_b = rv.memory_estimate(
        _pipelined_job(tmp_path, "1f1b.yaml", RAMP_FROM_HALF, schedule="1F1B"), ctx)
    assert one_f_one_b.microbatches == 8


def test_a_ramp_step_that_does_not_fit_is_an_error_that_says_which(tmp_path):
    plain = _pipelined_job(tmp_path, "plain.yaml")
    ramped = _pipelined_job(tmp_path, "ramped.yaml", RAMP_FROM_HALF)
    probe = rv.Context(accelerator("h100"))
    full = rv.memory_estimate(plain, probe).total_bytes
    fullest = rv.memory_estimate(ramped, probe).total_bytes
    # A GPU on which the full step fits, and the ramp's fullest step does not.
    gpu = dataclasses.replace(accelerator("h100"),
                              memory_bytes=(full + fullest) / 2 / mem.USABLE_FRACTION)
    assert "does-not-fit" not in _codes(rv.review(plain, rv.Context(gpu)))
    [oom] = [f for f in rv.review(ramped, rv.Context(gpu)) if f.code == "does-not-fit"]
    assert "batch ramp's steps of 7 micro-batches (the full step has 8)" in oom.message
    assert "first such step" in oom.reason
