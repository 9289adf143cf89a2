"""The accelerator table: what the trainer's MFU, the planner and the reviewer read."""

import json

import pytest
import yaml

from crucible.api.spec import PretrainJobSpec
from crucible.trainer.cli import main
from crucible.trainer.hardware import ACCELERATORS, accelerator, from_device_name


@pytest.mark.parametrize("device_name, key", [
    # What torch.cuda.get_device_name() says on each (ROCm builds report AMD's product name).
    ("NVIDIA A100-SXM4-80GB", "a100-80g"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GB200", "gb200"),            # holds "B200" too: must not read as a B200
    ("AMD Instinct MI300X", "mi300x"),
    ("AMD Instinct MI325X", "mi325x"),
])
def test_a_device_name_finds_its_own_entry(device_name, key):
    assert from_device_name(device_name) is ACCELERATORS[key]


@pytest.mark.parametrize("key, peak, memory, link, per_node", [
    # Dense bf16 FLOP/s, HBM bytes, bidirectional GPU-to-GPU bytes/s, GPUs a node: the
    # datasheets' figures (trainer/hardware.py names each source).
    ("b200", 2.25e15, 180e9, 1.8e12, 8),
    ("gb200", 2.5e15, 186e9, 1.8e12, 4),
    ("mi300x", 1307.4e12, 192e9, 896e9, 8),
    ("mi325x", 1307.4e12, 256e9, 896e9, 8),
])
def test_the_new_accelerators_carry_their_datasheet_figures(key, peak, memory, link, per_node):
    acc = accelerator(key)
    assert (acc.peak_bf16_flops, acc.memory_bytes, acc.nvlink_bytes_per_s, acc.gpus_per_node) \
        == (peak, memory, link, per_node)
    assert acc.internode_bytes_per_s == 50e9      # one 400 Gb/s NIC a GPU


@pytest.mark.parametrize("gpu", ["b200", "gb200", "mi300x", "mi325x"])
def test_a_plan_for_each_new_accelerator_emits_a_job_that_fits_its_node(capsys, gpu):
    assert main(["plan", "--params", "8B", "--gpus", "64", "--gpu", gpu, "--emit-job",
                 "--name", "eight"]) == 0
    spec = PretrainJobSpec.model_validate(yaml.safe_load(capsys.readouterr().out)["spec"])
    assert spec.procs_per_node == ACCELERATORS[gpu].gpus_per_node
    assert spec.nodes.max * spec.procs_per_node == 64
    # What the node's device plugin advertises, or the pods never schedule.
    expected = "amd.com/gpu" if gpu.startswith("mi") else "nvidia.com/gpu"
    assert spec.resources["limits"] == {expected: spec.procs_per_node}


def test_a_faster_accelerator_with_more_memory_plans_a_shorter_step(capsys):
    def figures(gpu: str) -> dict:
        assert main(["plan", "--params", "70B", "--gpus", "512", "--gpu", gpu, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["figures"]
    h100, mi325x = figures("h100"), figures("mi325x")
    # 1.32x the peak, 3.2x the memory and the same network: the planner's best layout on the
    # same 512 GPUs must be quicker per step, and its capacity line must read the new memory.
    assert mi325x["parallelism.step_time"]["value"] < h100["parallelism.step_time"]["value"]
    capacity = {gpu: next(f["value"] for key, f in figs.items() if key.endswith(".capacity"))
                for gpu, figs in (("h100", h100), ("mi325x", mi325x))}
    assert capacity == {"h100": 80e9, "mi325x": 256e9}


def test_review_reads_an_amd_jobs_gpus(capsys, tmp_path):
    from crucible.trainer.plan import configs
    assert main(["plan", "--params", "1B", "--gpus", "16", "--gpu", "mi300x", "--emit-job",
                 "--name", "amd"]) == 0
    path = tmp_path / "job.yaml"
    path.write_text(capsys.readouterr().out)
    assert configs.load(path).gpu_limit == 8


def test_tensor_parallelism_across_gb200_trays_stays_on_nvlink(tmp_path):
    from crucible.trainer.plan import configs
    from crucible.trainer.plan import review as rv
    from tests.plan.test_review import TORCHTITAN
    path = tmp_path / "tp8.toml"
    path.write_text(TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 8"))
    setup = configs.load(path, gpus=64)

    def codes(gpu):
        return {f.code for f in rv.review(setup, rv.Context(accelerator(gpu)))}
    # Two 4-GPU trays of one NVL72 rack share NVLink; two B200 servers talk over the network.
    assert "tp-across-nodes" not in codes("gb200")
    assert "tp-across-nodes" not in codes("b200")        # 8 GPUs a B200 node
    path.write_text(TORCHTITAN.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 16"))
    setup = configs.load(path, gpus=64)
    assert "tp-across-nodes" in codes("b200") and "tp-across-nodes" not in codes("gb200")
