"""`crucible plan` end to end: input resolution, --json provenance, --emit-job validity (the
emitted job passes `crucible review` with no error), and clear one-line errors."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from crucible.api.arch import PRESETS
from crucible.api.names import job_name_problem
from crucible.api.spec import PretrainJobSpec
from crucible.trainer.cli import main
from crucible.trainer.plan import planner, scaling


def _run(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_compute_only_gives_the_refit_optimum(capsys):
    rc, out, _ = _run(capsys, "--compute", "5.76e23", "--gpus", "1024", "--json")
    assert rc == 0
    figs = json.loads(out)["figures"]
    optimum = scaling.BESIROGLU.optimum(5.76e23)
    assert figs["budget.params"]["value"] == pytest.approx(optimum.params)
    for fig in figs.values():  # every figure names its formula and unit
        assert fig["formula"] and fig["unit"]
    assert figs["compute_optimal_split_of_c.kaplan.wasted_fraction"]["value"] > 0.5
    assert figs["compute_optimal_split_of_c.hoffmann_rounded.params"]["unit"] == "param"


@pytest.mark.parametrize("given, expect", [
    (dict(params=1e9, tokens=20e9), (1e9, 20e9, 1.2e20)),
    (dict(params=1e9, compute_flops=1.2e20), (1e9, 20e9, 1.2e20)),
    (dict(tokens=20e9, compute_flops=1.2e20), (1e9, 20e9, 1.2e20)),
])
def test_any_two_of_n_d_c(given, expect):
    from crucible.trainer.hardware import accelerator

    n, d, c, _ = planner.resolve_budget(planner.PlanInputs(**given), accelerator("h100"))
    assert (n, d, c) == pytest.approx(expect)


def test_gpu_hours_times_peak_times_mfu(capsys):
    rc, out, _ = _run(capsys, "--gpu-hours", "1000", "--gpu", "h100", "--mfu", "50%", "--json")
    assert rc == 0
    c = json.loads(out)["figures"]["budget.compute"]["value"]
    assert c == pytest.approx(1000 * 3600 * 989e12 * 0.5)


def test_table_output_explains_the_rounding(capsys):
    rc, out, _ = _run(capsys, "--model", "gpt2-124m", "--tokens", "2.5B")
    assert rc == 0
    for words in ("Compute-optimal split", "Besiroglu", "ZeRO-3", "Young", "Daly", "goodput",
                  "rounded"):
        assert words in out


def test_help_explains_the_refit(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "Besiroglu" in capsys.readouterr().out


def test_emit_job_validates_and_passes_review(capsys, tmp_path):
    rc, out, _ = _run(capsys, "--model", "gpt2-124m", "--tokens", "2.5B", "--gpus", "8",
                      "--emit-job", "--name", "gpt2-small")
    assert rc == 0
    doc = yaml.safe_load(out)
    assert (doc["apiVersion"], doc["kind"]) == ("crucible.dev/v1alpha1", "PretrainJob")
    spec = PretrainJobSpec.model_validate(doc["spec"])
    assert spec.training.tokens == 2.5e9 and spec.procs_per_node == 8
    path = tmp_path / "job.yaml"
    path.write_text(out)
    assert main(["review", str(path)]) == 0


def test_emit_job_for_a_bare_parameter_count(capsys):
    rc, out, _ = _run(capsys, "--params", "3B", "--gpus", "32", "--emit-job", "--name", "three")
    assert rc == 0
    spec = PretrainJobSpec.model_validate(yaml.safe_load(out)["spec"])
    assert spec.nodes.max == 4 and spec.model.layers


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_emit_job_names_every_preset_validly_by_default(capsys, preset):
    rc, out, _ = _run(capsys, "--model", preset, "--gpus", "8", "--emit-job")
    assert rc == 0
    name = yaml.safe_load(out)["metadata"]["name"]
    assert job_name_problem(name) is None and preset.replace(".", "-") in name


@pytest.mark.parametrize("argv, words", [
    (["--params", "1B", "--gpu", "v100"], "unknown GPU 'v100'"),
    (["--params=-1B"], "must be positive"),
    ([], "give at least one"),
    (["--params", "1B", "--tokens", "20B", "--compute", "1e20"], "not all three"),
    (["--params", "1Q"], "unknown suffix"),
    (["--params", "1B", "--mfu", "1.5"], "--mfu"),
    (["--params", "1B", "--gpus", "0"], "greater than zero"),
    (["--model", "gpt2-124m", "--params", "7B"], "disagrees"),
    (["--params", "1B", "--emit-job", "--name", "Big_Job"], "must be a DNS-1035 label"),
    (["--params", "1B", "--emit-job", "--name", "9lives"], "must be a DNS-1035 label"),
    (["--params", "1B", "--emit-job", "--name", "a" * 41], "at most 40"),
    (["--params", "1B", "--emit-job", "--name="], "must not be empty"),
])
def test_bad_input_is_one_clear_line(capsys, argv, words):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    assert words in err
    assert "Traceback" not in err


def test_plan_package_never_imports_torch():
    probe = ("import sys\n"
             "import crucible.trainer.plan.planner, crucible.trainer.plan.review, "
             "crucible.trainer.plan.strategy, crucible.trainer.plan.emit_job, "
             "crucible.trainer.commands.plan, crucible.trainer.commands.review, "
             "crucible.trainer.commands.decide\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_model_shape_from_a_config_file(capsys, tmp_path):
    path = tmp_path / "train_gpt2.py"
    path.write_text("n_layer = 24\nn_head = 16\nn_embd = 1024\n")  # nanoGPT GPT-2 medium
    rc, out, _ = _run(capsys, "--model", str(path), "--tokens", "7B", "--json")
    assert rc == 0
    from crucible.api import arch
    medium = arch.GPTConfig(layers=24, heads=16, dim=1024, seq_len=1024, position="learned")
    assert json.loads(out)["figures"]["budget.params"]["value"] == arch.param_count(medium)
    rc, _, err = _run(capsys, "--model", "no-such-model", "--tokens", "7B")
    assert rc == 2 and "neither a preset" in err


def test_review_reads_a_crucible_job_config(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": "local", "model": {"preset": "gpt2-124m"},
        "data": {"train": "data/train", "val": "data/val", "tokenizer": "tok.json"},
        "training": {"tokens": 2.5e9, "warmupSteps": 700, "evalEvery": 200}}))
    assert main(["review", str(path), "--gpus", "8"]) == 0
    assert "Crucible job config" in capsys.readouterr().out


def test_hsdp_row_holds_the_model_state_once_per_node(capsys):
    # 64 GPUs = 8 nodes: sharding auto shards within each node, so the states are 16 bytes per
    # parameter over 8 GPUs, not over 64; activations and logits are FSDP's.
    rc, out, _ = _run(capsys, "--model", "llama-8b", "--gpus", "64", "--json")
    figs = {k.split(".", 1)[1]: v for k, v in json.loads(out)["figures"].items()
            if k.startswith("memory_per_gpu")}
    fsdp, hsdp = figs["crucible_fsdp"]["value"], figs["crucible_hsdp"]["value"]
    params = 8_030_261_248
    assert hsdp - fsdp == pytest.approx(16 * params / 8 - 16 * params / 64)
    assert "8 replica(s) x shard groups of 8" in figs["crucible_hsdp"]["formula"]
    # One node: FSDP and HSDP are the same thing, and no HSDP row is shown.
    rc, out, _ = _run(capsys, "--model", "llama-1b", "--gpus", "8", "--json")
    assert not any(k.endswith("crucible_hsdp") for k in json.loads(out)["figures"])


def test_the_plan_counts_compiled_activations_unless_told_eager(capsys):
    figures = {}
    for flag in ([], ["--eager"]):
        rc, out, _ = _run(capsys, "--model", "llama-1b", "--tokens", "20B", "--json", *flag)
        assert rc == 0
        figures[bool(flag)] = {key.split(".", 1)[1]: value for key, value
                               in json.loads(out)["figures"].items()
                               if key.startswith("memory_per_gpu")}
    compiled, eager = figures[False], figures[True]
    # bf16 logits against fp32, and SwiGLU/RMSNorm intermediates recomputed
    assert compiled["logits"]["value"] == pytest.approx(eager["logits"]["value"] / 2, rel=0.01)
    assert (compiled["activations.selective"]["value"]
            < 0.85 * eager["activations.selective"]["value"])
    assert "compiled" in compiled["activations.selective"]["formula"]
    assert "eager" in eager["activations.selective"]["formula"]


def _emitted(capsys, *argv):
    rc, out, err = _run(capsys, *argv, "--emit-job")
    assert rc == 0, err
    notes = [line[2:] for line in out.splitlines() if line.startswith("# ")]
    return PretrainJobSpec.model_validate(yaml.safe_load(out)["spec"]), " ".join(notes)


def test_emit_job_writes_the_recommended_tensor_and_pipeline_layout(capsys):
    """70B on 512 H100s: the plan's layout goes into training.parallelism, and what must agree
    with it does: whole micro-batches on every data-parallel rank, at least one per stage a
    step, whole heads per tensor rank, whole layers per stage, an untied head."""
    spec, notes = _emitted(capsys, "--params", "70B", "--gpus", "512")
    par, t, cfg = spec.training.parallelism, spec.training, spec.model.to_arch()
    assert par.tensor > 1 and par.schedule in ("1F1B", "GPipe")
    world = spec.nodes.max * spec.procs_per_node
    assert world == 512 and spec.procs_per_node % par.tensor == 0
    dp = world // par.model_parallel
    per_step = cfg.seq_len * t.micro_batch * dp
    assert t.global_batch_tokens % per_step == 0
    assert t.global_batch_tokens // per_step >= par.pipeline   # the pipeline is filled
    assert cfg.heads % par.tensor == 0 and cfg.n_kv_heads % par.tensor == 0
    assert cfg.layers % par.pipeline == 0
    if par.pipeline > 1:
        assert not cfg.tied_embeddings and "untied head" in notes
    assert f"tp={par.tensor}" in notes and "micro-batches a step" in notes
    # What the trainer reads of it: the projection onto its config validates too.
    from crucible.api.spec import TrainJobConfig
    assert TrainJobConfig.from_job(spec, "plan").training.parallelism == par


def test_emit_job_interleaves_the_pipeline_where_it_fits_and_is_faster(capsys):
    """70B on 512 H200s: two stages a rank halve the bubble, and the extra activations fit in
    141 GB (they do not in an H100's 80: the test above gets 1F1B there)."""
    spec, notes = _emitted(capsys, "--params", "70B", "--gpus", "512", "--gpu", "H200")
    par, cfg = spec.training.parallelism, spec.model.to_arch()
    assert (par.schedule, par.virtual_stages) == ("interleaved1F1B", 2)
    assert cfg.layers % par.stages == 0 and "interleaved1F1B schedule with 2 stages a rank" in notes
    from crucible.trainer.plan import parallelism as plan_par, planner
    plan = planner.make_plan(planner.PlanInputs(params=70e9, gpus=512, gpu="H200"))
    job = plan.job
    one = plan_par.cost_layout(
        job.model, job.cost.layout, plan.gpu, global_batch_tokens=job.cost.batch_tokens,
        micro_batch=spec.training.micro_batch, mfu=0.4, schedule="1F1B")
    assert job.cost.bubble < one.bubble and job.cost.pp_bytes == 2 * one.pp_bytes


def test_emit_job_for_a_small_model_has_no_parallelism_block(capsys):
    rc, out, _ = _run(capsys, "--model", "gpt2-124m", "--gpus", "8", "--emit-job")
    assert rc == 0 and "parallelism" not in yaml.safe_load(out)["spec"]["training"]
    assert not out.startswith("#")


def test_emit_job_unties_a_tied_preset_under_a_pipeline():
    from crucible.api.arch import preset
    from crucible.trainer.plan import emit_job

    cfg = replace(preset("llama-1b"), tied_embeddings=False)
    doc = emit_job.pretrain_job(
        name="one", image="img", cfg=cfg, preset="llama-1b", params=1.2e9, tokens=1e9,
        gpus=16, gpus_per_node=8, micro_batch=2, checkpoint_minutes=10,
        activation_checkpointing=False, global_batch_tokens=2**20, data_train="s3://bucket/t",
        data_val=None, checkpoint_uri="s3://bucket/c", tensor=2, pipeline=4)
    spec = PretrainJobSpec.model_validate(doc["spec"])
    assert doc["spec"]["model"] == {"preset": "llama-1b", "tiedEmbeddings": False}
    assert spec.model.to_arch() == cfg
    # 16 ranks of tensor 2 x pipeline 4: 2 data-parallel ranks, 8192 x 2 x 2 tokens a
    # micro-step; the 1M batch is 32 of them, at least 4.
    assert spec.training.global_batch_tokens == 2**20
    assert spec.training.parallelism.model_dump() == {"tensor": 2, "pipeline": 4,
                                                      "schedule": "1F1B", "virtual_stages": 1}
    interleaved = emit_job.pretrain_job(
        name="one", image="img", cfg=cfg, preset="llama-1b", params=1.2e9, tokens=1e9,
        gpus=16, gpus_per_node=8, micro_batch=2, checkpoint_minutes=10,
        activation_checkpointing=False, global_batch_tokens=2**20, data_train="s3://bucket/t",
        data_val=None, checkpoint_uri="s3://bucket/c", tensor=2, pipeline=4,
        schedule="interleaved1F1B", virtual_stages=2)
    assert interleaved["spec"]["training"]["parallelism"] == {
        "tensor": 2, "pipeline": 4, "schedule": "interleaved1F1B", "virtualStages": 2}
    small = emit_job.pretrain_job(
        name="one", image="img", cfg=cfg, preset="llama-1b", params=1.2e9, tokens=1e9,
        gpus=16, gpus_per_node=8, micro_batch=2, checkpoint_minutes=10,
        activation_checkpointing=False, global_batch_tokens=32768, data_train="s3://bucket/t",
        data_val=None, checkpoint_uri="s3://bucket/c", tensor=2, pipeline=4)
    # One micro-batch a step would not fill four stages: raised to four.
    assert small["spec"]["training"]["globalBatchTokens"] == 4 * 8192 * 2 * 2


def test_model_fields_keep_a_shape_the_spec_can_say():
    from crucible.api.arch import GPTConfig, preset
    from crucible.trainer.plan import emit_job

    llama = replace(preset("llama-400m"), seq_len=4096)   # a config file's shape, no preset
    fields = emit_job.model_fields(llama, None)
    assert fields["mlp"] == "swiglu" and fields["norm"] == "rmsnorm" and fields["kvHeads"] == 4
    assert fields["tiedEmbeddings"] is False
    plain = GPTConfig(layers=4, heads=4, dim=256, seq_len=512)
    assert emit_job.model_fields(plain, None) == {"layers": 4, "heads": 4, "dim": 256,
                                                  "seqLen": 512, "vocabSize": 50304}
    assert emit_job.model_fields(preset("gpt2-124m", seq_len=2048), "gpt2-124m") == {
        "preset": "gpt2-124m", "seqLen": 2048}
