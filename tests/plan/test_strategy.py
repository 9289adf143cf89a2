"""Pretrain vs continued pretraining vs fine-tuning: each branch and what flips it.

Anchors: Chinchilla's 20 tokens/parameter for pretraining cost (Hoffmann et al. 2022 Table 3);
continued pretraining with replay (Ibrahim et al. 2024); LoRA without weight gradients, ≈4N per
token vs 6N (Hu et al. 2021 §4.2: 25% faster than full fine-tuning on GPT-3 175B).
"""

import json

import pytest

from crucible.trainer.cli import main
from crucible.trainer.plan import strategy as st


def test_no_licensed_base_means_pretraining():
    d = st.recommend(st.Task(task_tokens=5e9, distance="far", base_params=7e9,
                             base_license_ok=False))
    assert d.choice == "pretrain"
    assert any("licence" in r for r in d.reasons)
    assert any("licence" in f for f in d.flips)


def test_corpus_scale_specialist_data_means_continued_pretraining():
    d = st.recommend(st.Task(task_tokens=20e9, distance="mid", base_params=7e9))
    assert d.choice == "continued-pretraining"
    by = {o.option: o for o in d.options}
    assert by["continued-pretraining"].compute_flops == pytest.approx(6 * 7e9 * 20e9 * 1.05)
    assert by["pretrain"].compute_flops == pytest.approx(6 * 7e9 * 140e9)
    assert any("fine-tun" in f for f in d.flips)


def test_small_near_data_means_fine_tuning():
    d = st.recommend(st.Task(task_tokens=5e6, distance="near", base_params=8e9))
    assert d.choice == "fine-tune"


def test_lora_is_two_thirds_of_full_fine_tuning_flops():
    d = st.recommend(st.Task(task_tokens=1e8, distance="near", base_params=7e9))
    by = {o.option: o for o in d.options}
    assert by["lora"].compute_flops / by["fine-tune"].compute_flops == pytest.approx(4 / 6)


def test_tight_budget_flips_fine_tune_to_lora():
    full = 6 * 7e9 * 1e7 * st.FINE_TUNE_EPOCHS
    d = st.recommend(st.Task(task_tokens=1e7, distance="near", base_params=7e9,
                             budget_flops=0.8 * full))
    assert d.choice == "lora"


def test_budget_flips_continued_pretraining_to_fine_tuning():
    task = dict(task_tokens=2e9, distance="mid", base_params=7e9)
    cpt = 6 * 7e9 * 2e9 * 1.05
    assert st.recommend(st.Task(**task, budget_flops=2 * cpt)).choice == "continued-pretraining"
    assert st.recommend(st.Task(**task, budget_flops=0.9 * cpt)).choice in ("fine-tune", "lora")


def test_far_domain_with_enough_data_flips_to_pretraining():
    task = dict(distance="far", base_params=1e9)
    assert st.recommend(st.Task(task_tokens=30e9, **task)).choice == "pretrain"  # ≥ 20·N
    assert st.recommend(st.Task(task_tokens=10e9, **task)).choice == "continued-pretraining"


@pytest.mark.parametrize("kwargs, words", [
    (dict(task_tokens=-1, distance="far", base_params=1e9), "tokens"),
    (dict(task_tokens=1e9, distance="sideways", base_params=1e9), "distance"),
    (dict(task_tokens=1e9, distance="far"), "no usable base"),
    (dict(task_tokens=1e9, distance="far", base_params=1e9, budget_flops=0), "budget"),
])
def test_bad_input(kwargs, words):
    with pytest.raises(ValueError, match=words):
        st.Task(**kwargs)


def test_cli(capsys):
    assert main(["decide", "--task-tokens", "20B", "--distance", "mid", "--base-params", "7B",
                 "--gpu-hours", "20000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["choice"] == "continued-pretraining" and doc["flips"]
    assert {o["option"] for o in doc["options"]} == {"pretrain", "continued-pretraining",
                                                     "fine-tune", "lora"}
    assert main(["decide", "--task-tokens", "5B", "--distance", "far"]) == 2
    assert "no usable base" in capsys.readouterr().err
