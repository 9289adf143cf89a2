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


def test_the_table_orders_the_generations_as_their_datasheets_do():
    a = {key: accelerator(key) for key in ACCELERATORS}
    assert a["b200"].peak_bf16_flops > a["mi300x"].peak_bf16_flops > a["h100"].peak_bf16_flops
    assert a["gb200"].peak_bf16_flops > a["b200"].peak_bf16_flops
    assert a["mi325x"].memory_bytes > a["mi300x"].memory_bytes > a["gb200"].memory_bytes \
        > a["b200"].memory_bytes > a["h200"].memory_bytes > a["h100"].memory_bytes
    assert a["mi325x"].peak_bf16_flops == a["mi300x"].peak_bf16_flops   # same compute die
    for acc in a.values():
        assert acc.nvlink_one_way_bytes_per_s * 2 == acc.nvlink_bytes_per_s
        assert acc.internode_bytes_per_s < acc.nvlink_one_way_bytes_per_s


@pytest.mark.parametrize("gpu", ["b200", "gb200", "mi300x", "mi325x"])
def test_a_plan_for_each_new_accelerator_emits_a_job_that_fits_its_node(capsys, gpu):
    assert main(["plan", "--params", "8B", "--gpus", "64", "--gpu", gpu, "--emit-job",
                 "--name", "eight"]) == 0
    spec = PretrainJobSpec.model_validate(yaml.safe_load(capsys.readouterr().out)["spec"])
    assert spec.procs_per_node == ACCELERATORS[gpu].gpus_per_node
    assert spec.nodes.max * spec.procs_per_node == 64


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
