"""`crucible plan` end to end: input resolution, --json provenance, --emit-job validity (the
emitted job passes `crucible review` with no error), and clear one-line errors."""

import json
import subprocess
import sys

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
