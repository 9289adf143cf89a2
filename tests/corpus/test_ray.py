"""The corpus pipeline on a real Ray cluster on this machine: a head that runs no tasks and two
one-CPU worker nodes (ray.cluster_utils.Cluster), shared by the module.

Checks: two Ray workers write byte-identical files to the local runner's (report fields that are
timings excepted, and only those); a worker node killed while a stage's tasks run costs a retry,
not a difference in the output; the utilisation report adds up; the CLI prints it, and turns a bad
address, an unreachable cluster or a bad --ray-resources into one line with a hint. The parsing and
classification functions get plain unit tests.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from crucible.trainer.cli import main
from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus import pipeline, ray_runner
from crucible.trainer.corpus.ray_runner import (ResourceError, StageResources, StageUsage,
                                                parse_stage_resources, transient)
from tests.corpus.test_pipeline import config_dict, raw  # noqa: F401 - `raw` is a fixture

ray = pytest.importorskip("ray")   # a trainer dependency: absent only without the trainer extra

SHARDS = 4
DELAY_S = 1.0     # each task of the stage a node is killed in: long enough to be caught running
OBJECT_STORE_BYTES = 100 * 2**20   # tasks return floats; the store holds the config and results


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes(timeout=60)
    try:
        yield cluster
    finally:
        cluster.shutdown()


# ---- comparing two output folders -------------------------------------------------------------
TIMING_FIELDS = ("time_s", "docs_per_s")   # per step: measured durations, nothing else


def untimed(value):
    """A report or stats JSON value without its timing fields, at any depth."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if k not in TIMING_FIELDS}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def html_untimed(text: str) -> str:
    # report_html prints each step's "; <time_s> s[, <docs_per_s> docs/s]" after its parameters.
    return re.sub(r"; [0-9.]+ s(, [0-9,.]+ docs/s)?</p>", "; TIME</p>", text)


def assert_same_outputs(ours: Path, theirs: Path) -> int:
    """Every file under both folders is equal: bytes, except timings in JSON stats, report.json
    and report.html. Returns how many files were compared."""
    files = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    for rel in files:
        a, b = (ours / rel).read_bytes(), (theirs / rel).read_bytes()
        if rel.suffix == ".json" and (rel.parts[0] == "stats" or rel.name == "report.json"):
            ja, jb = json.loads(a), json.loads(b)
            assert untimed(ja) == untimed(jb), rel
            if rel.name == "report.json":
                steps = ja["steps"]
                assert all(set(s) - set(untimed(s)) == set(TIMING_FIELDS) for s in steps)
        elif rel.name == "report.html":
            assert html_untimed(a.decode()) == html_untimed(b.decode()), rel
        else:
            assert a == b, rel
    return len(files)


@pytest.fixture(scope="module")
def local_run(raw, tmp_path_factory):  # noqa: F811 - the imported fixture
    """The local runner's output, moved aside so that the Ray runs can write the same path (the
    output folder is part of run.json and report.json)."""
    root = tmp_path_factory.mktemp("ray-vs-local")
    cfg = corpus_config.from_dict(config_dict(raw, root / "out"))
    pipeline.run_local(cfg, SHARDS, workers=1)
    (root / "out").rename(root / "local")
    return root, cfg


@pytest.fixture(scope="module")
def ray_run(cluster, local_run):
    root, cfg = local_run
    shutil.rmtree(root / "out", ignore_errors=True)
    run = ray_runner.run_ray(cfg, SHARDS, address=cluster.address)
    (root / "out").rename(root / "ray")
    return root, run


# ---- the pipeline on Ray ----------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_two_ray_workers_write_what_the_local_runner_writes(local_run, ray_run):
    root, run = ray_run
    assert assert_same_outputs(root / "ray", root / "local") > 20
    # The local run's steps, read back from its output (components runs until it converges).
    local = pipeline.Job(dataclasses.replace(local_run[1], output=str(root / "local")), SHARDS)
    order = list(local.run_order())
    assert "components.1" in [s.name for s in order]
    assert [s.stage for s in run.stages] == [s.name for s in order]
    assert [s.tasks_run for s in run.stages] == [s.tasks for s in order]


@pytest.mark.timeout(240)
def test_utilisation_report_adds_up(ray_run):
    _, run = ray_run
    for usage in run.stages:
        assert usage.cluster_cpus == 2.0                     # two one-CPU workers, a 0-CPU head
        assert usage.wall_s > 0 and usage.busy_cpu_s > 0
        assert usage.reserved_cpu_s == pytest.approx(2.0 * usage.wall_s)
        assert usage.busy_cpu_s + usage.idle_cpu_s == pytest.approx(usage.reserved_cpu_s)
        assert usage.idle_cpu_s >= 0 and 0 < usage.busy_share <= 1
    print(ray_runner.usage_table(run.stages))                # the measured figures, in the log
    table = ray_runner.usage_table(run.stages).splitlines()
    assert len(table) == len(run.stages) + 2
    total = table[-1].split()
    busy, idle, reserved = (float(x) for x in total[4:7])
    assert busy + idle == pytest.approx(reserved, abs=0.02)  # printed to two decimals


def setup_hook(log: Path, slow_stage: str, delay_s: float):
    """A Ray worker setup hook (runs in every worker process of the job) that logs each task
    attempt's start and end with its node, and delays the tasks of `slow_stage` so that a node
    can be killed while they run. The stage code itself is untouched."""
    def hook():
        import time as clock

        import ray as worker_ray
        from crucible.trainer.corpus import pipeline as worker_pipeline

        original = worker_pipeline._run_task

        def traced(config, shard_count, progress, stage_name, task):
            node = worker_ray.get_runtime_context().get_node_id()
            with open(log, "a") as out:
                out.write(f"start {stage_name} {task} {node} {clock.time()}\n")
            if stage_name == slow_stage:
                clock.sleep(delay_s)
            seconds = original(config, shard_count, progress, stage_name, task)
            with open(log, "a") as out:
                out.write(f"end {stage_name} {task} {node} {clock.time()}\n")
            return seconds

        worker_pipeline._run_task = traced
    return hook


def attempts(log: Path, stage: str) -> list[tuple[str, int, str, float]]:
    """(start|end, task, node id, wall-clock time) of each attempt of `stage`'s tasks."""
    if not log.exists():
        return []
    return [(kind, int(task), node, float(at)) for kind, name, task, node, at in
            (line.split() for line in log.read_text().splitlines()) if name == stage]


@pytest.mark.timeout(300)
def test_a_worker_node_killed_mid_stage_costs_a_retry_not_the_output(cluster, local_run, tmp_path):
    root, cfg = local_run
    shutil.rmtree(root / "out", ignore_errors=True)
    stages = pipeline.Job(cfg, SHARDS).stages()
    slow = max(stages, key=lambda s: s.tasks)      # the widest stage, whatever the list becomes
    assert slow.tasks >= 4
    log = tmp_path / "attempts.log"
    victim = sorted(cluster.worker_nodes, key=lambda n: n.node_id)[0]
    result: dict = {}

    def run() -> None:
        try:
            result["run"] = ray_runner.run_ray(
                cfg, SHARDS, address=cluster.address,
                runtime_env={"worker_process_setup_hook": setup_hook(log, slow.name, DELAY_S)})
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread below
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 180
    while True:   # kill once some of the stage's tasks ended and the victim has just begun one
        seen = attempts(log, slow.name)
        ended = {task for kind, task, _, _ in seen if kind == "end"}
        running_on_victim = {task for kind, task, node, at in seen
                             if kind == "start" and node == victim.node_id
                             and time.time() - at < DELAY_S / 2} - ended
        if ended and running_on_victim:
            break
        assert time.monotonic() < deadline and thread.is_alive(), f"never mid-stage: {seen}"
        time.sleep(0.02)
    markers_at_kill = len(list((root / "out" / "done" / slow.name).glob("*")))
    cluster.remove_node(victim)
    thread.join(timeout=240)
    try:
        assert not thread.is_alive() and "error" not in result, result.get("error")
        assert 0 < markers_at_kill < slow.tasks          # the kill landed mid-stage
        seen = attempts(log, slow.name)
        for task in running_on_victim:                   # its task ran again, elsewhere, to the end
            assert [n for k, t, n, _ in seen if t == task and k == "start"][-1] != victim.node_id
            assert any(k == "end" and t == task and n != victim.node_id for k, t, n, _ in seen)
        assert {t for k, t, _, _ in seen if k == "end"} == set(range(slow.tasks))
        assert assert_same_outputs(root / "out", root / "local") > 20
    finally:
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
        cluster.wait_for_nodes(timeout=60)


# ---- the command line -------------------------------------------------------------------------
def small_config(raw: Path, tmp_path: Path) -> Path:  # noqa: F811
    cfg = config_dict(raw, tmp_path / "cli")
    cfg["sources"], cfg["mixture"] = cfg["sources"][:1], None
    path = tmp_path / "corpus.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(240)
def test_cli_runs_on_ray_and_prints_a_line_per_stage_and_the_table(
        cluster, raw, tmp_path, capsys):  # noqa: F811
    path = small_config(raw, tmp_path)
    argv = ["corpus", "run", "--config", str(path), "--shards", "2", "--ray", cluster.address,
            "--ray-resources", "clusters=cpu:1,memory:64Mi"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    stages = [s.name for s in pipeline.Job(corpus_config.load(path.read_text()), 2).run_order()]
    assert [line.split()[1] for line in out if re.match(r"stage \S+ done: ", line)] == stages
    header = next(i for i, line in enumerate(out) if line.startswith("stage") and "busy" in line)
    assert [line.split()[0] for line in out[header + 1:header + 2 + len(stages)]] == \
        stages + ["total"]
    assert (tmp_path / "cli" / "report.html").is_file()


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("crucible corpus: error: ")
    lines = err.strip().splitlines()
    assert len(lines) <= 2 and all(line.startswith("  hint: ") for line in lines[1:]), err
    return lines[0]


def test_cli_bad_address_or_resources_is_one_line(raw, tmp_path, capsys):  # noqa: F811
    path = small_config(raw, tmp_path)
    base = ["corpus", "run", "--config", str(path), "--ray"]
    with socket_nobody_listens_on() as port:
        line = one_line_error(capsys, base + [f"127.0.0.1:{port}"])
    assert f"cannot reach Ray at 127.0.0.1:{port}" in line
    assert "want auto, host:port" in one_line_error(capsys, base + ["http://head"])
    assert "want auto, host:port" in one_line_error(capsys, base + ["ray://head:port"])
    assert "no stage bucket " in one_line_error(capsys, base + ["127.0.0.1:1", "--ray-resources",
                                                                "bucket=cpu:1"])
    assert "cpu:N or memory:Q" in one_line_error(capsys, base + ["--ray-resources", "filter=gpu:1"])
    assert "--shard" in one_line_error(capsys, base + ["--shard", "0/2"])
    assert not (tmp_path / "cli").exists()      # nothing written before the cluster was reached


class socket_nobody_listens_on:
    """A local port that was just free: bound and closed, so a connect is refused."""

    def __enter__(self) -> int:
        import socket

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        return self.port

    def __exit__(self, *exc) -> None:
        return None


def test_crucible_help_does_not_import_ray():
    probe = ("import sys\nsys.argv = ['crucible', 'corpus', 'run', '--help']\n"
             "from crucible.trainer import cli\n"
             "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
             "print('RAY' if 'ray' in sys.modules else 'NO-RAY')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO-RAY")


# ---- pure parts ---------------------------------------------------------------------------------
def test_stage_resources_parse_and_validate():
    assert parse_stage_resources("buckets=cpu:1,memory:2Gi") == (
        "buckets", StageResources(1.0, 2 * 2**30))
    assert parse_stage_resources("clusters=memory:1500M") == (
        "clusters", StageResources(1.0, 1_500_000_000))
    assert parse_stage_resources("filter=cpu:0.5") == ("filter", StageResources(0.5, None))
    for bad, why in [("buckets", "STAGE=cpu:N"), ("buckets=", "STAGE=cpu:N"),
                     ("buckets=cpu:x", "not a number"), ("buckets=cpu:0", "cpu must be > 0"),
                     ("buckets=memory:2GB", "memory '2GB'"),
                     ("buckets=cpu:1,cpu:2", "at most once"),
                     ("buckets=disk:1", "cpu:N or memory:Q")]:
        with pytest.raises(ResourceError, match=why):
            parse_stage_resources(bad)
    needs = ray_runner.resources_by_stage(["filter", "clusters"],
                                          {"clusters": StageResources(1.0, 2**30)})
    assert needs == {"filter": StageResources(), "clusters": StageResources(1.0, 2**30)}
    with pytest.raises(ResourceError, match="no stage cluster in this run; its stages: filter, clu"):
        ray_runner.resources_by_stage(["filter", "clusters"], {"cluster": StageResources()})
    nodes = [{"CPU": 1.0, "memory": 2.0 * 2**30}, {"memory": 8.0 * 2**30}]   # a 0-CPU head
    assert ray_runner.unschedulable(needs, nodes) == []
    [problem] = ray_runner.unschedulable({"dedup": StageResources(2.0, None)}, nodes)
    assert problem.startswith("stage dedup wants cpu 2 per task; the largest node has cpu 1")


def test_only_storage_hiccups_are_retried():
    class EndpointConnectionError(Exception):     # botocore's, by name
        pass

    class ClientError(Exception):
        def __init__(self, code: str):
            super().__init__(code)
            self.response = {"Error": {"Code": code}}

    assert transient(ConnectionResetError()) and transient(TimeoutError())
    assert transient(EndpointConnectionError()) and transient(ClientError("SlowDown"))
    assert transient(ClientError("503"))
    wrapped = ValueError("reading shard 3")
    wrapped.__cause__ = ConnectionResetError()
    assert transient(wrapped)
    for permanent in (ValueError("bad config"), FileNotFoundError("s3://b/k"), PermissionError(),
                      ClientError("AccessDenied"), ClientError("NoSuchBucket"), KeyError("x")):
        assert not transient(permanent), permanent


def test_usage_arithmetic_and_table():
    usage = StageUsage("buckets", tasks_run=14, tasks_skipped=0, wall_s=2.0, cluster_cpus=2.0,
                       busy_cpu_s=3.0)
    assert (usage.reserved_cpu_s, usage.idle_cpu_s, usage.busy_share) == (4.0, 1.0, 0.75)
    table = ray_runner.usage_table([usage, StageUsage("report", 0, 1, 0.0, 2.0, 0.0)])
    assert table.splitlines()[-1].split() == ["total", "14", "1", "2.00", "3.00", "1.00", "4.00",
                                             "75%"]
