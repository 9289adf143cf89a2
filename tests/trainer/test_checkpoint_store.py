"""The commits under a URI as rank 0 tends them (CommitStore), on a local folder: with a signing
key, objects written by someone without it (planted manifests, quarantine markers, owner tokens)
are ignored and reported, never acted on; without a key, every manifest and marker counts."""

from __future__ import annotations

import json
import logging

import pytest

from crucible.trainer.checkpoint_manifest import sign
from crucible.trainer.checkpoint_store import CommitStore, StaleIncarnation

KEY = b"4c1f9e2d7a6b5c8e0f3a2d1c9b8e7f6a5d4c3b2a1f0e9d8c7b6a5f4e3d2c1b0a"
OTHER = b"0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"


def _manifest(root, step: int, key: bytes | None) -> None:
    doc = {"format": 1, "step": step, "tokens": step * 100, "world_size": 1, "time": 1.0,
           "files": {".metadata": {"size": 1, "xxh3": "00"}}, "model_hash": "m",
           "config_hash": "c"}
    folder = root / f"step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(sign(doc, key) if key else doc))
    (folder / ".metadata").write_bytes(b"x")


def _quarantine_marker(root, step: int, key: bytes | None) -> None:
    doc = {"step": step, "reason": "planted", "time": 1.0}
    (root / f"step_{step}" / "quarantine.json").write_text(
        json.dumps(sign(doc, key, "quarantine") if key else doc))


def _store(root, key=KEY, token: str = "ours") -> CommitStore:
    store = CommitStore(str(root), key)
    store.claim(token, write=True)
    return store


def test_planted_unsigned_newer_manifests_neither_count_nor_prune_the_signed_commits(tmp_path):
    store = _store(tmp_path)
    for step in (10, 20, 30):
        _manifest(tmp_path, step, KEY)
    for step in (99999990, 99999991, 99999992):    # planted, newer than anything real
        _manifest(tmp_path, step, None)
    _manifest(tmp_path, 99999993, OTHER)            # signed, with another key
    assert store.committed_steps() == [10, 20, 30]
    _manifest(tmp_path, 40, KEY)                     # the run's next commit
    store.prune(40, keep=3, keep_every=0)
    remaining = sorted(int(p.name[5:]) for p in tmp_path.glob("step_*"))
    # Retention deleted the run's oldest commit only: the new commit and the planted folders
    # (not this run's to delete) stay.
    assert remaining == [20, 30, 40, 99999990, 99999991, 99999992, 99999993]
    # The load still tries them, so that a wrong key is reported instead of starting over.
    assert store.manifest_steps()[-4:] == [99999990, 99999991, 99999992, 99999993]


def test_without_a_key_every_manifest_counts(tmp_path):
    store = _store(tmp_path, key=None)
    for step in (10, 20, 99999990):
        _manifest(tmp_path, step, None)
    assert store.committed_steps() == [10, 20, 99999990]


def test_a_planted_quarantine_marker_is_ignored_and_reported_a_signed_one_counts(tmp_path,
                                                                                 caplog):
    store = _store(tmp_path)
    for step in (10, 20):
        _manifest(tmp_path, step, KEY)
    _quarantine_marker(tmp_path, 20, None)
    with caplog.at_level(logging.WARNING):
        assert store.committed_steps() == [10, 20]   # still the newest: resumed from
        assert store.committed_steps() == [10, 20]
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "quarantine is not signed" in warnings[0]  # once, not per pass
    (tmp_path / "step_20" / "quarantine.json").write_text("not json")
    assert store.committed_steps() == [10, 20]
    store.quarantine(20, "a shard is missing")      # the run's own marker is signed
    assert store.committed_steps() == [10]
    # ... and a run without the key honours it too (and any marker).
    assert _store(tmp_path, key=None).committed_steps() == [10]


def test_a_planted_owner_token_does_not_stop_a_signed_run_a_signed_newer_one_does(tmp_path):
    store = _store(tmp_path)
    token = tmp_path / "incarnation.json"
    token.write_text(json.dumps({"token": "attacker", "time": 2.0}))
    store.check_owner("commit step 40")                 # ignored: not signed with the key
    token.write_text(json.dumps(sign({"token": "attacker", "time": 2.0}, OTHER, "incarnation")))
    store.check_owner("commit step 40")
    # A newer start of this job writes a signed token: this one is stale, as before.
    _store(tmp_path).claim("newer", write=True)
    with pytest.raises(StaleIncarnation, match="a newer start of this job owns"):
        store.check_owner("commit step 40")
    # Without a key, any token fences (nothing can be told apart).
    unsigned = _store(tmp_path, key=None)
    token.write_text(json.dumps({"token": "someone", "time": 3.0}))
    with pytest.raises(StaleIncarnation):
        unsigned.check_owner("commit step 40")


def test_a_signature_of_one_kind_does_not_pass_for_another(tmp_path):
    """A validly signed manifest copied over the owner token or a quarantine marker is not one."""
    store = _store(tmp_path)
    _manifest(tmp_path, 10, KEY)
    manifest = (tmp_path / "step_10" / "manifest.json").read_text()
    (tmp_path / "step_10" / "quarantine.json").write_text(manifest)
    assert store.committed_steps() == [10]
    (tmp_path / "incarnation.json").write_text(json.dumps({**json.loads(manifest),
                                                           "token": "attacker"}))
    store.check_owner("commit step 20")


def test_a_rollback_discards_this_runs_newer_commits_not_planted_ones(tmp_path):
    store = _store(tmp_path)
    for step in (10, 20, 30):
        _manifest(tmp_path, step, KEY)
    _manifest(tmp_path, 99999990, None)
    (tmp_path / "step_25").mkdir()                      # a save that died before its manifest
    store.discard_after(10)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_10", "step_99999990"]


@pytest.mark.parametrize("plant", ["deep", "directory", "copied"])
def test_a_quarantine_marker_that_is_unreadable_or_another_steps_is_ignored(tmp_path, plant):
    """A marker that cannot be read (nested past the JSON parser's limit, a folder where a file
    should be) or a validly signed marker copied from another step's folder (a replay) must
    not take a signed commit away (before: retention then deleted it)."""
    store = _store(tmp_path)
    for step in (10, 20, 30):
        _manifest(tmp_path, step, KEY)
    marker = tmp_path / "step_30" / "quarantine.json"
    if plant == "deep":
        marker.write_text("[" * 100_000)
    elif plant == "directory":
        marker.mkdir()
    else:
        _quarantine_marker(tmp_path, 10, KEY)            # genuine, for step 10
        marker.write_bytes((tmp_path / "step_10" / "quarantine.json").read_bytes())
    assert store.committed_steps()[-1] == 30
    _manifest(tmp_path, 40, KEY)
    store.prune(40, keep=2, keep_every=0)
    assert (tmp_path / "step_30" / "manifest.json").exists()


def test_a_malformed_unsigned_manifest_is_skipped_not_quarantined(tmp_path):
    """Quarantining it would have the run write a validly signed marker an attacker could
    copy onto a real commit."""
    store = _store(tmp_path)
    (tmp_path / "step_999").mkdir()
    (tmp_path / "step_999" / "manifest.json").write_text("{}")
    manifest, problem, key_in_question = store.read_commit(999)
    assert manifest is None and key_in_question and "not signed" in problem
    (tmp_path / "step_998").mkdir()
    (tmp_path / "step_998" / "manifest.json").write_text("[" * 100_000)
    assert store.read_commit(998)[2] is True
    # Without a key, a malformed manifest is a corrupt commit, as before.
    assert _store(tmp_path, key=None).read_commit(999)[2] is False


def test_an_older_signed_owner_token_put_back_is_ignored_a_newer_one_fences(tmp_path):
    first = _store(tmp_path, token="first")                # generation 1
    old_token = (tmp_path / "incarnation.json").read_bytes()
    second = _store(tmp_path, token="second")              # generation 2: the newer start
    with pytest.raises(StaleIncarnation):
        first.check_owner("commit")                        # the older start is fenced
    (tmp_path / "incarnation.json").write_bytes(old_token)  # replayed
    second.check_owner("commit")                           # ignored: older than our claim
    assert second.generation == 2 and first.generation == 1
    with pytest.raises(StaleIncarnation):                  # ours is back: the older start
        first.check_owner("commit")                        # it named stays fenced


def test_step_folders_are_ascii_digits_only(tmp_path):
    from crucible.trainer.checkpoint_manifest import parse_step

    assert parse_step("step_120") == 120
    for name in ("step_\u00b2", "step_", "step_12a", "step_-1", "Step_1", "step_1 "):
        assert parse_step(name) is None, name
    store = _store(tmp_path)
    _manifest(tmp_path, 10, KEY)
    (tmp_path / "step_\u00b2").mkdir()
    (tmp_path / "step_\u00b2" / "manifest.json").write_text("{}")
    assert store.committed_steps() == [10]


def test_a_manifest_read_the_store_fails_prunes_nothing_and_is_not_taken_for_no_token(
        tmp_path, monkeypatch):
    """With a key, retention keeps only commits whose manifest verifies and prunes the other
    folders older than the newest. A read the store fails (a timeout) says nothing about the
    manifest: the pass is skipped (retried after the next commit), never deleting the commit it
    could not read; and a claim whose read of the owner token fails is retried, not made from
    generation 0 (an older start still running would take it for a replay)."""
    from botocore.exceptions import ReadTimeoutError

    from crucible.trainer import storage

    store = _store(tmp_path)
    for step in (10, 20, 30, 40):
        _manifest(tmp_path, step, KEY)
    real_read = storage.read_bytes
    blips = {"step_20": 1}                           # step 20's manifest fails once, then reads

    def flaky(uri, **kw):
        for part, left in blips.items():
            if part in uri and left > 0:
                blips[part] -= 1
                raise ReadTimeoutError(endpoint_url="http://s3:8333")
        return real_read(uri, **kw)
    monkeypatch.setattr(storage, "read_bytes", flaky)
    store.prune(40, keep=3, keep_every=0)
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step_*")) == [10, 20, 30, 40]
    blips["incarnation"] = 10**6                     # the owner token cannot be read
    with pytest.raises(ReadTimeoutError):
        store.claim("next", write=True)
    monkeypatch.setattr(storage, "read_bytes", real_read)   # the store answers again
    store.claim("next", write=True)                    # the claim's retry
    assert store._owner_generation() == 2              # counted on from the first claim's 1
    store.prune(40, keep=3, keep_every=0)
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step_*")) == [20, 30, 40]
