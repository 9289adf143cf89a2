"""The goodput simulator: its single-kind limit against Daly's closed form, exact accounting of
wall time, where restores read from, spares, and `crucible simulate` end to end."""

import json
import math
from dataclasses import replace

import pytest

from crucible.trainer.cli import main
from crucible.trainer.plan import reliability
from crucible.trainer.plan import simulate as sim

CRASH = sim.FailureKind("crash", 1, detect_s=0)


def scenario(**overrides) -> sim.Scenario:
    base = dict(gpus=8, gpus_per_node=8, node_mtbf_h=1.0, days=100, checkpoint_s=600, save_s=60,
                restart_s=300, restore_s3_s=0, kinds=(CRASH,), spares=0)
    return sim.Scenario(**{**base, **overrides})


@pytest.mark.parametrize("tau, save, restart, mtbf_h, detect, restore", [
    (600, 60, 300, 1.0, 0, 0),
    (1200, 30, 60, 2.0, 0, 0),
    (300, 5, 20, 0.5, 0, 0),
    (3600, 120, 600, 4.0, 0, 0),
    # detection and restore fold into Daly's restart R
    (900, 20, 100, 1.0, 50, 40),
])
def test_single_failure_kind_matches_daly_closed_form(tau, save, restart, mtbf_h, detect, restore):
    s = scenario(checkpoint_s=tau, save_s=save, restart_s=restart, node_mtbf_h=mtbf_h,
                 restore_s3_s=restore, kinds=(sim.FailureKind("x", 1, detect_s=detect),), days=120)
    mean, _ = sim.mean_goodput(s, seeds=4)
    closed = reliability.daly_wall_time_s(1e6, tau, save, mtbf_h * 3600, detect + restart + restore)
    assert mean == pytest.approx(1e6 / closed, rel=0.02)
    assert sim.daly_goodput(s) == pytest.approx(1e6 / closed, rel=1e-9)


def test_every_second_of_wall_time_is_accounted_once():
    s = scenario(in_memory_s=120, in_memory_save_s=2, restore_memory_s=3, restore_peer_s=5,
                 restore_s3_s=20, kinds=(CRASH, sim.FailureKind("node", 2, 30, nodes_lost=1)),
                 gpus=64, spares=1, repair_h=3, days=20)
    out = sim.simulate(s, seed=3)
    assert out.wall_s == pytest.approx(20 * 86400)
    assert sum(out.seconds.values()) == pytest.approx(out.wall_s, rel=1e-9)
    assert all(v >= 0 for v in out.seconds.values())
    assert out.seconds["waiting for nodes"] > 0  # one spare, 3 h repairs, 8 nodes failing hourly
    assert sum(out.restores.values()) <= sum(out.failures.values())


def test_same_seed_same_outcome_and_seeds_differ():
    s = scenario(days=10)
    assert sim.simulate(s, 7) == sim.simulate(s, 7)
    assert sim.simulate(s, 7).goodput != sim.simulate(s, 8).goodput


def test_without_failures_goodput_is_the_save_overhead():
    s = scenario(node_mtbf_h=1e12, checkpoint_s=600, save_s=60, days=660 * 1200 / 86400)
    out = sim.simulate(s)
    assert sum(out.failures.values()) == 0
    assert out.goodput == pytest.approx(600 / 660, rel=1e-6)


@pytest.mark.parametrize("kind, memory_on, expected", [
    (sim.FailureKind("crash", 1, 0, nodes_lost=0), True, "memory"),
    (sim.FailureKind("switch", 1, 0, nodes_lost=2), True, "s3"),  # a node and its ring peer
    (sim.FailureKind("crash", 1, 0, nodes_lost=0), False, "s3"),
    (sim.FailureKind("node", 1, 0, nodes_lost=1), False, "s3"),
])
def test_restores_read_the_newest_copy_that_survived(kind, memory_on, expected):
    s = scenario(kinds=(kind,), gpus=256, in_memory_s=60 if memory_on else None, spares=1000,
                 days=10)
    restores = sim.simulate(s, 1).restores
    assert restores[expected] == sum(restores.values()) > 10


def test_a_lost_node_restores_from_its_peer_unless_its_peer_went_too():
    s = scenario(kinds=(sim.FailureKind("node", 1, 0, nodes_lost=1),), gpus=256, in_memory_s=60,
                 spares=1000, days=60, restart_s=1200, node_mtbf_h=32)  # job MTBF 1 h
    restores = sim.simulate(s, 1).restores
    # ~28% of recoveries see a second loss, which hits a lost node's ring neighbour with p ~ 2/31
    # (more with a third): ~3% of restores read S3.
    assert 0 < restores["s3"] < 0.1 * sum(restores.values())
    assert restores["peer"] == sum(restores.values()) - restores["s3"] > 900


def test_in_memory_snapshots_cut_lost_work_to_half_their_interval():
    base = scenario(save_s=0, restart_s=0, node_mtbf_h=2.0, checkpoint_s=3600, days=200)
    s3 = sim.simulate(base, 2)
    mem = sim.simulate(replace(base, in_memory_s=300), 2)
    per_failure = {name: out.seconds["lost work"] / sum(out.failures.values())
                   for name, out in (("s3", s3), ("memory", mem))}
    assert per_failure["memory"] == pytest.approx(150, rel=0.15)
    # Memoryless failures in a 1-hour interval, MTBF 2 h: mean position 1/λ - τ/(e^{λτ}-1).
    lam, tau = 1 / 7200, 3600
    assert per_failure["s3"] == pytest.approx(1 / lam - tau / math.expm1(lam * tau), rel=0.15)


def test_with_spares_nobody_waits_and_without_them_the_job_waits_for_repairs():
    node = sim.FailureKind("node", 1, 0, nodes_lost=1)
    spared = sim.simulate(scenario(kinds=(node,), gpus=64, spares=20, repair_h=10, days=30,
                                   node_mtbf_h=200), 4)
    assert sum(spared.failures.values()) > 10
    assert spared.seconds["waiting for nodes"] == 0
    bare = sim.simulate(scenario(kinds=(node,), gpus=64, spares=0, repair_h=0.5, days=30,
                                 node_mtbf_h=200), 4)
    losses = sum(bare.failures.values())
    # Each loss waits the repair less what detection and earlier waits already took (0 here):
    # at most 0.5 h each, and every loss waits (no spare).
    assert 0 < bare.seconds["waiting for nodes"] <= losses * 1800 + 1e-6
    assert bare.seconds["waiting for nodes"] > 0.9 * losses * 1800


@pytest.mark.parametrize("overrides, words", [
    (dict(gpus=0), "gpus"),
    (dict(node_mtbf_h=-1), "node_mtbf_h"),
    (dict(save_s=float("nan")), "save_s"),
    (dict(in_memory_s=0), "in_memory_s"),
    (dict(kinds=()), "failure mix"),
    (dict(kinds=(sim.FailureKind("x", 1, 0, nodes_lost=5),), gpus=16), "more nodes"),
])
def test_bad_scenarios_are_refused_with_the_field_named(overrides, words):
    with pytest.raises(ValueError, match=words):
        scenario(**overrides)


def test_llama3_mix_is_their_table_5():
    assert sum(count for count, _, _ in sim.LLAMA3_CAUSES.values()) == sim.LLAMA3_INTERRUPTIONS
    for count, _, rows in sim.LLAMA3_CAUSES.values():
        assert count == sum(int(part.rsplit(" ", 1)[1]) for part in rows.split(", "))


def _cli(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_llama3_goodput_is_within_a_few_points_of_their_90_percent(capsys):
    rc, out, _ = _cli(capsys, "--llama3", "--seeds", "3", "--json")
    assert rc == 0
    report = json.loads(out)
    assert 0.86 <= report["goodput"] <= 0.95
    failures = sum(report["results"]["S3 only"]["failures"].values())
    assert failures == pytest.approx(419, rel=0.15)  # 54 days at their rate (with recoveries)


def test_in_memory_is_reported_beside_s3_only(capsys):
    rc, out, _ = _cli(capsys, "--llama3", "--in-memory-minutes", "2", "--in-memory-save-seconds",
                      "0.5", "--seeds", "2", "--json")
    assert rc == 0
    results = json.loads(out)["results"]
    s3, mem = results["S3 only"], results["in-memory 2 min"]
    assert mem["restores"]["s3"] < s3["restores"]["s3"]
    assert mem["restores"]["peer"] > mem["restores"]["memory"] > 0
    assert mem["goodput"] > s3["goodput"]  # 60 s S3 restores and 13 min of work vs 1 min


def test_table_and_plot(capsys, tmp_path):
    png = tmp_path / "goodput.png"
    rc, out, _ = _cli(capsys, "--gpus", "1024", "--seeds", "1", "--days", "5",
                      "--in-memory-minutes", "1", "--plot", str(png))
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for words in ("goodput", "lost work", "restores from peer", "Daly", "in-memory 1 min"):
        assert words in out


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "-4"], "gpus"),
    (["--checkpoint-minutes", "0"], "checkpoint_s"),
    (["--seeds", "0"], "--seeds"),
    (["--restart-seconds", "nan"], "restart_s"),
])
def test_bad_flags_give_one_line_and_no_traceback(capsys, argv, words):
    rc, out, err = _cli(capsys, *argv)
    assert rc != 0 and words in err and "Traceback" not in err


def test_a_calibration_file_sets_the_measured_times_and_flags_still_win(capsys, tmp_path):
    measured = {"snapshot_blocking_s": 0.5, "restore_memory_s": 2.0, "restore_peer_s": 4.0,
                "restore_storage_s": 9.0, "save_blocking_s": 3.0, "model": "gpt2-124m"}
    path = tmp_path / "restore_bench.json"
    path.write_text(json.dumps(measured))
    rc, out, _ = _cli(capsys, "--calibration", str(path), "--in-memory-minutes", "1",
                      "--restore-seconds", "7", "--seeds", "1", "--days", "1", "--json")
    assert rc == 0
    s = json.loads(out)["scenario"]
    assert (s["in_memory_save_s"], s["restore_memory_s"], s["restore_peer_s"], s["save_s"]) == \
        (0.5, 2.0, 4.0, 3.0)
    assert s["restore_s3_s"] == 7  # the flag wins over the file
    path.write_text("{}")
    rc, _, err = _cli(capsys, "--calibration", str(path))
    assert rc != 0 and "not a bench/restore_bench.py result" in err and "Traceback" not in err
