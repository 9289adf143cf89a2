"""Checkpoint decisions as pure functions: retention, when to save, retries, verification, and
what a quarantine says when ranks saw different problems."""

from __future__ import annotations

import json

import pytest

from crucible.trainer import storage
from crucible.trainer.checkpoint import should_save, with_retries
from crucible.trainer.checkpoint_manifest import (describe_problems, file_digest,
                                                  manifest_problem, parse_step, step_name, verify)
from crucible.trainer.checkpoint_store import retention_plan


@pytest.mark.parametrize("committed, keep, keep_every, deleted", [
    ([], 3, 0, []),
    ([10, 20, 30], 3, 0, []),
    ([10, 20, 30, 40, 50], 3, 0, [10, 20]),
    ([10, 20, 30, 40, 50], 2, 20, [10, 30]),             # 20 and 40 are kept forever
    ([10, 23, 30, 41, 50, 60], 2, 20, [10, 30]),         # 20's save skipped: 23 stands in; 41 for 40
    ([5, 10, 15, 1000], 2, 0, [5, 10]),
    ([7], 2, 5, []),                                      # the newest commit always survives
    ([100, 200, 300], 0, 0, [100, 200]),                  # even with keep=0
])
def test_retention_keeps_newest_and_multiples(committed, keep, keep_every, deleted):
    assert retention_plan(committed, keep, keep_every) == deleted


def test_save_on_step_multiples_or_after_the_interval():
    kw = dict(seconds_since_save=0.0, every_minutes=0)
    last, saved = 0, []
    for step in range(1, 21):
        if should_save(step, last_save_step=last, every_steps=5, **kw):
            saved.append(step)
            last = step
    assert saved == [5, 10, 15, 20]
    assert not should_save(7, last_save_step=5, every_steps=5, **kw)
    assert should_save(10, last_save_step=7, every_steps=5, **kw)  # resumed at 7: next multiple
    assert should_save(3, last_save_step=1, every_steps=0, seconds_since_save=601, every_minutes=10)
    assert not should_save(3, last_save_step=1, every_steps=0, seconds_since_save=599, every_minutes=10)
    assert not should_save(3, last_save_step=3, every_steps=1, seconds_since_save=1e9, every_minutes=1)


def test_step_names_round_trip():
    assert step_name(1200) == "step_1200" and parse_step("step_1200") == 1200
    assert parse_step("step_x") is None and parse_step(".metadata") is None


def test_retries_back_off_then_succeed_or_give_up():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("down")

    with_retries(flaky, "upload", attempts=5, base_delay_s=1.0, sleep=sleeps.append)
    assert len(calls) == 3 and sleeps == [1.0, 2.0]
    with pytest.raises(ConnectionError):
        with_retries(lambda: (_ for _ in ()).throw(ConnectionError("down")), "upload",
                     attempts=3, sleep=sleeps.append)


def test_verify_finds_missing_truncated_and_flipped_files(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1000)
    (tmp_path / "b").write_bytes(b"y" * 10)
    files = {name: file_digest(tmp_path / name) for name in ("a", "b")}
    assert verify(tmp_path, files) is None
    data = bytearray((tmp_path / "a").read_bytes())
    data[500] ^= 0xFF
    (tmp_path / "a").write_bytes(bytes(data))
    assert "a: size/checksum" in verify(tmp_path, files)
    (tmp_path / "b").unlink()
    (tmp_path / "a").write_bytes(b"x" * 1000)
    assert verify(tmp_path, files) == "b is missing"


def test_storage_errors_are_explained_without_secrets():
    from botocore.exceptions import ClientError, NoCredentialsError

    denied = ClientError({"Error": {"Code": "SignatureDoesNotMatch", "Message": "x"}}, "PutObject")
    assert "refused the credentials" in storage.explain(denied, "s3://b/p")
    assert "AWS_ACCESS_KEY_ID" in storage.explain(NoCredentialsError(), "s3://b/p")
    missing = ClientError({"Error": {"Code": "NoSuchBucket", "Message": "x"}}, "PutObject")
    assert "does not exist" in storage.explain(missing, "s3://b/p")
    gone = ClientError({"Error": {"Code": "404", "Message": "Not Found"}}, "HeadObject")
    assert storage.explain(gone, "s3://b/p/x") == \
        "s3://b/p/x is not there (404: no such object, or no such bucket)"
    # A frozen or restarting store: botocore raises these with `response = None`.
    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

    for err in (ReadTimeoutError(endpoint_url="http://s3:8333"),
                ConnectionClosedError(endpoint_url="http://s3:8333")):
        assert err.response is None
        assert storage.explain(err, "s3://b/p").startswith("cannot reach the S3 endpoint for "
                                                           "s3://b/p")


def test_a_store_that_does_not_answer_is_told_from_one_a_person_must_fix():
    """`storage.unavailable`: the store away (unreachable, cut off, too slow, answering 5xx) is an
    outage a later try may get past; credentials, a missing bucket or object are not."""
    from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectTimeoutError,
                                     EndpointConnectionError, NoCredentialsError, ReadTimeoutError)

    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import IncompleteReadError

    def answered(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "x"}}, "ListObjectsV2")

    def statused(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "x"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    away = [ReadTimeoutError(endpoint_url="http://s3:8333"),
            ConnectionClosedError(endpoint_url="http://s3:8333"),
            ConnectTimeoutError(endpoint_url="http://s3:8333"),
            EndpointConnectionError(endpoint_url="http://s3:8333"),
            ConnectionRefusedError(111, "refused"),
            answered("503"), answered("SlowDown"), answered("InternalError"),
            # 5xx and 429 whatever the server calls them (MinIO, Ceph RGW name their own)
            statused("XMinioServerNotInitialized", 503), statused("TooManyRequests", 429),
            # a body cut off or stalled mid-read
            IncompleteReadError(actual_bytes=3, expected_bytes=10),
            # boto3's download_file after every try's body was cut off
            RetriesExceededError(ReadTimeoutError(endpoint_url="http://s3:8333"))]
    to_fix = [NoCredentialsError(), answered("AccessDenied"), answered("NoSuchBucket"),
              answered("404"), answered("NoSuchKey"), answered("InvalidAccessKeyId"),
              PermissionError(13, "denied"), ValueError("bad manifest"),
              statused("ExpiredToken", 400), statused("AccessDenied", 403),
              RetriesExceededError(answered("AccessDenied"))]
    assert [storage.unavailable(err) for err in away] == [True] * len(away)
    assert [storage.unavailable(err) for err in to_fix] == [False] * len(to_fix)


def test_local_storage_tree_operations(tmp_path):
    root = str(tmp_path / "ck")
    storage.write_bytes(storage.join(root, "step_1", ".metadata"), b"m")
    storage.write_bytes(storage.join(root, "step_1", "manifest.json"), json.dumps({}).encode())
    storage.write_bytes(storage.join(root, "step_2", "x"), b"x")
    assert storage.list_dirs(root) == ["step_1", "step_2"]
    assert storage.delete_tree(storage.join(root, "step_1")) == 2  # hidden files too
    assert storage.list_dirs(root) == ["step_2"]


GOOD = {"step": 8, "tokens": 32768, "world_size": 2, "time": 1.5e9, "model_hash": "m",
        "config_hash": "c", "files": {"__0_0.distcp": {"size": 10, "xxh3": "ab"},
                                      ".metadata": {"size": 3, "xxh3": "cd"}}}


@pytest.mark.parametrize("change, words", [
    ({}, None),
    ({"step": 4}, "says step 4"),
    ({"files": {}}, "lists no files"),
    ({"files": {"__0_0.distcp": {"size": 10, "xxh3": "ab"}}}, "does not list DCP's .metadata"),
    ({"files": {"../../x": {"size": 1, "xxh3": "a"}}}, "'../../x', which is not"),
    ({"files": {"__0_0.distcp/../y": {"size": 1, "xxh3": "a"}}}, "not a checkpoint file name"),
    ({"files": {"__0_0.distcp": {"size": "10"}}}, "entry for __0_0.distcp is malformed"),
    ({"tokens": None}, "'tokens' is missing or malformed"),
    ({"model_hash": 7}, "'model_hash' is missing"),
])
def test_manifest_problem_names_what_makes_a_commit_unusable(change, words):
    problem = manifest_problem({**GOOD, **change}, 8)
    assert problem is None if words is None else words in problem
    assert "not an object" in manifest_problem([1, 2], 8)


def test_a_quarantine_names_each_ranks_problem_and_the_rank_that_saw_it():
    """Each rank fetches only its own files, so rank 0 (which writes the marker) may not be the
    rank that found the damage."""
    assert describe_problems([None, "__1_0.distcp is missing"]) == \
        "__1_0.distcp is missing (rank 1)"
    assert describe_problems(["bad manifest"] * 3) == "bad manifest"  # read once, for all
    assert describe_problems(["a", "b", "a", None]) == "a (ranks 0, 2); b (rank 1)"
    assert describe_problems([None, None]) == "no rank said what was wrong"


def test_a_missing_file_is_not_retried():
    calls = []

    def missing():
        calls.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        with_retries(missing, "download", attempts=6, sleep=lambda s: None,
                     retry_if=lambda err: not storage.not_found(err))
    assert calls == [1]
    from botocore.exceptions import ClientError

    assert storage.not_found(ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject"))
    assert not storage.not_found(ClientError({"Error": {"Code": "SlowDown"}}, "GetObject"))


@pytest.mark.parametrize("error, message", [
    ("StoreUnavailable", "StorageUnavailable: cannot list the checkpoints: cannot reach the S3 "
     "endpoint"),
    ("CheckpointError", None),   # a problem a person must fix: no outage for the operator
])
def test_a_run_stopped_by_a_store_outage_tells_the_operator_so(tmp_path, monkeypatch, capsys,
                                                               error, message):
    """`crucible train` stopped by the store's absence (StoreUnavailable, raised by the load's
    retries: the listing probe of test_checkpoint_chaos.py raises it against a real endpoint
    nobody listens on) leaves `StorageUnavailable: <why>` as the pod's termination message, which
    the operator restarts as an outage; other checkpoint errors leave none. The loop is replaced
    by one that raises at once; the command, its config and the message file are real."""
    import argparse

    from crucible.trainer import checkpoint, loop
    from crucible.trainer.commands import train
    from tests.support.training import Corpus, job_config, write_config

    corpus = Corpus(tmp_path / "tok.json", tmp_path / "train", tmp_path / "val", 2048)
    cfg = job_config(corpus, tmp_path / "out")
    cfg["checkpoint"] = {"uri": "s3://crucible-test/run"}
    log = tmp_path / "termination-log"
    # Kubernetes creates it (the trainer writes only into one that exists); an earlier attempt
    # in the same pod (torchrun restarts its workers in place) left its own reason there.
    log.write_text("StorageUnavailable: an earlier attempt's outage")
    monkeypatch.setattr(train, "TERMINATION_LOG", str(log))

    def stopped(*_, **__):
        raise getattr(checkpoint, error)("cannot list the checkpoints: cannot reach the S3 "
                                         "endpoint for s3://crucible-test/run")
    monkeypatch.setattr(loop, "train", stopped)
    args = argparse.Namespace(config=str(write_config(cfg, tmp_path / "job.yaml")),
                              progress=False, summary_json=None, max_steps=None)
    assert train.run(args) == 2
    assert "crucible train: error: cannot list the checkpoints" in capsys.readouterr().err
    assert (log.read_text() or None) == (message and message + " for s3://crucible-test/run")


def test_a_frozen_store_fails_a_load_before_the_other_ranks_give_up_waiting():
    """Rank 0 lists and reads manifests, retried (Checkpointer's attempts, 1-2-4-8-16 s apart),
    while every other rank waits in a broadcast the process group's timeout bounds. Against a
    frozen store (connections accepted, nothing answered) each metadata call lasts at most its
    attempts x (connect + read timeout) plus botocore's backoff between them: all of that must end
    before the wait does, or the other ranks die in a collective timeout instead of stopping
    with the reason. The figures are the real clients' and the real defaults."""
    import inspect

    from crucible.trainer import checkpoint, parallel
    from crucible.trainer.checkpoint import Checkpointer

    config = storage.s3_client(metadata=True).meta.config
    attempts = config.retries["total_max_attempts"]   # botocore's: the first try and retries
    # botocore's standard mode: attempt n waits up to 2**n s before the next (capped at 20 s).
    per_call = attempts * (config.connect_timeout + config.read_timeout) + \
        sum(min(2 ** n, 20) for n in range(1, attempts))
    tries = inspect.signature(Checkpointer).parameters["upload_attempts"].default
    worst = tries * per_call + sum(2 ** n for n in range(tries - 1))   # with_retries' backoff
    # No retry starts past the deadline: the last attempt began before it.
    worst = min(worst, checkpoint.RANK0_DEADLINE_S + per_call)
    wait = inspect.signature(parallel.init_distributed).parameters["timeout_s"].default
    assert worst < 0.9 * wait, (worst, wait)
    # Downloads keep botocore's own timeouts (per socket read, not per object); each rank's are
    # waited for in an all-reduce on the checkpoint group (gloo: torch's default timeout).
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    transfer = storage.s3_client().meta.config
    assert transfer.read_timeout == 60
    per_download = transfer.retries["total_max_attempts"] * (
        transfer.connect_timeout + transfer.read_timeout) + \
        sum(min(2 ** n, 20) for n in range(1, transfer.retries["total_max_attempts"]))
    group_wait = distributed_c10d._get_default_timeout("gloo") / timedelta(seconds=1)
    assert checkpoint.DOWNLOAD_DEADLINE_S + per_download < 0.95 * group_wait, \
        (per_download, group_wait)


def test_listings_existence_checks_and_documents_use_the_metadata_client(monkeypatch):
    """What a load asks the store before any checkpoint bytes (the listing, HEADs, manifests and
    markers) and a start's claim go through the client with short timeouts; other users of
    `storage` (the corpus pipeline's polls, big listings) keep the transfer client. The calls
    are real (to a port nobody listens on); the clients asked for are recorded on the way."""
    import socket

    from crucible.trainer.checkpoint_store import CommitStore

    asked = []
    real = storage.s3_client

    def recorded(metadata=False):
        asked.append(bool(metadata))
        return real(metadata)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    real.cache_clear()
    monkeypatch.setattr(storage, "s3_client", recorded)
    store = CommitStore("s3://bucket/run", None)
    try:
        for call in (store.manifest_steps, lambda: store.read_commit(4),
                     lambda: store.claim("token", write=True)):
            with pytest.raises(Exception) as err:
                call()
            assert storage.unavailable(err.value), err.value
        assert asked and all(asked), asked
        asked.clear()
        with pytest.raises(Exception):
            storage.exists("s3://bucket/corpus/_SUCCESS")
        assert asked == [False]
    finally:
        real.cache_clear()

def test_no_retry_starts_past_the_deadline():
    """with_retries stops retrying once the next attempt would begin at or past `deadline_s`
    (ranks wait for it in a collective), and raises the last error."""
    now = [0.0]
    calls = []

    def failing():
        calls.append(now[0])
        now[0] += 30.0                       # each attempt takes 30 s
        raise TimeoutError("store frozen")
    with pytest.raises(TimeoutError):
        with_retries(failing, "read", attempts=10, deadline_s=100.0, clock=lambda: now[0],
                     sleep=lambda s: now.__setitem__(0, now[0] + s))
    # 0 -> fails at 30, +1 s; 31 -> 61, +2; 63 -> 93, +4 would start at 97 < 100; 97 -> 127:
    # next would start at 135 >= 100: stop.
    assert calls == [0.0, 31.0, 63.0, 97.0]
