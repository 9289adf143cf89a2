"""Operator at scale: 100 PretrainJobs x 8 pods on 200 KWOK nodes, then a node loss; or, with
`--case capacity`, twice the demand the cluster holds, with nodes dying and coming back.

    ~/.cache/crucible/venv/bin/python bench/operator_scale.py [--jobs 100] [--pods 8] [--nodes 200]
    ~/.cache/crucible/venv/bin/python bench/operator_scale.py --case capacity [--churn-minutes 30]

Starts its own instance of the local stack (e2e/stack.sh with its own state folder, port offset
and CRUCIBLE_KWOK_NODES, so the shared test stack is left alone) unless --stack-env names the env
file of a running one, runs `crucible-operator run -A` as a real process with admin credentials,
and measures:

  * the reference, in the same run and on the same stack: a plain client creating as many pods
    (one GPU each) 32 at a time, timed until every one is Running;
  * time from the first create until every pod is Running and every job's status says Running;
  * per-job latency from its create to phase Running (p50/p99, client clock, 50 ms polling);
  * reconcile pass duration p50/p99 (the operator's crucible_operator_reconcile_seconds
    histogram, quantiles interpolated within buckets as PromQL's histogram_quantile does);
  * operator memory: VmRSS at the end and VmHWM (peak) from /proc;
  * node loss: one node's heartbeat stops; time from the node controller marking it NotReady to
    every pod that was on it Running on another node, against the goal nodeFailureGraceSeconds
    + 15 s.

Goals (docs/operator.md, "Scale"): all Running <= 2x the plain client's time, reconcile p99 <= 2 s
(start-up burst included), RSS <= 300 MB.
Results go to bench/results/operator_scale.json. Every wait has a deadline; the node is revived
and the stack stopped (unless --keep-stack) whatever happens.

Capacity case (`--case capacity`, operator/capacity.py): 100 jobs x 8 pods (nodes.min = max = 8)
on 100 KWOK nodes of 8 GPUs, each pod asking for --gpus-per-pod GPUs (default 2: the cluster holds
50 jobs at once, half the demand; 8 gives whole-node pods and holds 12 of the 100). All jobs are
created at once, so the first wave is the partial-gang deadlock the policy exists for: every job
gets its pod 0 placed and some of the rest, none of the stragglers gets all 8. After --settle-s
(default 180 s: the first 60 s capacity timeout and a retry or two) comes --churn-minutes of
churn: every --churn-every-s (30 s) a random Ready node's heartbeat stops (as the node-loss step
above does); --churn-down-s (120 s) later it is given back to KWOK and, once Ready again,
uncordoned with its crucible.dev/* failure annotations removed, as a repaired node would be.
The jobs' fault tolerance is short so that the policy acts many times within the run:

  * capacityTimeoutSeconds 60 and capacityRetrySeconds 15 (the schema's floors are 30 and 10):
    long enough for the scheduler and KWOK on this machine to place and start a whole gang
    (tens of seconds under load), short enough that a held partial gang lets go within a
    minute, and that a 30-minute run sees dozens of release/retry cycles (backoff 15, 30, 60 s
    ... plus up to 25 % jitter per job);
  * nodeFailureGraceSeconds 10: the node controller already waits 2 x --node-lease-s (40 s)
    before it calls a node NotReady, so a dead node's pods move ~50 s after it died;
  * avoidFailedNodesMinutes 0: a returned node here is repaired (uncordoned by the "admin"),
    and with the default 10 min dozens of returned nodes would sit in the jobs' anti-affinity
    lists, shrinking the cluster for reasons of the benchmark's making;
  * hangTimeoutSeconds and startupTimeoutSeconds 86400: KWOK pods never report a step, and a
    group Running past the default startupTimeoutSeconds (1800 s) would restart as a hang.

KWOK pods do not train, so goodput here is the running share: the share of wall time a job is in
phase Running, sampled from the jobs' statuses every --sample-s (5 s) over the churn window
(each interval counted in the phase seen at its start). Its ceiling is the cluster's share of the
demand (50 %), less the dead nodes; "utilization" is the mean count of Running jobs over the
count that fits. Also reported: restarts summed over jobs (status.restarts: application,
infrastructure, byCause; application must be 0, since KWOK pods never exit on their own), jobs
by phase at the end of the churn (goal: none Failed), the CapacityReleased/CapacityRetry events,
reconcile passes and the operator's CPU time and RSS. A table goes to stdout, everything to
bench/results/operator_scale_capacity.json. Every wait has a deadline; whatever happens the killed
nodes are given back and the stack is stopped (unless --keep-stack).

By default the jobs never finish: a job that waits can then run only when a running one lets go
of its room (a node failure it cannot recover from within capacityTimeoutSeconds), so "jobs
never Running" measures how the churn rotates them, not starvation. With --run-minutes M a job
finishes once it has been Running M minutes in all (the bench deletes it, as its owner would)
and a new one is submitted in its place, so the demand stays twice the capacity: a steady
stream of jobs. Then `starvation` says how long jobs waited for their first Running, how old
the oldest job that never ran is at the end (under a first-come order it stays near the
typical wait; a starved job's grows with the run), and how many pairs ran out of their
submission order.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GRACE_S = 10         # nodeFailureGraceSeconds for the benchmark's jobs
PORT_OFFSET = 500    # clear of the default stack's ports (e2e/stack/layout.py)
GPUS_PER_NODE = 8    # e2e/stack/services.py node_manifest
# The capacity case's jobs (why these values: the module docstring).
CAPACITY_FT = {"nodeFailureGraceSeconds": GRACE_S, "capacityTimeoutSeconds": 60,
               "capacityRetrySeconds": 15, "avoidFailedNodesMinutes": 0,
               "hangTimeoutSeconds": 86400, "startupTimeoutSeconds": 86400}


def _operator_workers() -> int:
    """The operator's concurrent passes (--workers) for this run: CRUCIBLE_OPERATOR_WORKERS, or
    the operator's default."""
    from crucible.operator.handlers import OperatorConfig

    return int(os.environ.get("CRUCIBLE_OPERATOR_WORKERS", OperatorConfig().workers))


def stack(args) -> dict[str, str]:
    env = dict(os.environ, CRUCIBLE_STACK_DIR=str(Path.home() / ".cache/crucible/stack-bench"),
               CRUCIBLE_PORT_OFFSET=str(PORT_OFFSET), CRUCIBLE_KWOK_NODES=str(args.nodes),
               # 200 nodes renewing a 4 s Lease every second swamp a 2-core machine: healthy nodes
               # then miss the 8 s grace and go NotReady. 20 s -> renewals every 5 s, 40 s grace
               # (the node controller's real default).
               CRUCIBLE_KWOK_LEASE_SECONDS=str(args.node_lease_s))
    script = str(REPO / "e2e" / "stack.sh")
    started = time.monotonic()
    subprocess.run([script, "up"], env=env, check=True)
    print(f"bench stack up in {time.monotonic() - started:.0f}s ({args.nodes} KWOK nodes)")
    out = subprocess.run([script, "env"], env=env, check=True, capture_output=True, text=True)
    return {k: v for k, v in (line.removeprefix("export ").split("=", 1)
                              for line in out.stdout.splitlines() if "=" in line)}, env


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """histogram_quantile over cumulative (upper bound, count) buckets."""
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            width = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / width if width else 0)
        prev_bound, prev_count = bound, count
    return prev_bound


def _delta(after: list, before: list) -> list:
    return [(bound, count - dict(before).get(bound, 0.0)) for bound, count in after]


def scrape(port: int, since: dict | None = None) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    buckets: dict[str, list] = {"pass": [], "queue": []}
    passes = 0
    for line in text.splitlines():
        for key, name in (("pass", "crucible_operator_reconcile_seconds_bucket"),
                          ("queue", "crucible_operator_reconcile_queue_seconds_bucket")):
            if line.startswith(name):
                bound = line.split('le="')[1].split('"')[0]
                buckets[key].append((float("inf") if bound == "+Inf" else float(bound),
                                     float(line.rsplit(" ", 1)[1])))
        if line.startswith("crucible_operator_reconciles_total"):
            passes += float(line.rsplit(" ", 1)[1])
    raw = {key: list(value) for key, value in buckets.items()}
    if since is not None:   # only the passes after that scrape
        buckets = {key: _delta(value, since["_buckets"][key]) for key, value in buckets.items()}
        passes -= since["passes"]
    return {"_buckets": raw, "p50_s": round(quantile(0.5, buckets["pass"]), 4),
            "p99_s": round(quantile(0.99, buckets["pass"]), 4),
            "queue_p50_s": round(quantile(0.5, buckets["queue"]), 4),
            "queue_p99_s": round(quantile(0.99, buckets["queue"]), 4), "passes": int(passes)}


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")


def apiserver_writes(core) -> dict[str, float]:
    """The apiserver's own count of write requests so far, by "VERB resource[/subresource]"
    (apiserver_request_total): what the start-up cost it, whoever sent it."""
    text = core.api_client.call_api("/metrics", "GET", auth_settings=["BearerToken"],
                                    _preload_content=False,
                                    _return_http_data_only=True).data.decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:
                                                         line.rindex("}")].split(",") if "=" in part)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("verb") not in WRITE_VERBS:
            continue
        sub = labels.get("subresource")
        key = f'{labels["verb"]} {labels.get("resource", "")}' + (f"/{sub}" if sub else "")
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def writes_between(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    delta = {key: int(after[key] - before.get(key, 0.0)) for key in after}
    return dict(sorted(((k, v) for k, v in delta.items() if v), key=lambda kv: -kv[1]))


def memory_mb(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    kb = lambda key: int(fields[key].split()[0])  # noqa: E731
    return {"rss_mb": round(kb("VmRSS") / 1024, 1), "peak_rss_mb": round(kb("VmHWM") / 1024, 1)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


STACK_PARTS = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller-manager", "kwok", "kueue")


def cpu_by_part(b) -> dict[str, float]:
    """CPU seconds so far of the operator, this process (the bench's own clients and watches)
    and each stack component the pods go through (their pids from the stack's state folder)."""
    pids = {"operator": b.operator.pid, "bench": os.getpid()}
    folder = Path(b.shell_env["CRUCIBLE_STACK_DIR"]) / "pids"
    for part in STACK_PARTS:
        try:
            pids[part] = int((folder / f"{part}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    out = {}
    for part, pid in pids.items():
        try:
            out[part] = cpu_seconds(pid)
        except OSError:
            continue
    return out


def cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per part, CPU seconds spent between two `cpu_by_part` readings, most first."""
    spent = {part: round(after[part] - before.get(part, 0.0), 1) for part in after}
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


# --- the shared harness: stack, clients, namespace, operator, jobs, nodes, teardown --------------
class Bench:
    """The bench stack, API clients, a fresh namespace and the operator as a real process.

    A context manager: on the way out, whatever happened, every node it killed is given back to
    KWOK (and uncordoned; with `forget`, its crucible.dev/* annotations removed too), the jobs
    are deleted, the operator stopped, the namespace deleted and the stack stopped (unless
    --keep-stack)."""

    def __init__(self, args, log_name: str, forget: bool = False):
        self.args, self.log_name, self.forget = args, log_name, forget
        self.killed: set[str] = set()      # nodes whose heartbeat this run stopped, not yet back
        self.operator = None
        self.ns = None

    def __enter__(self) -> "Bench":
        from kubernetes import client, config

        import yaml

        from crucible.operator import crd

        self.client, self.crd = client, crd
        self.stack_env, self.shell_env = stack(self.args)
        try:
            kubeconfig = self.stack_env["KUBECONFIG"]
            self.label = self.stack_env["CRUCIBLE_KWOK_LABEL"]
            api = config.new_client_from_config(config_file=kubeconfig)
            api.configuration.connection_pool_maxsize = 32
            self.core, self.objs = client.CoreV1Api(api), client.CustomObjectsApi(api)
            ext = client.ApiextensionsV1Api(api)
            doc = yaml.safe_load((REPO / "manifests/crd/pretrainjobs.crucible.dev.yaml").read_text())
            try:
                ext.create_custom_resource_definition(doc)
            except client.exceptions.ApiException as err:
                if err.status != 409:
                    raise
            self.prune()
            ns = f"bench-{int(time.time())}"
            self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
            self.ns = ns
            deadline = time.monotonic() + 60
            while True:
                try:
                    self.core.read_namespaced_service_account("default", ns)
                    self.objs.list_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL)
                    break
                except client.exceptions.ApiException:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            self.metrics_port = 18000 + PORT_OFFSET
            self.log_path = Path(tempfile.gettempdir()) / self.log_name
            print(f"operator log: {self.log_path}")
            log = open(self.log_path, "w")
            op_env = dict(os.environ, KUBECONFIG=kubeconfig)
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "crucible.operator.main", "run", "-A", "--interval", "10",
                 "--metrics-port", str(self.metrics_port), "--workers", str(_operator_workers())],
                env=op_env, stdout=log, stderr=subprocess.STDOUT)
        except BaseException:
            self.close()
            raise
        return self

    def prune(self) -> None:
        """What earlier runs left in this stack's etcd (`stack.sh down` keeps it): KWOK nodes
        beyond this run's --nodes (a 10-node run after a 100-node one would otherwise get 100)
        and their namespaces (jobs whose finalizer the stopped operator never took off keep
        their pods, and the GPUs those hold)."""
        wanted = set(self.stack_env["CRUCIBLE_KWOK_NODE_NAMES"].split(","))
        extra = [n.metadata.name for n in self.core.list_node(label_selector="type=kwok").items
                 if n.metadata.name not in wanted]
        for name in extra:
            self.core.delete_node(name)
        old = [n.metadata.name for n in self.core.list_namespace().items
               if n.metadata.name.startswith("bench-") and not n.metadata.deletion_timestamp]
        for name in old:
            self.core.delete_namespace(name)
        if extra or old:
            print(f"pruned from earlier runs: {len(extra)} nodes, {len(old)} namespaces")
        # A namespace of a run just ended is still being emptied (its 800 pods, their children
        # and events): measured beside that, a run took up to twice as long. Wait for it.
        deadline = time.monotonic() + 300
        while any(n.metadata.name.startswith("bench-") for n in self.core.list_namespace().items):
            if time.monotonic() > deadline:
                print("earlier runs' namespaces still terminating after 300 s; measuring anyway")
                break
            time.sleep(2)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        crd, given_back = self.crd, sorted(self.killed)
        try:
            for node in given_back:
                _quietly(revive_node, self, node)
            if self.ns:
                try:
                    self.objs.delete_collection_namespaced_custom_object(
                        crd.GROUP, crd.VERSION, self.ns, crd.PLURAL)
                    # The operator takes its finalizer off each; one left would keep the job's
                    # pods (and their GPUs) in the stack's etcd for the next run.
                    deadline = time.monotonic() + 60
                    time.sleep(5)
                    while self.list_jobs() and time.monotonic() < deadline:
                        time.sleep(2)
                finally:
                    if self.operator is not None:
                        self.operator.terminate()
                        try:
                            self.operator.wait(30)
                        except subprocess.TimeoutExpired:
                            self.operator.kill()
                            self.operator.wait(10)
                    self.core.delete_namespace(self.ns)
            if self.forget:   # once the operator is gone: it would cordon a node not Ready yet
                for node in given_back:
                    _quietly(forget_failure, self, node)
        finally:
            if not self.args.keep_stack:
                subprocess.run([str(REPO / "e2e" / "stack.sh"), "down"], env=self.shell_env)

    # -- jobs -------------------------------------------------------------------------------------
    def job_body(self, name: str, pods: int, fault_tolerance: dict, gpus: int = 1) -> dict:
        crd = self.crd
        return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
                "spec": {"image": "registry.invalid/crucible-trainer:bench",
                         "nodes": {"min": pods, "max": pods}, "procsPerNode": 8,
                         "resources": {"limits": {"nvidia.com/gpu": gpus}},
                         "model": {"preset": "gpt2-124m"},
                         "data": {"train": "s3://crucible/tokens/train"},
                         "training": {"tokens": 2.5e9},
                         "faultTolerance": fault_tolerance}}

    def create_jobs(self, names: list[str], body) -> dict[str, float]:
        """Create the jobs 16 at a time; {name: monotonic time its create returned}."""
        crd, created = self.crd, {}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for name, when in pool.map(lambda n: (n, self.objs.create_namespaced_custom_object(
                    crd.GROUP, crd.VERSION, self.ns, crd.PLURAL, body(n)) and time.monotonic()),
                    names):
                created[name] = when
        return created

    def list_jobs(self) -> list[dict]:
        crd = self.crd
        return self.objs.list_namespaced_custom_object(
            crd.GROUP, crd.VERSION, self.ns, crd.PLURAL, _request_timeout=30)["items"]


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - teardown goes on with the next step
        print(f"teardown: {fn.__name__}{args[1:]}: {err}", file=sys.stderr)


# -- nodes ----------------------------------------------------------------------------------------
def kill_node(b: Bench, node: str) -> None:
    """Stop the node's heartbeat: KWOK lets go of it, the node controller marks it NotReady after
    2 x --node-lease-s."""
    b.killed.add(node)
    b.core.patch_node(node, {"metadata": {"labels": {b.label: "dead"}}})


def revive_node(b: Bench, node: str) -> None:
    """Give the node back to KWOK (its heartbeat resumes) and uncordon it."""
    b.core.patch_node(node, {"metadata": {"labels": {b.label: "managed"}},
                             "spec": {"unschedulable": None}})
    b.killed.discard(node)


def forget_failure(b: Bench, node: str, body=None) -> None:
    """What an admin does to a repaired node: uncordon it and remove the operator's crucible.dev/*
    failure annotations (`body`: the node as last listed, to save a read)."""
    body = body or b.core.read_node(node)
    stale = {key: None for key in (body.metadata.annotations or {})
             if key.startswith("crucible.dev/")}
    b.core.patch_node(node, {"metadata": {"annotations": stale} if stale else {},
                             "spec": {"unschedulable": None}})


def node_ready(body) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in body.status.conditions or [])


# --- the scale case ------------------------------------------------------------------------------
BARE_LABEL = "crucible-bench/bare"


def follow(b: Bench, stop: threading.Event, list_fn, on_event, *args, **kwargs) -> None:
    """Call on_event(type, object) for every change the watch of list_fn brings until `stop` is
    set. Each watch ends after 5 s (so that `stop` is seen) and the next resumes from the last
    resourceVersion: a watch started afresh first replays every object as ADDED, and doing that
    every few seconds for 800 pods loaded the apiserver and this process (both sharing the
    machine with what is measured) more than the operator does."""
    from kubernetes import watch

    version = None
    while not stop.is_set():
        w = watch.Watch()
        try:
            for event in w.stream(list_fn, *args, timeout_seconds=5, resource_version=version,
                                  **kwargs):
                on_event(event["type"], event["object"])
                if stop.is_set():
                    w.stop()
            version = w.resource_version
        except b.client.exceptions.ApiException as err:
            # A loaded apiserver answers a resumed watch with 410 (expired) or 504 ("Too
            # large resource version"): watch again from scratch (a replay of every object).
            print(f"watch restarted: HTTP {err.status} {err.reason}")
            version = None


def bare_client(b: Bench, count: int, threads: int = 32) -> dict:
    """The reference in the same run: a plain client creating `count` pods shaped as the
    operator's (one GPU each, restartPolicy Never), `threads` at a time, timed until every one
    is Running (the scheduler and KWOK do the rest, as for the operator's); then deleted and
    waited for, so the operator's run starts from the same empty pool."""
    core, ns = b.core, b.ns
    running, lock, done = set(), threading.Lock(), threading.Event()

    def see(kind, pod) -> None:
        with lock:
            if kind != "DELETED" and pod.status.phase == "Running":
                running.add(pod.metadata.name)
            else:
                running.discard(pod.metadata.name)
            if len(running) == count:
                done.set()

    def body(i: int) -> dict:
        return {"metadata": {"name": f"bare-{i:04d}", "labels": {BARE_LABEL: "1"}},
                "spec": {"restartPolicy": "Never", "containers": [{
                    "name": "trainer", "image": "registry.invalid/crucible-trainer:bench",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}

    watcher = threading.Thread(target=follow, daemon=True, args=(
        b, done, core.list_namespaced_pod, see, ns), kwargs={"label_selector": BARE_LABEL})
    watcher.start()
    time.sleep(1)
    writes_before, cpu_before = apiserver_writes(core), cpu_by_part(b)
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: core.create_namespaced_pod(ns, body(i)), range(count)))
    created_s = time.monotonic() - start
    assert done.wait(600), f"only {len(running)} of {count} bare pods Running after 600 s"
    out = {"pods": count, "threads": threads, "pods_created_s": round(created_s, 1),
           "all_running_s": round(time.monotonic() - start, 1)}
    out["apiserver_writes"] = writes_between(writes_before, apiserver_writes(core))
    out["cpu_s"] = cpu_between(cpu_before, cpu_by_part(b))
    core.delete_collection_namespaced_pod(ns, label_selector=BARE_LABEL, grace_period_seconds=0)
    deadline = time.monotonic() + 300
    while core.list_namespaced_pod(ns, label_selector=BARE_LABEL).items:
        assert time.monotonic() < deadline, "bare pods never went"
        time.sleep(1)
    print(f"bare client: {count} pods created in {out['pods_created_s']}s, all Running in "
          f"{out['all_running_s']}s")
    return out


def scale_case(args) -> int:
    results: dict = {"jobs": args.jobs, "pods_per_job": args.pods, "nodes": args.nodes,
                     "node_lease_s": args.node_lease_s, "cpus": os.cpu_count(),
                     "operator_workers": _operator_workers(),
                     "load_average_at_start": os.getloadavg()[0]}
    stop = threading.Event()
    with Bench(args, "operator_scale.log") as b:
        core, objs, crd, ns = b.core, b.objs, b.crd, b.ns
        metrics_port, operator, stack_env = b.metrics_port, b.operator, b.stack_env
        try:
            time.sleep(3)  # the operator's watches start
            results["bare_client"] = bare_client(b, args.jobs * args.pods)
            names = [f"job-{i:03d}" for i in range(args.jobs)]

            def body(name):
                return b.job_body(name, args.pods, {"hangTimeoutSeconds": 3600,
                                                    "nodeFailureGraceSeconds": GRACE_S})

            # Watches, not polling: listing 800 pods every few ms would load the apiserver more
            # than the operator does, and the figures would measure the benchmark.
            running_at, pods_running, lock = {}, set(), threading.Lock()

            def on_job(kind, obj):
                name = obj["metadata"]["name"]
                if (obj.get("status") or {}).get("phase") == "Running":
                    with lock:
                        running_at.setdefault(name, time.monotonic())

            def on_pod(kind, pod):
                with lock:
                    see_pod(kind, pod)

            def see_pod(kind, pod):
                name = pod.metadata.name
                seen.add(name)
                if kind == "DELETED":
                    pod_state.pop(name, None)
                else:
                    pod_state[name] = (pod.status.phase, pod.spec.node_name,
                                       bool(pod.metadata.deletion_timestamp))
                if kind != "DELETED" and pod.status.phase == "Running" \
                        and not pod.metadata.deletion_timestamp:
                    pods_running.add(name)
                else:
                    pods_running.discard(name)

            pod_state: dict[str, tuple] = {}

            seen: set[str] = set()
            watchers = [threading.Thread(target=follow, daemon=True, args=(
                            b, stop, objs.list_namespaced_custom_object, on_job, crd.GROUP,
                            crd.VERSION, ns, crd.PLURAL)),
                        threading.Thread(target=follow, daemon=True, args=(
                            b, stop, core.list_namespaced_pod, on_pod, ns))]
            for t in watchers:
                t.start()
            time.sleep(1)
            writes_before, cpu_before = apiserver_writes(core), cpu_by_part(b)
            start = time.monotonic()
            created = b.create_jobs(names, body)
            print(f"created {args.jobs} jobs in {time.monotonic() - start:.1f}s")
            want = args.jobs * args.pods
            deadline = start + 600
            while time.monotonic() < deadline:
                with lock:
                    if len(seen) >= want and "pods_created_s" not in results:
                        results["pods_created_s"] = round(time.monotonic() - start, 1)
                    if len(pods_running) == want and "pods_running_s" not in results:
                        results["pods_running_s"] = round(time.monotonic() - start, 1)
                    if len(pods_running) == want and len(running_at) == args.jobs:
                        break
                time.sleep(0.05)
            all_running_s = time.monotonic() - start
            assert len(running_at) == args.jobs, f"only {len(running_at)} jobs Running after 600 s"
            lat = sorted(running_at[n] - created[n] for n in names)
            results.update({
                "all_running_s": round(all_running_s, 1),
                "job_to_running_p50_s": round(lat[len(lat) // 2], 2),
                "job_to_running_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
            })
            print(f"all {want} pods Running, all jobs Running: {all_running_s:.1f}s")
            # Everyone's writes (the bench's job creates, the scheduler's bindings, KWOK's
            # status updates and node heartbeats too), from the first job create to all Running.
            writes = writes_between(writes_before, apiserver_writes(core))
            results["apiserver_writes_during_startup"] = writes
            # Where the machine's two cores went: the apiserver is the shared bottleneck, and
            # every write or watch event anyone adds is paid for there.
            results["cpu_s_during_startup"] = cpu_between(cpu_before, cpu_by_part(b))
            print("CPU seconds during the start-up: " + ", ".join(
                f"{part} {spent}" for part, spent in results["cpu_s_during_startup"].items()))
            print("apiserver writes during the start-up: " + ", ".join(
                f"{key} {count}" for key, count in list(writes.items())[:12]))
            time.sleep(5)  # a few resync passes at steady state
            results["reconcile_after_startup"] = scrape(metrics_port)
            results["memory_after_startup"] = memory_mb(operator.pid)

            # Node loss: the busiest node's heartbeat stops.
            by_node: dict[str, list[str]] = {}
            with lock:
                for name, (_phase, node, _deleting) in pod_state.items():
                    by_node.setdefault(node, []).append(name)
            victim = max(by_node, key=lambda n: len(by_node[n]))
            lost = by_node[victim]
            kill_node(b, victim)
            killed = time.monotonic()
            deadline = killed + 300

            def ready(node) -> bool:
                return node_ready(core.read_node(node))

            while ready(victim):
                assert time.monotonic() < deadline, "node never went NotReady"
                time.sleep(0.2)
            not_ready = time.monotonic()
            # A worker pod there comes back under its own name elsewhere; a pod 0 there (the c10d
            # store's host) makes its whole job restart as generation 1.
            workers = [n for n in lost if not n.endswith("-0")]
            store_jobs = {n.rsplit("-", 2)[0] for n in lost if n.endswith("-0")}
            while True:
                assert time.monotonic() < deadline, "pods never moved"
                with lock:
                    ok = {name for name, (phase, node, deleting) in pod_state.items()
                          if phase == "Running" and node != victim and not deleting}
                regrouped = {job for job in store_jobs if sum(
                    1 for name in ok if name.startswith(f"{job}-1-")) == args.pods}
                if all(n in ok for n in workers) and regrouped == store_jobs:
                    break
                time.sleep(0.05)
            moved_s = time.monotonic() - not_ready
            results["node_loss"] = {
                "pods_on_node": len(lost),
                "heartbeat_stop_to_not_ready_s": round(not_ready - killed, 1),
                "not_ready_to_running_elsewhere_s": round(moved_s, 1), "grace_s": GRACE_S,
                "goal_s": GRACE_S + 15, "met": moved_s <= GRACE_S + 15,
                "worker_pods_moved": len(workers), "jobs_restarted_for_pod_0": len(store_jobs)}
            print(f"node {victim}: {len(lost)} pods Running elsewhere {moved_s:.1f}s after "
                  f"NotReady (grace {GRACE_S}s)")
            results["reconcile"] = scrape(metrics_port)
            results["reconcile_steady_and_node_loss"] = scrape(
                metrics_port, since=results["reconcile_after_startup"])
            for key in ("reconcile", "reconcile_after_startup", "reconcile_steady_and_node_loss"):
                results[key].pop("_buckets")
            results["memory"] = memory_mb(operator.pid)
            ratio = results["all_running_s"] / results["bare_client"]["all_running_s"]
            results["all_running_vs_bare_client"] = round(ratio, 2)
            results["goals"] = {"all_running_le_2x_bare_client": ratio <= 2,
                                "reconcile_p99_le_2s": results["reconcile"]["p99_s"] <= 2,
                                "reconcile_p99_le_2s_after_startup":
                                    results["reconcile_steady_and_node_loss"]["p99_s"] <= 2,
                                "rss_le_300mb": results["memory"]["peak_rss_mb"] <= 300}
        finally:
            stop.set()
    write_results(args.out, results)
    print(json.dumps(results, indent=2))
    return 0


def write_results(out: str, results: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2) + "\n")


# --- the capacity case ---------------------------------------------------------------------------
class Churn:
    """One node dies every `every_s` (a random Ready one; its heartbeat stops) and is given back
    `down_s` later; once it is Ready again it is uncordoned and its crucible.dev/* annotations
    removed. Nodes the operator cordons after that (a pass acting on a view from before the node
    came back) are found by `check` and cleared the same way, and counted."""

    def __init__(self, b: Bench, every_s: float, down_s: float, rng: random.Random):
        self.b, self.every_s, self.down_s, self.rng = b, every_s, down_s, rng
        self.dead: dict[str, float] = {}        # node -> when it died (monotonic)
        self.returning: dict[str, float] = {}   # given back to KWOK, not Ready yet -> since
        self.next_kill: float | None = None
        self.kills = self.returns = self.late_cordons = self.errors = 0
        self.not_ready_after_s: list[float] = []   # heartbeat stop -> NotReady, seen by sampling
        self.back_after_s: list[float] = []        # given back -> Ready again
        self.slow_returns: list[str] = []          # not Ready within RETURN_DEADLINE_S
        self.max_dead = 0
        self.ready: set[str] = set()               # Ready nodes at the last `check`
        self.noted: set[str] = set()               # dead nodes seen NotReady

    RETURN_DEADLINE_S = 180

    def start(self, now: float) -> None:
        self.next_kill = now

    def tick(self, now: float) -> None:
        """Kill and give back what is due."""
        for node, died in list(self.dead.items()):
            if now - died >= self.down_s:
                self._call(revive_node, self.b, node)
                del self.dead[node]
                self.noted.discard(node)
                self.returning[node] = now
        if self.next_kill is not None and now >= self.next_kill:
            self.next_kill += self.every_s
            alive = sorted(self.ready - set(self.dead) - set(self.returning))
            if alive:
                node = self.rng.choice(alive)
                if self._call(kill_node, self.b, node):
                    self.dead[node] = now
                    self.kills += 1
        self.max_dead = max(self.max_dead, len(self.dead) + len(self.returning))

    def check(self, nodes: list, now: float) -> None:
        """From a node listing: finish returns (Ready -> uncordon, forget), note NotReady times,
        clear late cordons."""
        self.ready = {n.metadata.name for n in nodes if node_ready(n)}
        for n in nodes:
            name = n.metadata.name
            if name in self.dead:
                if not node_ready(n) and name not in self.noted:
                    self.noted.add(name)
                    self.not_ready_after_s.append(now - self.dead[name])
                continue
            if name in self.returning:
                since = self.returning[name]
                if node_ready(n):
                    if self._call(forget_failure, self.b, name, n):
                        del self.returning[name]
                        self.returns += 1
                        self.back_after_s.append(now - since)
                elif now - since > self.RETURN_DEADLINE_S and name not in self.slow_returns:
                    self.slow_returns.append(name)
                    self._call(revive_node, self.b, name)   # once more
                    self.b.killed.add(name)                 # still to give back at the end
                continue
            annotated = any(k.startswith("crucible.dev/") for k in n.metadata.annotations or {})
            if node_ready(n) and (n.spec.unschedulable or annotated):
                if self._call(forget_failure, self.b, name, n):
                    self.late_cordons += 1
                    print(f"  {name}: Ready but cordoned or annotated, not by this churn's "
                          "kill (an earlier run's, or a late cordon); cleared")

    def _call(self, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as err:  # noqa: BLE001 - the churn goes on; counted, reported
            self.errors += 1
            print(f"  churn: {fn.__name__}{args[1:2]}: {err}", file=sys.stderr)
            return False

    def report(self) -> dict:
        back, gone = sorted(self.back_after_s), sorted(self.not_ready_after_s)
        return {"every_s": self.every_s, "down_s": self.down_s, "kills": self.kills,
                "returns_completed": self.returns, "max_down_at_once": self.max_dead,
                "kill_to_not_ready_p50_s": round(gone[len(gone) // 2], 1) if gone else None,
                "return_to_ready_p50_s": round(back[len(back) // 2], 1) if back else None,
                "return_to_ready_max_s": round(back[-1], 1) if back else None,
                "slow_returns": self.slow_returns, "late_cordons_cleared": self.late_cordons,
                "api_errors": self.errors}


class Phases:
    """Per-job time in each phase, from samples of the jobs' statuses: the interval between two
    samples counts in the phase seen at its start."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.last: dict[str, str] = {}
        self.last_t: float | None = None
        self.time: dict[str, dict[str, float]] = {n: {} for n in names}
        self.total_s = 0.0
        self.running_jobs_s = 0.0      # integral of the count of Running jobs
        self.series: list[list] = []   # [t since start, Running, Waiting, other]
        self.failed_seen: dict[str, float] = {}

    def sample(self, now: float, t0: float, jobs: list[dict]) -> dict[str, str]:
        phases = {j["metadata"]["name"]: (j.get("status") or {}).get("phase") or "None"
                  for j in jobs}
        if self.last_t is not None:
            dt = now - self.last_t
            self.total_s += dt
            for name in self.names:
                if name not in self.last:     # submitted since the last sample
                    continue
                phase = self.last[name]
                self.time[name][phase] = self.time[name].get(phase, 0.0) + dt
            self.running_jobs_s += dt * sum(1 for p in self.last.values() if p == "Running")
        for name, phase in phases.items():
            if phase == "Failed":
                self.failed_seen.setdefault(name, round(now - t0, 1))
        self.last, self.last_t = phases, now
        running = sum(1 for p in phases.values() if p == "Running")
        waiting = sum(1 for p in phases.values() if p == "Waiting")
        self.series.append([round(now - t0, 1), running, waiting, len(phases) - running - waiting])
        return phases

    def add(self, name: str) -> None:
        """A job submitted after the start: its shares count from its first sample."""
        self.names.append(name)
        self.time[name] = {}

    def running_s(self, name: str) -> float:
        return self.time[name].get("Running", 0.0)

    def share(self, name: str, phase: str) -> float:
        return self.time[name].get(phase, 0.0) / self.total_s if self.total_s else 0.0


EVENT_REASONS = ("CapacityReleased", "CapacityRetry", "InsufficientCapacity", "NodeFailure",
                 "CordonRateLimited")


def _events(b: Bench) -> dict[str, list[tuple[str, str, int]]]:
    """{reason: [(job, message, count)]} of the operator's capacity and node events (it posts one
    Event per job, reason and message, and raises its count on a repeat)."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    for reason in EVENT_REASONS:
        items = b.core.list_namespaced_event(b.ns, field_selector=f"reason={reason}",
                                             _request_timeout=60).items
        out[reason] = [(ev.involved_object.name, ev.message or "", ev.count or 1) for ev in items]
    return out


def _per_job(events: list[tuple[str, str, int]]) -> dict[str, int]:
    per: dict[str, int] = {}
    for job, _message, count in events:
        per[job] = per.get(job, 0) + count
    return per


def node_failure_events(events: dict) -> dict:
    """NodeFailure events split by what they say: a pod counted as lost on a failed node (of
    which those on a node Ready again whose unreachable taint the node controller had not lifted
    yet: "is tainted ..."), and a node cordoned (one event per job that cordoned it)."""
    pods = [(m, n) for _, m, n in events.get("NodeFailure", []) if " under pod " in m]
    cordons = [(m, n) for _, m, n in events.get("NodeFailure", [])
               if m.endswith("cordoned and annotated it")]
    nodes_cordoned = {m.split()[1] for m, _ in cordons}
    return {"pods_lost": sum(n for _, n in pods),
            "pods_lost_on_node_ready_but_still_tainted": sum(
                n for m, n in pods if " is tainted node.kubernetes.io/" in m),
            "cordons": sum(n for _, n in cordons), "nodes_cordoned": len(nodes_cordoned),
            "cordons_rate_limited": sum(n for _, _, n in events.get("CordonRateLimited", []))}


def capacity_case(args) -> int:
    fits = (args.nodes * (GPUS_PER_NODE // args.gpus_per_pod)) // args.pods
    results: dict = {"case": "capacity", "jobs": args.jobs, "pods_per_job": args.pods,
                     "gpus_per_pod": args.gpus_per_pod, "nodes": args.nodes,
                     "jobs_that_fit": fits, "node_lease_s": args.node_lease_s,
                     "fault_tolerance": CAPACITY_FT, "settle_s": args.settle_s,
                     "churn_minutes": args.churn_minutes, "sample_s": args.sample_s,
                     "run_minutes": args.run_minutes, "seed": args.seed, "cpus": os.cpu_count(),
                     "operator_workers": _operator_workers(),
                     "load_average_at_start": os.getloadavg()[0]}
    print(f"capacity case: {args.jobs} jobs x {args.pods} pods x {args.gpus_per_pod} GPUs on "
          f"{args.nodes} nodes x {GPUS_PER_NODE} GPUs: {fits} jobs fit at once")
    with Bench(args, "operator_scale_capacity.log", forget=True) as b:
        time.sleep(3)  # the operator's watches start
        names = [f"job-{i:03d}" for i in range(args.jobs)]
        start = time.monotonic()
        body = lambda n: b.job_body(n, args.pods, CAPACITY_FT, args.gpus_per_pod)  # noqa: E731
        b.create_jobs(names, body)
        print(f"created {args.jobs} jobs in {time.monotonic() - start:.1f}s")
        created_at = {name: 0.0 for name in names}
        finished: dict[str, dict] = {}     # name -> its last status, when the bench deleted it
        churn = Churn(b, args.churn_every_s, args.churn_down_s, random.Random(args.seed))
        whole, window = Phases(names), Phases(names)
        churn_start = start + args.settle_s
        churn_end = churn_start + args.churn_minutes * 60
        next_sample, next_report, started = start, start, False
        first_running_at: dict[str, float] = {}
        phases: dict[str, str] = {}
        jobs: list[dict] = []
        while True:
            now = time.monotonic()
            if not started and now >= churn_start:
                started = True
                churn.start(now)
                results["at_churn_start"] = {"reconcile": scrape(b.metrics_port),
                                             "operator_cpu_s": cpu_seconds(b.operator.pid),
                                             "phases": _count(phases)}
                print(f"churn starts: {results['at_churn_start']['phases']}")
            if started:
                churn.tick(now)
            if now >= next_sample or now >= churn_end:
                try:
                    jobs = b.list_jobs()
                    nodes = b.core.list_node(label_selector="type=kwok", _request_timeout=30).items
                except Exception as err:  # noqa: BLE001 - a slow apiserver: sample next time
                    print(f"  sample failed: {err}", file=sys.stderr)
                else:
                    now = time.monotonic()
                    jobs += [{"metadata": {"name": n}, "status": {"phase": "Finished"}}
                             for n in finished]
                    phases = whole.sample(now, start, jobs)
                    if started:
                        window.sample(now, churn_start, jobs)
                    if args.run_minutes:
                        done = [j for j in jobs if j["metadata"]["name"] not in finished
                                and whole.running_s(j["metadata"]["name"]) >= args.run_minutes * 60]
                        for name in _finish(b, done, finished, names, body):
                            created_at[name] = time.monotonic() - start
                            whole.add(name)
                            window.add(name)
                    for name, phase in phases.items():
                        if phase == "Running":
                            first_running_at.setdefault(name, now - start)
                    churn.check(nodes, now)
                    assert b.operator.poll() is None, "the operator exited"
                next_sample = max(next_sample + args.sample_s, time.monotonic())
                if now >= next_report:
                    next_report = now + 60
                    print(f"  t={now - start:6.0f}s {_count(phases)}; nodes down "
                          f"{len(churn.dead) + len(churn.returning)}, kills {churn.kills}, "
                          f"returns {churn.returns}; operator "
                          f"{memory_mb(b.operator.pid)['rss_mb']} MB")
            if now >= churn_end:
                break
            time.sleep(max(0.0, min(1.0, next_sample - time.monotonic(), churn_end - now)))
        end_jobs = [j for j in jobs if j["metadata"]["name"] not in finished]
        end_jobs += [{"metadata": {"name": n}, "status": status} for n, status in finished.items()]
        results["jobs_submitted"], results["jobs_finished"] = len(names), len(finished)
        b.killed.update(churn.returning)   # given back but not yet forgotten: close() does it
        results["wall_s"] = round(time.monotonic() - start, 1)
        results["churn"] = churn.report()
        results["reconcile"] = scrape(b.metrics_port)
        churn_reconcile = scrape(b.metrics_port, since=results["at_churn_start"]["reconcile"])
        for d in (results["reconcile"], churn_reconcile, results["at_churn_start"]["reconcile"]):
            d.pop("_buckets")
        window_s = time.monotonic() - churn_start
        cpu = cpu_seconds(b.operator.pid)
        results["during_churn"] = {
            "reconcile": churn_reconcile,
            "passes_per_s": round(churn_reconcile["passes"] / window_s, 2),
            "operator_cpu_s": round(cpu - results["at_churn_start"]["operator_cpu_s"], 1),
            "operator_cpu_share": round((cpu - results["at_churn_start"]["operator_cpu_s"])
                                        / window_s, 3)}
        results["at_churn_start"]["operator_cpu_s"] = round(
            results["at_churn_start"]["operator_cpu_s"], 1)
        results["memory"] = memory_mb(b.operator.pid)
        try:
            events = _events(b)
        except Exception as err:  # noqa: BLE001 - reported as missing
            print(f"events: {err}", file=sys.stderr)
            events = {}
    # The stack is down from here; everything needed was read above.
    summarize(results, names, end_jobs, whole, window, events, first_running_at, fits, args,
              created_at, results["wall_s"])
    write_results(args.out, results)
    print(f"results: {args.out}")
    failed = results["end"]["phases"].get("Failed", 0)
    return 0 if not failed and not results["restarts"]["application"] else 1


def _finish(b: Bench, done: list[dict], finished: dict[str, dict], names: list[str], body
            ) -> list[str]:
    """The jobs in `done` have run their --run-minutes: deleted, as their owners would once they
    are done (the operator takes their pods away and frees the room), each replaced by a new job
    so the demand stays twice the capacity. The names of the new jobs."""
    crd, new = b.crd, []
    for job in done:
        name = job["metadata"]["name"]
        try:
            b.objs.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, b.ns, crd.PLURAL, name,
                                                   _request_timeout=30)
        except Exception as err:  # noqa: BLE001 - a slow apiserver: tried at the next sample
            print(f"  finish {name}: {err}", file=sys.stderr)
            continue
        finished[name] = {**(job.get("status") or {}), "phase": "Finished"}
        new.append(f"job-{len(names):03d}")
        names.append(new[-1])
    if new:
        b.create_jobs(new, body)
    return new


def _count(phases: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for phase in phases.values():
        out[phase] = out.get(phase, 0) + 1
    return dict(sorted(out.items()))


def _pcts(values: list[float]) -> dict:
    v = sorted(values)
    if not v:
        return {}
    return {"mean": round(sum(v) / len(v), 3), "min": round(v[0], 3),
            "p50": round(v[len(v) // 2], 3), "max": round(v[-1], 3)}


def summarize(results, names, end_jobs, whole: Phases, window: Phases, events, first_running_at,
              fits, args, created_at: dict[str, float], end_s: float) -> None:
    by_name = {j["metadata"]["name"]: j for j in end_jobs}
    released = _per_job(events.get("CapacityReleased", []))
    retried = _per_job(events.get("CapacityRetry", []))
    per_job, by_cause = {}, {}
    totals = {"total": 0, "application": 0, "infrastructure": 0}
    for name in names:
        status = (by_name.get(name) or {}).get("status") or {}
        r = status.get("restarts") or {}
        for key in totals:
            totals[key] += int(r.get(key, 0))
        for cause, n in (r.get("byCause") or {}).items():
            by_cause[cause] = by_cause.get(cause, 0) + int(n)
        per_job[name] = {
            "running_share": round(window.share(name, "Running"), 3),
            "waiting_share": round(window.share(name, "Waiting"), 3),
            "running_share_whole_run": round(whole.share(name, "Running"), 3),
            "first_running_s": (round(first_running_at[name], 1) if name in first_running_at
                                else None),
            "created_s": round(created_at[name], 1),
            "phase_end": status.get("phase"),
            "restarts": {"application": int(r.get("application", 0)),
                         "infrastructure": int(r.get("infrastructure", 0)),
                         "byCause": r.get("byCause") or {}},
            "capacity_released": released.get(name, 0), "capacity_retries": retried.get(name, 0),
            "pod_generation": status.get("podGeneration", 0),
        }
        if status.get("phase") == "Failed":
            cond = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed"),
                        {})
            per_job[name]["message"] = (f"{cond.get('reason')}: {cond.get('message')}" if cond
                                        else status.get("message"))
    shares = [j["running_share"] for j in per_job.values()]
    end_phases = _count({n: (by_name.get(n, {}).get("status") or {}).get("phase") or "None"
                         for n in names})
    phase_share: dict[str, float] = {}
    for name in names:
        for phase in window.time[name]:
            phase_share[phase] = phase_share.get(phase, 0.0) + window.share(name, phase) / len(names)
    mean_running = window.running_jobs_s / window.total_s if window.total_s else 0.0
    results.update({
        "running_share": {**_pcts(shares), "ceiling": round(fits / len(names), 3),
                          "jobs_never_running_in_churn": sum(1 for s in shares if s == 0)},
        "running_share_whole_run": _pcts([j["running_share_whole_run"]
                                          for j in per_job.values()]),
        "phase_share": {k: round(v, 3) for k, v in sorted(phase_share.items())},
        "mean_jobs_running": round(mean_running, 2),
        "utilization": round(mean_running / fits, 3) if fits else None,
        "restarts": {**totals, "byCause": dict(sorted(by_cause.items()))},
        "end": {"phases": end_phases,
                "failed": {n: j.get("message") for n, j in per_job.items()
                           if j["phase_end"] == "Failed"},
                "failed_seen_during_run": whole.failed_seen},
        "events": {reason: sum(n for _, _, n in items) for reason, items in events.items()},
        "node_failures": node_failure_events(events),
        "jobs_never_running": [n for n in names if n not in first_running_at],
        "starvation": starvation(names, created_at, first_running_at, end_s),
        "series": whole.series,
        "per_job": per_job,
    })
    results["goals"] = {"no_job_failed": not end_phases.get("Failed") and not whole.failed_seen,
                        "application_restarts_zero": totals["application"] == 0}
    print_table(results)


def starvation(names, created_at: dict[str, float], first_running_at: dict[str, float],
               end_s: float) -> dict:
    """How long jobs waited for their first Running, and how old the oldest never-running one
    is at the end: under a first-come order with finishing jobs it stays near the typical wait;
    a starved job's age grows with the run. `overtaken`: jobs that first ran while one created
    earlier had not run yet, and that earlier one was still waiting (it ran later, or never)."""
    waits = [first_running_at[n] - created_at[n] for n in names if n in first_running_at]
    never = {n: round(end_s - created_at[n], 1) for n in names if n not in first_running_at}
    start = {n: first_running_at.get(n, float("inf")) for n in names}
    overtaken = sum(1 for n in names for e in names
                    if created_at[e] < created_at[n] - 1 and start[e] > start[n] + 1)
    return {"jobs_that_ran": len(waits), "wait_to_first_running_s": _pcts(waits),
            "never_running": len(never),
            "oldest_never_running_age_s": max(never.values()) if never else None,
            "overtaken_pairs": overtaken}


def print_table(results: dict) -> None:
    per_job = results["per_job"]
    print()
    print(f"{'job':<9} {'run%':>5} {'wait%':>5} {'first':>6} {'end':<10} {'app':>3} {'infra':>5} "
          f"{'rel':>4} {'retry':>5} {'gen':>4}  causes")
    for name, j in per_job.items():
        first = "-" if j["first_running_s"] is None else f"{j['first_running_s']:.0f}"
        causes = ",".join(f"{k}={v}" for k, v in sorted(j["restarts"]["byCause"].items()))
        print(f"{name:<9} {100 * j['running_share']:5.1f} {100 * j['waiting_share']:5.1f} "
              f"{first:>6} {str(j['phase_end']):<10} {j['restarts']['application']:>3} "
              f"{j['restarts']['infrastructure']:>5} {j['capacity_released']:>4} "
              f"{j['capacity_retries']:>5} {j['pod_generation']:>4}  {causes}")
    rs, ch, dc = results["running_share"], results["churn"], results["during_churn"]
    rows = [
        ("setup", f"{results['jobs']} jobs x {results['pods_per_job']} pods x "
                  f"{results['gpus_per_pod']} GPUs on {results['nodes']} nodes "
                  f"({results['jobs_that_fit']} jobs fit); churn {results['churn_minutes']} min"),
        ("running share (churn window)", f"mean {100 * rs.get('mean', 0):.1f}% (ceiling "
         f"{100 * rs['ceiling']:.0f}%), min {100 * rs.get('min', 0):.1f}%, p50 "
         f"{100 * rs.get('p50', 0):.1f}%, max {100 * rs.get('max', 0):.1f}%; "
         f"{rs['jobs_never_running_in_churn']} jobs never Running"),
        ("mean jobs Running / utilization", f"{results['mean_jobs_running']} / "
         f"{100 * (results['utilization'] or 0):.1f}% of the {results['jobs_that_fit']} that fit"),
        ("phase share (churn window)", ", ".join(f"{k} {100 * v:.1f}%"
                                                 for k, v in results["phase_share"].items())),
        ("wait for the first Running", "{jobs_that_ran} jobs ran: {wait_to_first_running_s}; "
         "{never_running} never ran, the oldest {oldest_never_running_age_s}s old at the end; "
         "{overtaken_pairs} pairs where a later job ran first".format(**results["starvation"])),
        ("submitted / finished", f"{results['jobs_submitted']} / {results['jobs_finished']} "
         f"(each runs {results['run_minutes']} min; 0: never finishes)"),
        ("restarts (sum over jobs)", f"total {results['restarts']['total']}, application "
         f"{results['restarts']['application']}, infrastructure "
         f"{results['restarts']['infrastructure']}; "
         + ", ".join(f"{k} {v}" for k, v in results["restarts"]["byCause"].items())),
        ("jobs at the end", ", ".join(f"{k} {v}" for k, v in results["end"]["phases"].items())),
        ("events", ", ".join(f"{k} {v}" for k, v in results["events"].items())),
        ("node failures", "{pods_lost} pods lost on failed nodes, of which "
         "{pods_lost_on_node_ready_but_still_tainted} on a node Ready again but still tainted "
         "unreachable; {cordons} cordons of {nodes_cordoned} nodes, {cordons_rate_limited} "
         "rate-limited".format(**results["node_failures"])),
        ("churn", f"{ch['kills']} kills every {ch['every_s']:.0f}s, {ch['returns_completed']} "
         f"returns (down {ch['down_s']:.0f}s; back Ready p50 {ch['return_to_ready_p50_s']}s), "
         f"max {ch['max_down_at_once']} down at once, {ch['late_cordons_cleared']} late cordons, "
         f"{ch['api_errors']} API errors"),
        ("reconcile (churn window)", f"{dc['reconcile']['passes']} passes "
         f"({dc['passes_per_s']}/s), p50 {dc['reconcile']['p50_s']}s, p99 "
         f"{dc['reconcile']['p99_s']}s; queue p99 {dc['reconcile']['queue_p99_s']}s"),
        ("operator", f"CPU {dc['operator_cpu_s']}s in the churn ({100 * dc['operator_cpu_share']:.1f}%"
         f" of a core); RSS {results['memory']['rss_mb']} MB, peak "
         f"{results['memory']['peak_rss_mb']} MB"),
        ("goals", ", ".join(f"{k}: {'met' if v else 'NOT MET'}"
                            for k, v in results["goals"].items())),
    ]
    print()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if results["end"]["failed"]:
        print("Failed jobs:")
        for name, message in results["end"]["failed"].items():
            print(f"  {name}: {message}")


# --- command line --------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("scale", "capacity"), default="scale",
                        help="scale: start-up and one node loss (default); capacity: twice the "
                        "demand the cluster holds, with node churn")
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--pods", type=int, default=8, help="pods per job (nodes.min = max)")
    parser.add_argument("--nodes", type=int, default=None, help="KWOK nodes (default: 200; "
                        "capacity case 100)")
    parser.add_argument("--node-lease-s", type=int, default=20,
                        help="KWOK node Lease duration (the node grace is twice it)")
    parser.add_argument("--gpus-per-pod", type=int, default=2, choices=(1, 2, 4, 8),
                        help="capacity case: GPUs each pod asks for (a node has 8)")
    parser.add_argument("--settle-s", type=float, default=180,
                        help="capacity case: from the creates to the start of the churn")
    parser.add_argument("--churn-minutes", type=float, default=30,
                        help="capacity case: how long nodes die and come back")
    parser.add_argument("--churn-every-s", type=float, default=30,
                        help="capacity case: one node dies this often")
    parser.add_argument("--churn-down-s", type=float, default=120,
                        help="capacity case: a dead node is given back after this long")
    parser.add_argument("--sample-s", type=float, default=5,
                        help="capacity case: how often the jobs' phases are sampled")
    parser.add_argument("--run-minutes", type=float, default=0,
                        help="capacity case: a job Running this long in all finishes (the bench "
                        "deletes it) and a new one is submitted; 0 (default): jobs never finish")
    parser.add_argument("--seed", type=int, default=1, help="capacity case: which nodes die")
    parser.add_argument("--keep-stack", action="store_true")
    parser.add_argument("--out", default=None, help="results file (default: "
                        "bench/results/operator_scale.json; capacity case "
                        "operator_scale_capacity.json)")
    args = parser.parse_args()
    # SIGTERM (timeout, a CI cancel) unwinds like Ctrl-C: nodes given back, stack stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    capacity = args.case == "capacity"
    if args.nodes is None:
        args.nodes = 100 if capacity else 200
    if args.out is None:
        args.out = str(REPO / "bench" / "results" / ("operator_scale_capacity.json" if capacity
                                                      else "operator_scale.json"))
    return capacity_case(args) if capacity else scale_case(args)


if __name__ == "__main__":
    sys.exit(main())
