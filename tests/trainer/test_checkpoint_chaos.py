"""Checkpoints survive what breaks real runs (CPU, `tiny`, torchrun, the stack's real S3 server).

Each test names the fault it injects and asserts what may be lost: nothing beyond the last
commit, and never a half-written checkpoint taken for a real one.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from crucible.trainer.checkpoint_manifest import file_digest
from tests.support.private_s3 import PrivateS3
from tests.support.services import eventually
from tests.support.training import job_config, run_crucible, write_config
from tests.trainer.chaos import (BATCH, TrainProcess, config, curve, objects, stop_and_resume,
                                 train_records)
from tests.trainer.chaos import ckpt  # noqa: F401 - a fixture: pytest finds it by its name here


def test_exact_resume_equals_a_straight_run(corpus, tmp_path, ckpt):
    """Stop after N steps and resume for N more: per-step losses bitwise equal to 2N straight."""
    uri, env = ckpt
    straight = TrainProcess(config(corpus, tmp_path, "straight", uri + "/a", steps=16, every=8),
                            tmp_path / "straight.log", env=env)
    assert straight.finish() == 0, straight.text()[-3000:]
    resumed = config(corpus, tmp_path, "resumed", uri + "/b", steps=16, every=8)
    second = stop_and_resume(resumed, tmp_path, 8, env=env)
    assert "resumed from s3://" in second and "(step 8," in second

    b = train_records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 17))
    assert curve(tmp_path / "straight" / "metrics.jsonl") == \
           curve(tmp_path / "resumed" / "metrics.jsonl")


def test_sigkill_of_a_worker_restarts_from_the_last_commit(corpus, tmp_path, ckpt):
    uri, env = ckpt
    run = TrainProcess(config(corpus, tmp_path, "kill", uri, steps=24, every=4),
                       tmp_path / "kill.log", env=env,
                       torchrun_args=["--standalone", "--max-restarts=3", "--monitor-interval=0.5"])
    try:
        run.wait_for(r"checkpoint step 8 committed")
        victim = run.workers()[-1]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        assert run.finish() == 0, run.text()[-3000:]
    finally:
        run.close()
    log = run.text()
    resumed = [int(s) for s in re.findall(r"resumed from .*?\(step (\d+),", log)]
    assert resumed and resumed[-1] >= 8, log[-3000:]
    records = train_records(tmp_path / "kill" / "metrics.jsonl")
    after = [r for r in records if r["time"] > killed_at]
    assert after[0]["step"] == resumed[-1] + 1  # nothing between the commit and the kill is kept
    assert records[-1]["step"] == 24
    steps_lost = max(r["step"] for r in records if r["time"] <= killed_at) - resumed[-1]
    assert 0 <= steps_lost <= 4 + 1  # at most one save interval (+ the step in flight)
    recovery_s = after[0]["time"] - killed_at
    assert recovery_s < 90, f"first step {recovery_s:.0f}s after the kill"
    print(f"SIGKILL -> first step after resume: {recovery_s:.1f}s, steps lost: {steps_lost}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_losing_an_agent_shrinks_the_world_and_a_new_agent_grows_it(corpus, tmp_path, ckpt):
    """Two torchrun agents on loopback as two nodes (--nnodes=1:2, c10d). SIGKILL the agent that
    does not host the c10d store: the other continues at world size 1 from the last commit;
    a new agent joins and training goes back to world size 2."""
    uri, env = ckpt
    steps = 160  # long enough that both membership changes happen before the run ends
    cfg = config(corpus, tmp_path, "elastic", uri, steps=steps, every=4)
    port = _free_port()

    def agent(name: str, host: bool) -> TrainProcess:
        return TrainProcess(cfg, tmp_path / f"{name}.log", nproc=1, env=env, torchrun_args=[
            "--nnodes=1:2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=elastic-test", f"--rdzv-conf=is_host={str(host).lower()},last_call_timeout=2",
            "--max-restarts=5", "--monitor-interval=0.5"])

    a = agent("a", host=True)
    b = agent("b", host=False)
    c = None
    jsonl = tmp_path / "elastic" / "metrics.jsonl"
    try:
        _wait_records(jsonl, lambda r: r["world_size"] == 2 and r["step"] >= 5)
        # Kill only once a commit exists: a save still uploading when b dies is abandoned, and a
        # world that shrinks before its first commit starts over from step 0, not from a commit.
        eventually(lambda: any(json.loads(line)["kind"] == "checkpoint"
                               for line in jsonl.read_text().splitlines()), 120,
                   "a committed checkpoint", interval_s=0.1)
        b.kill_group()
        _wait_records(jsonl, lambda r: r["world_size"] == 1, timeout_s=180)
        solo = train_records(jsonl)
        c = agent("c", host=False)
        _wait_records(jsonl, lambda r: r["world_size"] == 2 and r["time"] > solo[-1]["time"],
                      timeout_s=180)
        assert a.finish(timeout_s=600) == 0, a.text()[-3000:]
        assert c.finish(timeout_s=120) == 0, c.text()[-3000:]
    finally:
        for p in (a, b, c):
            if p is not None:
                p.close()
    records = train_records(jsonl)
    sizes = [r["world_size"] for r in records]
    first_solo = sizes.index(1)
    assert 2 in sizes[:first_solo] and 2 in sizes[first_solo:]
    assert records[-1]["step"] == steps
    logs = a.text() + c.text()
    assert "now 1)" in logs and "now 2)" in logs  # resumed at each world size from a commit


def _wait_records(jsonl, predicate, timeout_s: float = 120):
    return eventually(lambda: jsonl.exists() and any(predicate(r) for r in train_records(jsonl)),
                      timeout_s, "training records", interval_s=0.1)


def test_kill_during_a_save_before_its_manifest_leaves_no_checkpoint(corpus, tmp_path, ckpt, s3):
    uri, env = ckpt
    cfg = config(corpus, tmp_path, "torn", uri, steps=16, every=4)
    first = TrainProcess(cfg, tmp_path / "first.log", env=env, extra_args=["--max-steps", "4"])
    assert first.finish() == 0, first.text()[-3000:]
    torn = TrainProcess(cfg, tmp_path / "torn.log", env={**env, "CRUCIBLE_FAILPOINT": "before_manifest:120"})
    try:
        torn.wait_for(r"failpoint before_manifest")
        torn.kill_group()
    finally:
        torn.close()
    left = objects(s3, uri)
    assert "step_8/rank_0.json" in left and "step_8/rank_1.json" in left  # the save got far...
    assert "step_8/manifest.json" not in left                             # ...but not committed
    third = TrainProcess(cfg, tmp_path / "third.log", env=env)
    assert third.finish() == 0, third.text()[-3000:]
    assert "(step 4," in third.text()  # resumed from the last commit, not the torn step 8
    assert "step_8/manifest.json" in objects(s3, uri) or "step_16/manifest.json" in objects(s3, uri)


def test_s3_outage_during_an_upload_is_retried_and_training_goes_on(corpus, tmp_path):
    server = PrivateS3.create(tmp_path / "s3")
    server.start()
    uri = "s3://crucible/outage"
    cfg = config(corpus, tmp_path, "outage", uri, steps=20, every=4)
    run = TrainProcess(cfg, tmp_path / "outage.log",
                       env={**server.env(), "CRUCIBLE_FAILPOINT": "before_upload:3"})
    jsonl = tmp_path / "outage" / "metrics.jsonl"
    try:
        run.wait_for(r"checkpoint of step 4 started")
        server.stop()
        down_at = time.time()
        time.sleep(6)
        server.start()
        assert run.finish() == 0, run.text()[-3000:]
    finally:
        run.close()
        server.stop()
    log = run.text()
    assert "retry 1/" in log, log[-3000:]
    trained_while_down = [r for r in train_records(jsonl) if down_at < r["time"] < down_at + 6]
    assert trained_while_down  # the loop did not wait for the store
    commits = [int(s) for s in re.findall(r"checkpoint step (\d+) committed", log)]
    assert commits and max(commits) == 20


def _flip_a_byte(client, bucket: str, step: str) -> None:
    key = f"{step}/__1_0.distcp"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def _truncate_the_manifest(client, bucket: str, step: str) -> None:
    key = f"{step}/manifest.json"
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=data[:len(data) // 2])


def _delete_a_shard(client, bucket: str, step: str) -> None:
    client.delete_object(Bucket=bucket, Key=f"{step}/__0_0.distcp")


def _escape_the_restore_folder(client, bucket: str, step: str) -> None:
    """A manifest that names a file outside its step (as an attacker or a bug might)."""
    key = f"{step}/manifest.json"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    manifest["files"]["../../x"] = manifest["files"].pop("__0_0.distcp")
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())


# Where the planted index would leave its mark if it ever ran.
SENTINEL = Path(tempfile.gettempdir()) / f"crucible-planted-{os.getpid()}"


class _Planted:
    """Unpickling this runs a shell command: what a writer of the bucket could plant."""

    def __reduce__(self):
        return os.system, (f"touch {SENTINEL}",)


def _plant_code_in_the_index(client, bucket: str, step: str) -> None:
    """Someone who can write the bucket replaces DCP's `.metadata` with a pickle that runs code,
    and fixes the manifest's size and checksum to match: the checksums catch accidents, not
    this."""
    planted = Path(tempfile.mkdtemp()) / ".metadata"
    planted.write_bytes(pickle.dumps(_Planted()))
    client.put_object(Bucket=bucket, Key=f"{step}/.metadata", Body=planted.read_bytes())
    key = f"{step}/manifest.json"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    manifest["files"][".metadata"] = file_digest(planted)
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())


def test_a_store_that_hangs_stops_no_step_and_the_first_save_after_it_commits(corpus, tmp_path):
    """A frozen S3 (SIGSTOP: connections accepted, never answered) for longer than two save
    intervals: the save in flight waits for it, every save due meanwhile is skipped (waiting for
    the one in flight would stop training), training goes on, and a save after the thaw commits."""
    server = PrivateS3.create(tmp_path / "s3")
    server.start()
    every, freeze_s, steps = 3, 10, 150     # ~0.2 s a step: most steps come after the thaw
    cfg = config(corpus, tmp_path, "hang", "s3://crucible/hang", steps=steps, every=every)
    run = TrainProcess(cfg, tmp_path / "hang.log", env=server.env())
    jsonl = tmp_path / "hang" / "metrics.jsonl"
    try:
        run.wait_for(rf"checkpoint step {every} committed")
        server.freeze()
        frozen_at = time.time()
        time.sleep(freeze_s)
        thawed_at = time.time()
        server.thaw()
        assert run.finish() == 0, run.text()[-3000:]
    finally:
        run.close()
        server.stop()
    log = run.text()
    assert re.search(r"checkpoint of step \d+ skipped: the save of step \d+ is still in flight", log), \
        log[-3000:]
    steps_while_frozen = [r["step"] for r in train_records(jsonl) if frozen_at < r["time"] < thawed_at]
    # More than two intervals: saves came due while the store hung, and none stopped the loop.
    assert len(steps_while_frozen) > 2 * every, (steps_while_frozen, log[-3000:])
    commits = [int(s) for s in re.findall(r"checkpoint step (\d+) committed", log)]
    # A save started after the thaw commits (not only the last one, which always waits).
    assert max(commits) == steps, commits
    assert any(max(steps_while_frozen) < c < steps for c in commits), (commits, steps_while_frozen)


@pytest.mark.parametrize("damage, reason", [
    (_flip_a_byte, "__1_0.distcp: size/checksum"),
    (_truncate_the_manifest, "the manifest is not valid JSON"),
    (_delete_a_shard, "__0_0.distcp cannot be downloaded"),
    (_escape_the_restore_folder, "the manifest lists '../../x'"),
    (_plant_code_in_the_index, ".metadata would load posix.system"),
], ids=lambda v: getattr(v, "__name__", "")[1:] if callable(v) else None)
def test_an_unloadable_newest_commit_is_quarantined_and_the_previous_one_loaded(
        corpus, tmp_path, ckpt, s3, damage, reason):
    uri, env = ckpt
    env = {**env, "TMPDIR": str(tmp_path / "tmp")}  # the restore folder lives under it
    (tmp_path / "tmp").mkdir()
    cfg = config(corpus, tmp_path, "corrupt", uri, steps=12, every=4)
    first = TrainProcess(cfg, tmp_path / "first.log", env=env, extra_args=["--max-steps", "8"])
    assert first.finish() == 0, first.text()[-3000:]
    bucket, _, prefix = uri[5:].partition("/")
    damage(s3.client(), bucket, f"{prefix}/step_8")
    second = TrainProcess(cfg, tmp_path / "second.log", env=env)
    assert second.finish() == 0, second.text()[-3000:]
    log = second.text()
    assert f"step_8 is corrupt: {reason}" in log and "quarantined, falling back" in log, log[-3000:]
    assert "(step 4," in log                       # resumed from the previous good commit
    # Both ranks loaded it, also when only one of them reads the damaged file (rank 0 logs what
    # each rank fetched, once every rank has loaded).
    assert "step_4: rank 0 fetched" in log and "step_4: rank 1 fetched" in log, log[-3000:]
    assert "retry 1/" not in log                   # nothing waited on a file that is not there
    assert not list((tmp_path / "tmp").rglob("x"))  # nothing written outside the restore folder
    assert not SENTINEL.exists()                   # nothing planted ran


def test_one_ranks_failed_upload_abandons_the_save_everywhere_without_a_stall(
        corpus, tmp_path, ckpt, s3):
    """Rank 1 cannot upload its part of any save: rank 0 must not wait for its marker (it used
    to poll for 600 s while the next save blocked behind it), and nothing is committed."""
    uri, env = ckpt
    run = TrainProcess(config(corpus, tmp_path, "upload", uri, steps=12, every=4),
                       tmp_path / "upload.log", env={**env, "CRUCIBLE_FAILPOINT": "upload:fail@1"})
    assert run.finish() == 0, run.text()[-3000:]
    log = run.text()
    assert "rank 1's part failed" in log, log[-3000:]
    assert not re.search(r"checkpoint step \d+ committed", log)
    blocking = [float(b) for b in re.findall(r"checkpoint of step \d+ started \(([\d.]+)s", log)]
    # Steps 4, 8 and the last, 12; one due while the one before is still failing is skipped, not
    # waited for (the machine's load decides), but the first and the last are always started.
    skipped = re.findall(r"checkpoint of step (\d+) skipped", log)
    assert 2 <= len(blocking) and len(blocking) + len(skipped) >= 3, (blocking, skipped)
    assert max(blocking) < 5, blocking
    assert log.count("abandoned, not committed: a rank's part failed") >= 2 * len(blocking)
    assert not [k for k in objects(s3, uri) if k.endswith("manifest.json")]


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_mid_save_finishes_the_save_and_exits_as_infrastructure(
        corpus, tmp_path, ckpt, s3, nproc):
    """A pod being deleted gets SIGTERM, then SIGKILL after its grace period: every rank stops
    after the same step, the save in flight commits, and the exit code is 128+15 (what the
    operator counts as infrastructure, not against maxRestarts)."""
    uri, env = ckpt
    run = TrainProcess(config(corpus, tmp_path, "term", uri, steps=200, every=4),
                       tmp_path / "term.log", nproc=nproc,
                       env={**env, "CRUCIBLE_FAILPOINT": "before_upload:4"})
    try:
        run.wait_for(r"checkpoint of step 4 started")
        os.kill(run.proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        code = run.finish(timeout_s=60)
    finally:
        run.close()
    log = run.text()
    assert "SIGTERM: stopped after step" in log, log[-3000:]
    assert "checkpoint step 4 committed" in log, log[-3000:]
    assert "step_4/manifest.json" in objects(s3, uri)
    assert time.monotonic() - signalled < 30
    if nproc == 1:
        assert code == 143, log[-3000:]


def test_a_stale_incarnation_neither_commits_nor_prunes(corpus, tmp_path, ckpt, s3):
    """A newer start of the job claims the URI while this one is in the middle of a save (a pod
    still terminating after its replacement started): the old one must not commit."""
    uri, env = ckpt
    run = TrainProcess(config(corpus, tmp_path, "stale", uri, steps=8, every=4),
                       tmp_path / "stale.log", nproc=1,
                       env={**env, "CRUCIBLE_FAILPOINT": "before_manifest:6"})
    bucket, _, prefix = uri[5:].partition("/")
    try:
        run.wait_for(r"checkpoint of step 4 started")
        s3.client().put_object(Bucket=bucket, Key=f"{prefix}/incarnation.json",
                               Body=json.dumps({"token": "newer", "time": time.time()}).encode())
        assert run.finish(timeout_s=300) == 0, run.text()[-3000:]
    finally:
        run.close()
    log = run.text()
    assert "cannot commit step 4: a newer start of this job owns" in log, log[-3000:]
    assert not re.search(r"checkpoint step \d+ committed", log)
    assert not [k for k in objects(s3, uri) if k.endswith("manifest.json")]


def test_resume_with_a_changed_global_batch_is_refused_in_one_line_unless_accepted(
        corpus, tmp_path, ckpt):
    """Continuing with another batch would skip or repeat samples: say so, and lose nothing;
    with checkpoint.acceptChangedBatch, continue with the tokens left at the new batch."""
    uri, env = ckpt
    first = TrainProcess(config(corpus, tmp_path, "batch", uri, steps=8, every=4),
                         tmp_path / "first.log", env=env, extra_args=["--max-steps", "4"])
    assert first.finish() == 0, first.text()[-3000:]
    cfg = job_config(corpus, tmp_path / "batch2", name="chaos", steps=8, batch_tokens=2 * BATCH,
                     evalTokens=4096)
    cfg["checkpoint"] = {"uri": uri, "everySteps": 4, "everyMinutes": 0, "keep": 3}
    run = run_crucible("train", "--config", str(write_config(cfg, tmp_path / "batch2.yaml")),
                       env=env)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "cannot resume" in run.stderr and f"trained with {BATCH}" in run.stderr
    assert "acceptChangedBatch" in run.stderr and "Traceback" not in run.stderr
    # Accepted: the 4 steps' worth of tokens left of the first run's budget, 2 steps at 2x.
    cfg["training"]["tokens"] = 8 * BATCH
    cfg["checkpoint"]["acceptChangedBatch"] = True
    run = run_crucible("train", "--config", str(write_config(cfg, tmp_path / "batch3.yaml")),
                       env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"global batch {BATCH} -> {2 * BATCH} tokens (accepted)" in run.stdout
    steps = train_records(tmp_path / "batch2" / "metrics.jsonl")
    assert [(r["step"], r["tokens"]) for r in steps] == [(5, 6 * BATCH), (6, 8 * BATCH)]


def test_bad_credentials_fail_before_any_training_step(corpus, tmp_path, ckpt):
    uri, env = ckpt
    cfg = config(corpus, tmp_path, "creds", uri, steps=8)
    run = run_crucible("train", "--config", str(cfg), env={**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert "checkpoint storage is not usable: S3 refused the credentials" in run.stderr
    assert "not-the-secret" not in run.stderr + run.stdout  # never echo a secret
    jsonl = tmp_path / "creds" / "metrics.jsonl"
    assert "\nstep " not in run.stdout and (not jsonl.exists() or not train_records(jsonl))


# The start of a probe script: a one-rank gloo world and a small model's state to checkpoint.
ONE_RANK_APP = textwrap.dedent("""
    import json, socket, sys
    import torch
    import torch.distributed as dist
    from crucible.api.spec import CheckpointSpec
    from crucible.trainer.checkpoint import AppState, Checkpointer, CheckpointError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.Linear(4, 4)
    app = AppState(model, torch.optim.AdamW(model.parameters()), {})
""")

LISTING_PROBE = ONE_RANK_APP + textwrap.dedent("""
    import os, threading
    import boto3
    from crucible.trainer import storage
    out = {}
    for case, bucket in (("comes back", sys.argv[1]), ("stays away", sys.argv[2])):
        ckpt = Checkpointer(CheckpointSpec(uri=f"s3://{bucket}/run"), job="probe", rank=0,
                            world_size=1, local_rank=0, model_hash="m", config_hash="c",
                            upload_attempts=4)
        print(f"=== {case}", file=sys.stderr, flush=True)
        if case == "comes back":   # the bucket appears 1 s into the listing's 7 s of retries
            threading.Timer(1.0, boto3.client("s3").create_bucket, kwargs={"Bucket": bucket}).start()
            out[case] = ckpt.load(app)
            continue
        for name, call in (("load", lambda: ckpt.load(app)), ("newest", ckpt.newest_committed)):
            try:
                out[f"{case}: {name}"] = call()
            except CheckpointError as err:
                out[f"{case}: {name}"] = f"{type(err).__name__}: {err}"
    # A store that does not answer at all (nothing listens on the endpoint's port): an outage.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); closed = s.getsockname()[1]
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{closed}"
    storage.s3_client.cache_clear()
    ckpt = Checkpointer(CheckpointSpec(uri=f"s3://{sys.argv[2]}/run"), job="probe", rank=0,
                        world_size=1, local_rank=0, model_hash="m", config_hash="c",
                        upload_attempts=2)
    try:
        ckpt.load(app)
    except CheckpointError as err:
        out["unreachable"] = f"{type(err).__name__}: {err}"
    # A start's storage probe and claim, each tried once here (botocore's own retries inside).
    ckpt.upload_attempts = 1
    for name, call in (("probe", ckpt.probe), ("claim", ckpt.claim)):
        try:
            call()
        except CheckpointError as err:
            out[f"unreachable: {name}"] = f"{type(err).__name__}: {err}"
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def test_a_load_waits_out_a_store_that_is_briefly_away_and_names_one_that_stays_away(ckpt, s3):
    """The listing a load (a start, a rollback) begins with is retried with backoff: a store that
    answers errors for a while (restarting) is waited for; one that stays away stops every rank
    with one line that says what is wrong, not a traceback on rank 0 and a hang on the rest."""
    _, env = ckpt
    late, never = f"late-{secrets.token_hex(4)}", f"never-{secrets.token_hex(4)}"
    run = subprocess.run([sys.executable, "-c", LISTING_PROBE, late, never], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env})
    if late in {b["Name"] for b in s3.client().list_buckets()["Buckets"]}:
        s3.client().delete_bucket(Bucket=late)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    came_back, stayed_away = run.stderr.split("=== stays away")
    assert out["comes back"] is None, out   # listed once the bucket was there: nothing to load
    assert "list the checkpoints failed" in came_back   # ... after at least one retry
    for call in ("load", "newest"):   # a start, a rollback; the memory tier's newest commit
        # A missing bucket is for a person to fix: a plain CheckpointError (the operator counts
        # the failure), not an outage.
        assert out[f"stays away: {call}"].startswith(
            f"CheckpointError: cannot list the checkpoints: bucket of s3://{never}/run does not "
            "exist"), out
    assert stayed_away.count("retry 3/3") == 2 and "Traceback" not in run.stderr
    # No store at the endpoint: StoreUnavailable, which `crucible train` reports as an outage,
    # from the listing, the start's storage probe and its claim alike.
    assert out["unreachable"].startswith("StoreUnavailable: cannot list the checkpoints: cannot "
                                         "reach the S3 endpoint"), out
    assert out["unreachable: probe"].startswith("StoreUnavailable: checkpoint storage is not "
                                                "usable: cannot reach the S3 endpoint"), out
    assert out["unreachable: claim"].startswith("StoreUnavailable: cannot claim the checkpoints: "
                                                "cannot reach the S3 endpoint"), out


# ... and two commits (steps 4 and 8) under the URI argv[1], with `attempts` tries per read.
TWO_COMMITS = ONE_RANK_APP + textwrap.dedent("""
    from botocore.exceptions import ReadTimeoutError
    from crucible.trainer import storage
    ckpt = Checkpointer(CheckpointSpec(uri=sys.argv[1], keep=3, **{"async": False}), job="probe",
                        rank=0, world_size=1, local_rank=0, model_hash="m", config_hash="c",
                        upload_attempts=ATTEMPTS)
    ckpt.save(app, 4, 400, wait=True)
    ckpt.save(app, 8, 800, wait=True)
""")

# ... and the end of such a probe: a load while `storage.PATCHED` fails, the patch undone
# (`REAL`), and what the store holds and loads then.
OUTAGE_THEN_BACK = textwrap.dedent("""
    try:
        out["loaded"] = ckpt.load(app)["step"]
    except CheckpointError as err:
        out["outage"], out["outage class"] = str(err), type(err).__name__
    storage.PATCHED = REAL
    out["committed"] = ckpt.store.committed_steps()
    out["loaded after"] = ckpt.load(app)["step"]
    print(json.dumps(out))
    dist.destroy_process_group()
""")

MANIFEST_READ_PROBE = TWO_COMMITS.replace("ATTEMPTS", "3") + textwrap.dedent("""
    real_read, failures = storage.read_bytes, {"left": 2}
    def flaky(uri, **kw):
        if "step_8/manifest" in uri and failures["left"] > 0:
            failures["left"] -= 1
            raise ReadTimeoutError(endpoint_url="http://s3:8333")
        return real_read(uri, **kw)
    storage.read_bytes = flaky
    out = {"blip": ckpt.load(app)["step"]}
    failures["left"] = 10**6
""") + OUTAGE_THEN_BACK.replace("PATCHED", "read_bytes").replace("REAL", "real_read")


READ_ONLY_PROBE = ONE_RANK_APP + textwrap.dedent("""
    from pathlib import Path
    def checkpointer(**kw):
        return Checkpointer(CheckpointSpec(uri=sys.argv[1], keep=3, **{"async": False}),
                            job="probe", rank=0, world_size=1, local_rank=0, model_hash="m",
                            config_hash="c", **kw)
    writer = checkpointer()
    writer.save(app, 4, 400, wait=True)
    writer.save(app, 8, 800, wait=True)
    data = max((p for p in (Path(sys.argv[1]) / "step_8").rglob("*") if p.is_file()
                and p.name not in ("manifest.json", ".metadata")), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-16])   # step 8 damaged
    out = {"reader": checkpointer(read_only=True).load(app)["step"],
           "after the reader": checkpointer().store.committed_steps()}
    out["run"] = checkpointer().load(app)["step"]
    out["after the run"] = checkpointer().store.committed_steps()
    print(json.dumps(out))
    dist.destroy_process_group()
""")


def test_a_read_only_load_beside_the_run_marks_nothing(tmp_path):
    """`crucible eval` / `export` load with read_only: a commit they cannot load is skipped, not
    quarantined. Their failure may be their own (node, disk, network), and a marker would take the
    commit from the training run, whose retention then deletes it. The run's own load still
    quarantines a commit that really is damaged."""
    uri = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, "-c", READ_ONLY_PROBE, str(uri)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["reader"] == 4 and out["after the reader"] == [4, 8], out
    assert "skipped (a read-only load marks nothing)" in run.stderr
    assert out["run"] == 4 and out["after the run"] == [4], out
    assert (uri / "step_8" / "quarantine.json").exists()


def test_a_store_failing_a_manifest_read_quarantines_nothing(tmp_path):
    """A manifest read that fails for the store's sake (a timeout, a restart) says nothing about
    the commit: it is retried, and if the store stays away the run stops in one line, the commit
    kept; quarantining it, as a corrupt one, would lose it for good. A real store cannot be made
    to time out on one object on cue here: `storage.read_bytes` raises botocore's own
    ReadTimeoutError for that manifest instead (the rest is real: files, manifests, markers)."""
    uri = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, "-c", MANIFEST_READ_PROBE, str(uri)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["blip"] == 8 and "read step_8's manifest failed" in run.stderr
    assert out["outage"].startswith("cannot read step_8's manifest: cannot reach the S3 "
                                    "endpoint"), out
    assert out["outage class"] == "StoreUnavailable" and "loaded" not in out, out
    assert out["committed"] == [4, 8] and out["loaded after"] == 8
    assert not list(uri.glob("*/quarantine*")) and "quarantined" not in run.stderr


DOWNLOAD_PROBE = TWO_COMMITS.replace("ATTEMPTS", "2") + textwrap.dedent("""
    real_download = storage.download_file
    from boto3.exceptions import RetriesExceededError
    def frozen(uri, local):
        if "/step_8/" in uri:   # what boto3's download_file raises once every try's body stalled
            raise RetriesExceededError(ReadTimeoutError(endpoint_url="http://s3:8333"))
        return real_download(uri, local)
    storage.download_file = frozen
    out = {}
""") + OUTAGE_THEN_BACK.replace("PATCHED", "download_file").replace("REAL", "real_download")


def test_a_store_failing_a_download_stops_the_load_and_quarantines_nothing(ckpt):
    """A checkpoint file the store fails to serve through the retries (a timeout: the store
    frozen) says nothing about the commit: the load stops with StoreUnavailable, the model
    unchanged, and the commit stays; once the store answers it loads. A real store cannot be
    made to stall one object's body on cue here: `storage.download_file` raises for that step's
    files what boto3's own download_file raises then, a RetriesExceededError around botocore's
    ReadTimeoutError (the store, files and manifests are real)."""
    uri, env = ckpt
    run = subprocess.run([sys.executable, "-c", DOWNLOAD_PROBE, uri], capture_output=True,
                         text=True, timeout=180, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "loaded" not in out, out          # not a fall back to step 4: step 8 is not corrupt
    assert out["outage class"] == "StoreUnavailable", out
    assert out["outage"].startswith("cannot fetch step_8: .metadata cannot be downloaded "
                                    "(cannot reach the S3 endpoint"), out
    assert out["committed"] == [4, 8] and out["loaded after"] == 8, out
    assert "quarantined" not in run.stderr
