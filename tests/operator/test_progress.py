"""Progress from the Lease: status fields, the goodput accounting and the hang clock."""

from __future__ import annotations

from crucible.operator import progress
from tests.operator import builders as b


def test_report_copies_what_the_trainer_wrote():
    out = progress.report(b.lease(120, 30, loss=2.71828, tokens=999, checkpoint_step=100), {})
    assert out["step"] == 120 and out["tokensSeen"] == 999 and out["loss"] == 2.71828
    assert out["worldSize"] == 32 and out["lastProgressTime"] == b.ts(30)
    assert out["lastCheckpoint"] == {"step": 100, "uri": "s3://bucket/runs/gpt/step_100",
                                     "time": b.ts(30)}
    assert progress.report(None, {}) == {} and progress.report(b.lease(), {}) == {}


def test_goodput_counts_time_across_which_steps_advanced():
    acc = {}
    for step, t in [(10, 100), (20, 200), (20, 250), (30, 300)]:
        acc = progress.advance(acc, b.lease(step, t))
    assert acc["productiveSeconds"] == 200 and acc["steps"] == 20
    # Wall time since start (t=0) is 400 s; 100 s of start-up and 100 s at the end without a step.
    assert progress.goodput(acc, b.at(0), 0.0, b.at(400)) == 0.5
    assert progress.goodput(acc, b.at(0), 200.0, b.at(400)) == 1.0     # suspended time excluded


def test_a_restart_takes_back_the_steps_after_the_last_checkpoint():
    acc = {}
    for step, t in [(0, 0), (100, 100)]:
        acc = progress.advance(acc, b.lease(step, t))
    acc, lost = progress.lose_uncheckpointed(acc, checkpoint_step=80)
    assert lost == 20 and acc["productiveSeconds"] == 80 and acc["steps"] == 80
    assert acc["lostSteps"] == 20
    # The trainer resumes at 80; its first report only sets a new baseline (no downtime counted).
    acc = progress.advance(acc, b.lease(81, 500))
    acc = progress.advance(acc, b.lease(91, 510))
    assert acc["productiveSeconds"] == 90 and acc["steps"] == 90


def test_a_step_is_timed_when_the_operator_first_sees_it_change():
    track: dict = {}
    assert progress.note_step(track, None, b.at(10)) is None
    assert progress.note_step(track, b.lease(5, 99999), b.at(20)) == b.at(20)  # not its time
    assert progress.note_step(track, b.lease(5, 99999), b.at(30)) == b.at(20)  # unchanged
    assert progress.note_step(track, b.lease(3, 0), b.at(40)) == b.at(40)  # back (a resume)
    assert track == {"stepSeen": 3, "stepSeenAt": b.ts(40)}


def test_status_merge_patch_deletes_nested_keys_the_new_status_dropped():
    from crucible.operator.kube import merge_patch

    old = {"phase": "Running", "message": "x", "tracking": {"members": {"0": "a", "1": "b"},
                                                            "handled": ["u"]}}
    new = {"phase": "Restarting", "tracking": {"members": {}, "handled": ["u", "v"]}}
    patch = merge_patch(old, new)
    assert patch == {"message": None, "phase": "Restarting",
                     "tracking": {"members": {"0": None, "1": None}, "handled": ["u", "v"]}}


def test_the_last_restore_reaches_status_with_its_source():
    import dataclasses

    from crucible.api.progress import ProgressReport
    from crucible.operator.observed import lease_view

    report = dataclasses.replace(ProgressReport(step=40), restore_source="peer", restore_step=38,
                                 restore_seconds=1.23456, restore_time=b.at(30))
    read = lease_view({"metadata": {"annotations": report.to_annotations()}, "spec": {}})
    out = progress.report(read, {})
    assert out["lastRestore"] == {"source": "peer", "step": 38, "seconds": 1.235,
                                  "time": b.ts(30)}
    assert "lastRestore" not in progress.report(b.lease(120, 30), {})


def test_steps_redone_after_a_restore_the_operator_did_not_order_count_once():
    """torchrun restarted its workers inside the pods (no group restart): the trainer restored
    step 95 from memory and redid 96-100. Those five steps were counted when first done."""
    acc = {}
    for step, t in [(0, 0), (100, 100), (95, 130), (100, 135), (110, 145)]:
        acc = progress.advance(acc, b.lease(step, t))
    assert acc["steps"] == 110
    # 100 s for steps 1-100; the 5 s redoing 96-100 not; the 10 s for 101-110.
    assert acc["productiveSeconds"] == 110
    # A reading that spans old and new steps counts only the new share of its time.
    acc = progress.advance(progress.advance({}, b.lease(0, 0)), b.lease(10, 10))
    acc = progress.advance(progress.advance(acc, b.lease(6, 20)), b.lease(14, 28))
    assert acc["steps"] == 14 and acc["productiveSeconds"] == 10 + 8 * 4 / 8
