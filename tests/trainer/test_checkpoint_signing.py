"""Signed manifests: someone who can write the bucket but does not hold the key cannot get a
checkpoint of their making loaded (docs/checkpoints.md, "Signed manifests").

The signing functions on their own, then torchrun runs against the stack's real S3 (as the chaos
tests): a commit signed with the run's key loads; a commit changed after it was signed is
quarantined like a corrupt one and the previous commit loaded; one signed with another key, or
not signed at all, is skipped (left as it is: the job may hold the wrong key) and the previous
commit loaded, and when no commit is left the run stops rather than start over and prune them;
a run without the key loads a signed commit and says it did not check it.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from crucible.trainer import storage
from crucible.trainer.checkpoint import Checkpointer, CheckpointError
from crucible.trainer.checkpoint_manifest import (SIGNING_KEY_ENV, file_digest, key_id,
                                                  manifest_problem, sign, signature_problem,
                                                  signed_bytes, signing_key_from_env)
from crucible.trainer.checkpoint_store import CommitStore
from tests.trainer.chaos import TrainProcess, config, objects
from tests.trainer.chaos import ckpt  # noqa: F401 - a fixture: pytest finds it by its name here
from tests.trainer.test_checkpoint_chaos import SENTINEL, _plant_code_in_the_index

KEY = b"9f2c1e7a55d04b8e8a3f6c2d1b0e4f7a9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f"
OTHER = b"0d1c2b3a495867768594a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2"

MANIFEST = {"format": 1, "step": 8, "tokens": 32768, "world_size": 2, "time": 1722000000.123456,
            "model_hash": "m", "config_hash": "c", "incarnation": "ab12",
            "global_batch_tokens": 4096,
            "files": {"__0_0.distcp": {"size": 10, "xxh3": "ab"},
                      "__1_0.distcp": {"size": 11, "xxh3": "ef"},
                      ".metadata": {"size": 3, "xxh3": "cd"}}}


# --- the signing functions ----------------------------------------------------------------------
def test_a_signed_manifest_verifies_and_names_its_key():
    signed = sign(MANIFEST, KEY)
    assert signed["signature"]["alg"] == "hmac-sha256"
    assert signed["signature"]["key_id"] == key_id(KEY) == hashlib.sha256(KEY).hexdigest()[:8]
    assert len(signed["signature"]["value"]) == 64
    assert manifest_problem(signed, 8) is None and signature_problem(signed, KEY) is None
    # What is written (indented JSON) and read back verifies: the encoding is canonical.
    assert signature_problem(json.loads(json.dumps(signed, indent=1)), KEY) is None
    reordered = dict(reversed(list(signed.items())))
    assert signed_bytes(reordered) == signed_bytes(signed)
    assert KEY.decode() not in json.dumps(signed)


@pytest.mark.parametrize("change", [
    lambda m: m["files"]["__1_0.distcp"].update(xxh3="00"),
    lambda m: m["files"][".metadata"].update(size=4),
    lambda m: m["files"].update({"__2_0.distcp": {"size": 1, "xxh3": "aa"}}),
    lambda m: m["files"].pop("__1_0.distcp"),
    lambda m: m.update(step=4),
    lambda m: m.update(tokens=1),
    lambda m: m.update(model_hash="other"),
    lambda m: m.update(global_batch_tokens=8192),
    lambda m: m.update(extra="field"),
], ids=["shard-checksum", "metadata-size", "added-file", "removed-file", "step", "tokens",
        "model-hash", "batch", "added-field"])
def test_any_change_after_signing_is_refused(change):
    tampered = json.loads(json.dumps(sign(MANIFEST, KEY)))
    change(tampered)
    assert "does not match its contents" in signature_problem(tampered, KEY)


def test_another_key_an_unsigned_manifest_and_a_malformed_signature_are_refused():
    theirs = signature_problem(sign(MANIFEST, OTHER), KEY)
    assert f"signed with key id '{key_id(OTHER)}', this run holds key id {key_id(KEY)}" in theirs
    # Someone who copies our key id into their own signature gets no further.
    forged = sign(MANIFEST, OTHER)
    forged["signature"]["key_id"] = key_id(KEY)
    assert "does not match its contents" in signature_problem(forged, KEY)
    assert f"not signed, and this run holds signing key id {key_id(KEY)}" in \
        signature_problem(MANIFEST, KEY)
    assert "malformed" in signature_problem({**MANIFEST, "signature": "x"}, KEY)
    other_alg = sign(MANIFEST, KEY)
    other_alg["signature"]["alg"] = "none"
    assert "signed with 'none'" in signature_problem(other_alg, KEY)
    nan = json.loads(json.dumps(sign(MANIFEST, KEY)).replace("1722000000.123456", "NaN"))
    assert "cannot be encoded" in signature_problem(nan, KEY)  # refused, not raised
    for problem in (theirs, signature_problem(MANIFEST, KEY)):
        assert KEY.decode() not in problem and OTHER.decode() not in problem


def test_a_rank_markers_signature_is_not_a_manifests():
    marker = {"rank": 1, "step": 8, "incarnation": "ab12", "files": MANIFEST["files"]}
    assert signature_problem(sign(marker, KEY, "marker"), KEY, "marker") is None
    as_manifest = {**marker, "signature": sign(marker, KEY, "marker")["signature"]}
    assert "does not match" in signature_problem(as_manifest, KEY)


def _committer(tmp_path, key: bytes) -> Checkpointer:
    """Rank 0's commit step alone, on a local URI (no process group: `_commit` needs none)."""
    ck = Checkpointer.__new__(Checkpointer)
    ck.uri, ck.world_size, ck.marker_timeout_s, ck._key = str(tmp_path), 2, 1.0, key
    ck.store = CommitStore(str(tmp_path), key)
    ck.store.incarnation = "ab12"
    ck.model_hash, ck.config_hash, ck.batch_tokens, ck.batch_notes = "m", "c", 4096, {}
    ck.on_commit, ck.spec = None, SimpleNamespace(keep=3, keep_every=0)
    storage.write_bytes(str(tmp_path / "incarnation.json"), b'{"token": "ab12"}')
    return ck


def _write_marker(tmp_path, rank: int, key: bytes, change: dict | None = None) -> None:
    marker = {"rank": rank, "step": 8, "incarnation": "ab12",
              "files": {f"__{rank}_0.distcp": {"size": 10 + rank, "xxh3": "ab"}}}
    marker = {**sign(marker, key, "marker"), **(change or {})}
    storage.write_bytes(str(tmp_path / "step_8" / f"rank_{rank}.json"), json.dumps(marker).encode())


@pytest.mark.parametrize("change, words", [
    ({"files": {"__1_0.distcp": {"size": 11, "xxh3": "00"}}}, "does not match its contents"),
    ({"signature": None}, "the marker is not signed"),
    ({"rank": 0}, "does not match"),
])
def test_rank_0_does_not_sign_a_marker_changed_in_the_bucket(tmp_path, change, words):
    """Someone who swaps a shard and its marker's checksum during a save must not get rank 0 to
    sign the swap into a manifest."""
    ck = _committer(tmp_path, KEY)
    _write_marker(tmp_path, 0, KEY)
    _write_marker(tmp_path, 1, KEY, change)
    with pytest.raises(CheckpointError, match=f"rank_1.json: .*{words}"):
        ck._commit(8, 32768, str(tmp_path / "step_8"), 0.0)
    assert not (tmp_path / "step_8" / "manifest.json").exists()


def test_rank_0_signs_a_manifest_of_verified_markers(tmp_path):
    ck = _committer(tmp_path, KEY)
    _write_marker(tmp_path, 0, KEY)
    _write_marker(tmp_path, 1, KEY)
    ck._commit(8, 32768, str(tmp_path / "step_8"), 0.0)
    manifest = json.loads((tmp_path / "step_8" / "manifest.json").read_text())
    assert signature_problem(manifest, KEY) is None
    assert set(manifest["files"]) == {"__0_0.distcp", "__1_0.distcp"}
    _write_marker(tmp_path, 1, OTHER)  # a marker signed with another key: no commit
    with pytest.raises(CheckpointError, match=f"signed with key id '{key_id(OTHER)}'"):
        _committer(tmp_path, KEY)._commit(8, 32768, str(tmp_path / "step_8"), 0.0)
    # Rank 0's own valid marker copied over rank 1's: signed, but not rank 1's.
    marker_dir = tmp_path / "step_8"
    (marker_dir / "rank_1.json").write_bytes((marker_dir / "rank_0.json").read_bytes())
    with pytest.raises(CheckpointError, match="rank_1.json: the marker was written for another"):
        _committer(tmp_path, KEY)._commit(8, 32768, str(tmp_path / "step_8"), 0.0)


def test_the_key_comes_from_the_environment_without_surrounding_whitespace():
    assert signing_key_from_env({}) is None
    assert signing_key_from_env({SIGNING_KEY_ENV: ""}) is None
    assert signing_key_from_env({SIGNING_KEY_ENV: " \n"}) is None
    assert signing_key_from_env({SIGNING_KEY_ENV: KEY.decode() + "\n"}) == KEY  # a Secret file


# --- real runs against the stack's S3 -----------------------------------------------------------
def _manifest(s3, uri: str, step: int) -> tuple[object, str, str, dict]:
    bucket, _, prefix = uri[5:].partition("/")
    key = f"{prefix}/step_{step}/manifest.json"
    client = s3.client()
    return client, bucket, key, json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def _first_run(corpus, tmp_path, uri, env, key: bytes | None) -> Path:
    """Commits steps 4 and 8 (signed with `key`, when given) and stops."""
    cfg = config(corpus, tmp_path, "signed", uri, steps=12, every=4)
    first = TrainProcess(cfg, tmp_path / "first.log", env=_with_key(env, key),
                         extra_args=["--max-steps", "8"])
    assert first.finish() == 0, first.text()[-3000:]
    return cfg


def _with_key(env: dict, key: bytes | None) -> dict:
    env = {k: v for k, v in env.items() if k != SIGNING_KEY_ENV}
    return {**env, SIGNING_KEY_ENV: key.decode()} if key is not None else env


def _resume(cfg, tmp_path, env, key: bytes | None, exit_code: int = 0) -> str:
    second = TrainProcess(cfg, tmp_path / "second.log", env=_with_key(env, key))
    assert second.finish() == exit_code, second.text()[-3000:]
    log = second.text()
    # (A refused start exits 2, and torchrun's agent then prints its own ChildFailedError.)
    assert exit_code == 0 or "crucible train: error: " in log, log[-3000:]
    assert exit_code != 0 or "Traceback" not in log, log[-3000:]
    for k in (KEY, OTHER):
        assert k.decode() not in log  # never the key, only its id
    return log


def _refused_and_fell_back(log: str, reason: str) -> None:
    assert f"step_8 is corrupt: {reason}" in log and "quarantined, falling back" in log, log[-3000:]
    assert "(step 4," in log, log[-3000:]  # the previous commit, itself validly signed
    assert "step_4: manifest signature verified" in log


def _skipped_and_fell_back(log: str, reason: str) -> None:
    assert f"step_8 skipped: {reason}" in log, log[-3000:]
    assert "quarantined" not in log and "(step 4," in log, log[-3000:]
    assert "step_4: manifest signature verified" in log


def test_a_signed_commit_loads_with_the_key(corpus, tmp_path, ckpt, s3):
    uri, env = ckpt
    cfg = _first_run(corpus, tmp_path, uri, env, KEY)
    *_, manifest = _manifest(s3, uri, 8)
    assert manifest["signature"]["key_id"] == key_id(KEY)
    assert signature_problem(manifest, KEY) is None
    log = _resume(cfg, tmp_path, env, KEY)
    assert f"step_8: manifest signature verified (key id {key_id(KEY)})" in log, log[-3000:]
    assert "(step 8," in log and "quarantined" not in log
    *_, manifest = _manifest(s3, uri, 12)  # and the run goes on signing
    assert signature_problem(manifest, KEY) is None


def _replace_a_shard(client, bucket: str, step: str) -> None:
    """An attacker replaces a shard and recomputes its size and checksum in the manifest: what
    the checksums alone cannot catch."""
    key = f"{step}/__1_0.distcp"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    replaced = Path(tempfile.mkdtemp()) / "shard"
    replaced.write_bytes(bytes(data))
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    manifest_key = f"{step}/manifest.json"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read())
    manifest["files"]["__1_0.distcp"] = file_digest(replaced)
    client.put_object(Bucket=bucket, Key=manifest_key, Body=json.dumps(manifest).encode())


@pytest.mark.parametrize("damage", [_replace_a_shard, _plant_code_in_the_index],
                         ids=["replace_a_shard", "plant_code_in_the_index"])
def test_a_manifest_changed_after_signing_is_refused(corpus, tmp_path, ckpt, s3, damage):
    uri, env = ckpt
    cfg = _first_run(corpus, tmp_path, uri, env, KEY)
    bucket, _, prefix = uri[5:].partition("/")
    damage(s3.client(), bucket, f"{prefix}/step_8")
    log = _resume(cfg, tmp_path, env, KEY)
    _refused_and_fell_back(log, f"the manifest's signature (key id {key_id(KEY)}) does not match "
                                "its contents")
    assert "quarantine.json to make it a commit again" not in log  # no key fixes a tampering
    # The resumed run saved step 8 again, over the quarantined one: signed with the key.
    assert "step_8/quarantine.json" not in objects(s3, uri)
    assert signature_problem(_manifest(s3, uri, 8)[-1], KEY) is None
    assert "would load posix.system" not in log  # refused before `.metadata` was unpickled
    assert not SENTINEL.exists()


def test_planted_unsigned_objects_change_neither_the_resume_nor_what_is_deleted(corpus, tmp_path,
                                                                                 ckpt, s3):
    """Someone who can write the bucket but lacks the key plants three newer manifests (before,
    retention counted them as the newest and deleted each new commit), a quarantine marker on
    the newest commit (before, the run went back to step 4) and an owner token (before, the
    run could no longer commit)."""
    uri, env = ckpt
    cfg = _first_run(corpus, tmp_path, uri, env, KEY)
    client, bucket, _, manifest = _manifest(s3, uri, 8)
    prefix = uri[5:].partition("/")[2]
    unsigned = {k: v for k, v in manifest.items() if k != "signature"}
    planted = [f"step_{step}/manifest.json" for step in (99999990, 99999991, 99999992)]
    for name, step in zip(planted, (99999990, 99999991, 99999992)):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}",
                          Body=json.dumps({**unsigned, "step": step}).encode())
    client.put_object(Bucket=bucket, Key=f"{prefix}/step_8/quarantine.json",
                      Body=json.dumps({"step": 8, "reason": "planted", "time": 0}).encode())
    client.put_object(Bucket=bucket, Key=f"{prefix}/incarnation.json",
                      Body=json.dumps({"token": "attacker", "time": 0}).encode())
    log = _resume(cfg, tmp_path, env, KEY)
    assert "(step 8," in log, log[-3000:]                # the signed newest, quarantine ignored
    assert "step_8/quarantine.json ignored: the quarantine is not signed" in log, log[-3000:]
    names = objects(s3, uri)
    assert {"step_4/manifest.json", "step_8/manifest.json", "step_12/manifest.json"} <= names
    assert signature_problem(_manifest(s3, uri, 12)[-1], KEY) is None   # it kept committing
    assert set(planted) <= names                          # not this run's: left alone


def test_a_manifest_signed_with_another_key_is_refused_naming_both_keys(corpus, tmp_path, ckpt, s3):
    uri, env = ckpt
    cfg = _first_run(corpus, tmp_path, uri, env, KEY)
    client, bucket, key, manifest = _manifest(s3, uri, 8)
    resigned = sign({k: v for k, v in manifest.items() if k != "signature"}, OTHER)
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(resigned).encode())
    log = _resume(cfg, tmp_path, env, KEY)
    _skipped_and_fell_back(log, f"the manifest is signed with key id '{key_id(OTHER)}', this run "
                                f"holds key id {key_id(KEY)}")


def test_an_unsigned_manifest_is_refused_when_the_run_holds_a_key(corpus, tmp_path, ckpt, s3):
    uri, env = ckpt
    cfg = _first_run(corpus, tmp_path, uri, env, KEY)
    client, bucket, key, manifest = _manifest(s3, uri, 8)
    del manifest["signature"]
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    log = _resume(cfg, tmp_path, env, KEY)
    _skipped_and_fell_back(log, f"the manifest is not signed, and this run holds signing key id "
                                f"{key_id(KEY)}")


def test_a_run_whose_key_verifies_no_commit_stops_and_leaves_them_alone(corpus, tmp_path, ckpt,
                                                                          s3):
    """The job was given the wrong key: starting over would let its saves prune the run."""
    uri, env = ckpt
    cfg = _first_run(corpus, tmp_path, uri, env, OTHER)
    before = objects(s3, uri)
    log = _resume(cfg, tmp_path, env, KEY, exit_code=1)   # torchrun's, for its worker's 2
    assert (f"no commit under {uri} can be verified with this run's signing key (key id "
            f"{key_id(KEY)}): 2 skipped, the newest step_8") in log, log[-3000:]
    assert "checkpoint.signingKeySecret" in log
    assert objects(s3, uri) == before        # nothing quarantined, pruned or overwritten


def test_without_the_key_a_signed_commit_loads_unchecked(corpus, tmp_path, ckpt, s3):
    uri, env = ckpt
    cfg = _first_run(corpus, tmp_path, uri, env, KEY)
    log = _resume(cfg, tmp_path, env, None)
    assert "(step 8," in log and "quarantined" not in log, log[-3000:]
    note = (f"step_8 is signed (key id '{key_id(KEY)}'), but {SIGNING_KEY_ENV} is not set: its "
            "signature is not checked")
    assert log.count(note) == 1, log[-3000:]
    *_, manifest = _manifest(s3, uri, 12)
    assert "signature" not in manifest  # a run without the key writes unsigned commits


def test_a_job_that_asks_for_signing_without_a_key_is_refused_in_one_line(monkeypatch):
    from crucible.api.spec import CheckpointSpec

    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    spec = CheckpointSpec(uri="/tmp/nowhere", signing_key_secret="ckpt-hmac")
    with pytest.raises(CheckpointError, match="signingKeySecret is 'ckpt-hmac' but "
                       f"{SIGNING_KEY_ENV} is empty"):
        Checkpointer(spec, job="gpt", rank=0, world_size=1, local_rank=0, model_hash="m",
                     config_hash="c")
