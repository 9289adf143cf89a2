"""Running a corpus Job on a Ray cluster: one Ray task per pipeline task, stage after stage.

Owns: `run_ray` (connect, pin run.json, submit every unfinished task of a stage, wait for all of
them, next stage), the per-stage resources a task reserves (`StageResources`, parsed from
`STAGE=cpu:N,memory:Q`), which task failures Ray retries (`transient`), and the utilisation report
(`StageUsage`, `usage_table`). Must not: contain stage code. A Ray task calls
`pipeline._run_task`, the very function `run_local` runs, so outputs, stats and completion markers
are written exactly as in the other engines, and a rerun (on Ray or elsewhere) skips what is done.
Ray is imported inside functions only: `crucible --help` must not load it.

Why Ray beside the Indexed Job (docs/corpus.md, "Engines"): a stage has many more tasks than the
cluster has workers, and Ray hands the next task to whichever worker is free (work stealing by
construction), where the Indexed Job fixes task t to worker t mod N and waits for the slowest.
Stages may reserve different CPU and memory per task, and a task lost with its worker or node is
rerun by Ray (`max_retries`, Ray docs "Fault tolerance: tasks"). Exceptions are retried only when
they are storage hiccups (`transient`): a bad config or a bug fails the same way every time.

Utilisation, per stage: busy = the sum over finished tasks of their own run time (measured inside
`_run_task`) x the CPUs each reserved; reserved = the cluster's CPUs x the stage's wall time;
idle = reserved - busy. Idle covers scheduling, worker start-up, work a lost node took with it and
the tail where the last tasks run alone. Cluster CPUs are the larger of the counts at the stage's
start and end, so a node lost mid-stage still counts its share of the stage as reserved.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from crucible.trainer import storage
from crucible.trainer.corpus import pipeline
from crucible.trainer.corpus.config import CorpusConfig

# Shards per cluster CPU when none is given: tasks of similar size, several per CPU, so a free
# worker always finds another and the stage's tail (its last tasks running alone) is short.
TASKS_PER_CPU = 4
DEFAULT_MAX_RETRIES = 3          # Ray's own default for tasks (Ray docs "Fault tolerance: tasks")
PROBE_TIMEOUT_S = 5.0            # a reachable head answers a TCP connect in milliseconds
SCHEDULABLE_TIMEOUT_S = 600.0    # KubeRay may start worker pods after the head runs the driver


class RayUnreachable(ConnectionError):
    """No Ray cluster at the given address (or it refused the connection)."""


class ResourceError(ValueError):
    """A --ray-resources entry that cannot be parsed, names no stage, or fits on no node."""


class TransientStorageError(RuntimeError):
    """A storage failure that a later attempt may not meet (network, throttling, 5xx)."""


# ---- per-stage resources ----------------------------------------------------------------------
@dataclass(frozen=True)
class StageResources:
    """What one task of a stage reserves on a Ray node."""

    cpus: float = 1.0               # every stage body is single-threaded Python
    # Ray treats memory as a scheduling reservation, not a limit (Ray docs "Resources"); with no
    # measured per-stage peak to cite, nothing is reserved by default and the pod's limit caps it.
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.cpus <= 0:
            raise ResourceError(f"cpu must be > 0, got {self.cpus:g}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ResourceError(f"memory must be > 0, got {self.memory_bytes}")

    def ray_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.cpus}
        if self.memory_bytes is not None:
            options["memory"] = self.memory_bytes
        return options


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}   # Kubernetes quantity suffixes


def parse_bytes(text: str) -> int:
    """A Kubernetes-style quantity of bytes: 512Mi, 2Gi, 1G, 1000000."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", text.strip())
    if not match:
        raise ResourceError(f"memory {text!r}: want a number with an optional unit "
                            f"({', '.join(u for u in _UNITS if u)}), e.g. 2Gi")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def parse_stage_resources(spec: str) -> tuple[str, StageResources]:
    """'buckets=cpu:1,memory:2Gi' -> ('buckets', StageResources(1.0, 2 GiB))."""
    stage, sep, rest = spec.partition("=")
    if not sep or not stage.strip() or not rest.strip():
        raise ResourceError(f"{spec!r}: want STAGE=cpu:N[,memory:Q], e.g. buckets=cpu:1,memory:2Gi")
    values: dict[str, str] = {}
    for part in rest.split(","):
        key, colon, value = part.strip().partition(":")
        if not colon or key not in ("cpu", "memory") or key in values or not value:
            raise ResourceError(f"{spec!r}: {part.strip()!r} is not cpu:N or memory:Q "
                                "(each at most once)")
        values[key] = value.strip()
    try:
        cpus = float(values.get("cpu", "1"))
    except ValueError:
        raise ResourceError(f"{spec!r}: cpu {values['cpu']!r} is not a number") from None
    memory = parse_bytes(values["memory"]) if "memory" in values else None
    try:
        return stage.strip(), StageResources(cpus, memory)
    except ResourceError as err:
        raise ResourceError(f"{spec!r}: {err}") from None


def resources_by_stage(stage_names: Iterable[str],
                       overrides: dict[str, StageResources]) -> dict[str, StageResources]:
    """Every stage's resources: its override or the default. An override for a stage this run
    does not have is refused (a typo would otherwise be silently ignored)."""
    names = list(stage_names)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ResourceError(f"no stage {', '.join(unknown)} in this run; its stages: "
                            f"{', '.join(names)}")
    return {name: overrides.get(name, StageResources()) for name in names}


def unschedulable(needs: dict[str, StageResources], nodes: list[dict[str, float]]) -> list[str]:
    """Stages whose task fits on none of `nodes` (each node's total Ray resources), as sentences."""
    problems = []
    for stage, need in needs.items():
        if not any(node.get("CPU", 0.0) >= need.cpus and
                   (need.memory_bytes is None or node.get("memory", 0.0) >= need.memory_bytes)
                   for node in nodes):
            biggest = max(nodes, key=lambda n: n.get("CPU", 0.0), default={})
            problems.append(f"stage {stage} wants cpu {need.cpus:g}"
                            + (f", memory {need.memory_bytes}" if need.memory_bytes else "")
                            + f" per task; the largest node has cpu {biggest.get('CPU', 0.0):g}, "
                            f"memory {int(biggest.get('memory', 0))}")
    return problems


# ---- failures Ray may retry --------------------------------------------------------------------
# Network-level failures (Python's and botocore's, by class name so botocore need not be imported)
# and S3 answers that mean "try again later".
_TRANSIENT_CLASSES = {"ConnectionError", "TimeoutError", "EndpointConnectionError",
                      "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                      "IncompleteReadError", "ResponseStreamingError"}
_TRANSIENT_S3_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable",
                       "SlowDown", "RequestTimeout", "Throttling"}


def transient(err: BaseException) -> bool:
    """Whether another attempt of the same task might succeed: true for storage and network
    hiccups, false for everything a retry would meet again (config, data handling, permissions,
    a missing bucket)."""
    seen = 0
    current: BaseException | None = err
    while current is not None and seen < 8:     # the cause chain: a wrapper may hide the reason
        if _TRANSIENT_CLASSES & {c.__name__ for c in type(current).__mro__}:
            return True
        response = getattr(current, "response", None)
        if isinstance(response, dict) and \
                response.get("Error", {}).get("Code") in _TRANSIENT_S3_CODES:
            return True
        current, seen = current.__cause__ or current.__context__, seen + 1
    return False


def _task_on_worker(config: CorpusConfig, shard_count: int, progress: bool, stage_name: str,
                    task: int) -> float:
    """One pipeline task on a Ray worker: `pipeline._run_task` (looked up at call time, so it is
    the function the local runner calls). Transient failures become the one exception class
    Ray is told to retry."""
    try:
        return pipeline._run_task(config, shard_count, progress, stage_name, task)
    except Exception as err:
        if transient(err):
            raise TransientStorageError(
                f"stage {stage_name} task {task}: {type(err).__name__}: {err}") from err
        raise


# ---- the utilisation report --------------------------------------------------------------------
@dataclass(frozen=True)
class StageUsage:
    stage: str
    tasks_run: int
    tasks_skipped: int        # done before this run (marker present)
    wall_s: float
    cluster_cpus: float
    busy_cpu_s: float         # sum of task run time x CPUs reserved per task

    @property
    def reserved_cpu_s(self) -> float:
        return self.cluster_cpus * self.wall_s

    @property
    def idle_cpu_s(self) -> float:
        return self.reserved_cpu_s - self.busy_cpu_s

    @property
    def busy_share(self) -> float:
        return self.busy_cpu_s / self.reserved_cpu_s if self.reserved_cpu_s > 0 else 0.0


@dataclass(frozen=True)
class RayRun:
    shard_count: int
    stages: list[StageUsage] = field(default_factory=list)

    @property
    def wall_s(self) -> dict[str, float]:
        return {s.stage: s.wall_s for s in self.stages}


def usage_table(stages: list[StageUsage]) -> str:
    """The utilisation report as a fixed-width table, with a total row."""
    head = ("stage", "tasks", "skipped", "wall s", "cpus", "busy cpu-s", "idle cpu-s",
            "reserved cpu-s", "busy")
    rows = [(s.stage, str(s.tasks_run), str(s.tasks_skipped), f"{s.wall_s:.2f}",
             f"{s.cluster_cpus:g}", f"{s.busy_cpu_s:.2f}", f"{s.idle_cpu_s:.2f}",
             f"{s.reserved_cpu_s:.2f}", f"{s.busy_share:.0%}") for s in stages]
    busy = sum(s.busy_cpu_s for s in stages)
    reserved = sum(s.reserved_cpu_s for s in stages)
    rows.append(("total", str(sum(s.tasks_run for s in stages)),
                 str(sum(s.tasks_skipped for s in stages)),
                 f"{sum(s.wall_s for s in stages):.2f}", "", f"{busy:.2f}",
                 f"{reserved - busy:.2f}", f"{reserved:.2f}",
                 f"{busy / reserved:.0%}" if reserved > 0 else "-"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in [head, *rows])


# ---- connecting --------------------------------------------------------------------------------
def parse_address(address: str | None) -> tuple[str, tuple[str, int] | None]:
    """What `ray.init` gets, and the (host, port) to probe first: None or 'local' starts a Ray on
    this machine, 'auto' joins the one this machine belongs to, 'host:port' is a head's GCS and
    'ray://host:port' is Ray Client."""
    if address in (None, "", "local"):
        return "local", None
    if address == "auto":
        return "auto", None
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
        raise RayUnreachable(f"Ray address {address!r}: want auto, host:port or ray://host:port")
    return address, (host.strip("[]"), int(port))


def _probe(host: str, port: int, timeout_s: float) -> None:
    """A TCP connect first: ray.init retries an absent head for a long time before it gives up."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise RayUnreachable(f"cannot reach Ray at {host}:{port}: "
                             f"{err.strerror or type(err).__name__}") from None


def connect(address: str | None, num_cpus: int | None = None,
            runtime_env: dict[str, Any] | None = None) -> bool:
    """Connect this process to Ray (see `parse_address`); False when it already was: that
    connection is used as it is (`address`, `num_cpus` and `runtime_env` unused) and the caller
    must not shut it down."""
    import ray

    if ray.is_initialized():
        return False
    target, probe = parse_address(address)
    if probe is not None:
        _probe(*probe, PROBE_TIMEOUT_S)
    kwargs: dict[str, Any] = {"address": target, "logging_level": logging.WARNING,
                              "runtime_env": runtime_env}
    if target == "local":
        kwargs.update(num_cpus=num_cpus, include_dashboard=False)
    try:
        ray.init(**kwargs)
    except ConnectionError as err:
        raise RayUnreachable(f"cannot connect to Ray at {address}: {err}") from None
    return True


# ---- running -----------------------------------------------------------------------------------
def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def _cluster_cpus() -> float:
    import ray

    return float(ray.cluster_resources().get("CPU", 0.0))


def _wait_schedulable(needs: dict[str, StageResources], timeout_s: float, poll_s: float = 2.0,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> None:
    deadline = clock() + timeout_s
    while problems := unschedulable(needs, _alive_nodes()):
        if clock() > deadline:
            raise ResourceError(f"after {timeout_s:.0f}s: " + "; ".join(problems))
        sleep(poll_s)


def _run_stage(remote, config_ref, job: pipeline.Job, stage: pipeline.Stage,
               resources: StageResources, max_retries: int) -> StageUsage:
    import ray

    todo = [t for t in range(stage.tasks) if not storage.exists(job.marker(stage.name, t))]
    cpus_at_start = _cluster_cpus()
    started = time.perf_counter()
    task = remote.options(name=f"corpus-{stage.name}", max_retries=max_retries,
                          retry_exceptions=[TransientStorageError], **resources.ray_options())
    pending = [task.remote(config_ref, job.shard_count, job.progress, stage.name, t) for t in todo]
    busy_s = 0.0
    try:
        while pending:   # the stage barrier: every future of the stage, failing on the first error
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            busy_s += sum(ray.get(done))
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
    wall_s = time.perf_counter() - started
    return StageUsage(stage.name, len(todo), stage.tasks - len(todo), wall_s,
                      max(cpus_at_start, _cluster_cpus()), busy_s * resources.cpus)


def recorded_shards(config: CorpusConfig) -> int | None:
    """The shard count in the output's run.json, if a run started there already."""
    uri = storage.join(config.output, "run.json")
    return int(json.loads(storage.read_bytes(uri))["shards"]) if storage.exists(uri) else None


def run_ray(config: CorpusConfig, shard_count: int | None, address: str | None = None,
            progress: bool = False, resources: dict[str, StageResources] | None = None,
            max_retries: int = DEFAULT_MAX_RETRIES, num_cpus: int | None = None,
            runtime_env: dict[str, Any] | None = None,
            on_stage: Callable[[StageUsage], None] | None = None,
            schedulable_timeout_s: float = SCHEDULABLE_TIMEOUT_S) -> RayRun:
    """Every unfinished task of every stage as a Ray task, a stage at a time. `shard_count` None:
    the run's own when resuming, else TASKS_PER_CPU per cluster CPU. `address`: see
    `parse_address`; `num_cpus` only sizes a Ray this call starts; `runtime_env` is Ray's (a job's
    env vars, a worker setup hook); `on_stage` hears of each finished stage."""
    import ray

    # Stage names do not depend on the shard count; refuse a bad override before connecting.
    needs = resources_by_stage([s.name for s in pipeline.Job(config, 1).stages()], resources or {})
    owns = connect(address, num_cpus, runtime_env)
    try:
        # A Ray started here will not grow: what does not fit now never will.
        local = parse_address(address)[0] == "local" and owns
        _wait_schedulable(needs, 0.0 if local else schedulable_timeout_s)
        if shard_count is None:
            shard_count = recorded_shards(config) or \
                max(1, int(TASKS_PER_CPU * _cluster_cpus()))
        job = pipeline.Job(config, shard_count, progress)
        job.check_run_file()
        remote = ray.remote(_task_on_worker)
        config_ref = ray.put(config)
        run = RayRun(shard_count)
        for stage in job.run_order():
            usage = _run_stage(remote, config_ref, job, stage, needs[stage.kind], max_retries)
            run.stages.append(usage)
            if on_stage is not None:
                on_stage(usage)
        return run
    finally:
        if owns:
            ray.shutdown()
