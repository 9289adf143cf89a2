"""Operator at scale: 100 PretrainJobs x 8 pods on 200 KWOK nodes, then a node loss.

    ~/.cache/crucible/venv/bin/python bench/operator_scale.py [--jobs 100] [--pods 8] [--nodes 200]

Starts its own instance of the local stack (e2e/stack.sh with its own state folder, port offset
and CRUCIBLE_KWOK_NODES, so the shared test stack is left alone) unless --stack-env names the env
file of a running one, runs `crucible-operator run -A` as a real process with admin credentials,
and measures:

  * time from the first create until every pod is Running and every job's status says Running;
  * per-job latency from its create to phase Running (p50/p99, client clock, 50 ms polling);
  * reconcile pass duration p50/p99 (the operator's crucible_operator_reconcile_seconds
    histogram, quantiles interpolated within buckets as PromQL's histogram_quantile does);
  * operator memory: VmRSS at the end and VmHWM (peak) from /proc;
  * node loss: one node's heartbeat stops; time from the node controller marking it NotReady to
    every pod that was on it Running on another node, against the goal nodeFailureGraceSeconds
    + 15 s.

Goals (docs/operator.md, "Scale"): all Running <= 60 s, reconcile p99 <= 2 s, RSS <= 300 MB.
Results go to bench/results/operator_scale.json. Every wait has a deadline; the node is revived
and the stack stopped (unless --keep-stack) whatever happens.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
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


def memory_mb(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    kb = lambda key: int(fields[key].split()[0])  # noqa: E731
    return {"rss_mb": round(kb("VmRSS") / 1024, 1), "peak_rss_mb": round(kb("VmHWM") / 1024, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--pods", type=int, default=8, help="pods per job (nodes.min = max)")
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--node-lease-s", type=int, default=20,
                        help="KWOK node Lease duration (the node grace is twice it)")
    parser.add_argument("--keep-stack", action="store_true")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "operator_scale.json"))
    args = parser.parse_args()

    from kubernetes import client, config, watch

    import yaml

    from crucible.operator import crd

    stack_env, shell_env = stack(args)
    kubeconfig = stack_env["KUBECONFIG"]
    api = config.new_client_from_config(config_file=kubeconfig)
    api.configuration.connection_pool_maxsize = 32
    core, objs = client.CoreV1Api(api), client.CustomObjectsApi(api)
    ext = client.ApiextensionsV1Api(api)
    doc = yaml.safe_load((REPO / "manifests/crd/pretrainjobs.crucible.dev.yaml").read_text())
    try:
        ext.create_custom_resource_definition(doc)
    except client.exceptions.ApiException as err:
        if err.status != 409:
            raise
    ns = f"bench-{int(time.time())}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    deadline = time.monotonic() + 60
    while True:
        try:
            core.read_namespaced_service_account("default", ns)
            objs.list_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL)
            break
        except client.exceptions.ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)

    metrics_port = 18000 + PORT_OFFSET
    log_path = Path(tempfile.gettempdir()) / "operator_scale.log"
    print(f"operator log: {log_path}")
    log = open(log_path, "w")
    op_env = dict(os.environ, KUBECONFIG=kubeconfig)
    operator = subprocess.Popen([sys.executable, "-m", "crucible.operator.main", "run", "-A",
                                 "--interval", "10", "--metrics-port", str(metrics_port)],
                                env=op_env, stdout=log, stderr=subprocess.STDOUT)
    results: dict = {"jobs": args.jobs, "pods_per_job": args.pods, "nodes": args.nodes,
                     "node_lease_s": args.node_lease_s, "cpus": os.cpu_count(),
                     "load_average_at_start": os.getloadavg()[0]}
    victim = None
    stop = threading.Event()
    try:
        time.sleep(3)  # the operator's watches start
        names = [f"job-{i:03d}" for i in range(args.jobs)]

        def body(name):
            return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
                    "spec": {"image": "registry.invalid/crucible-trainer:bench",
                             "nodes": {"min": args.pods, "max": args.pods}, "procsPerNode": 8,
                             "resources": {"limits": {"nvidia.com/gpu": 1}},
                             "model": {"preset": "gpt2-124m"},
                             "data": {"train": "s3://crucible/tokens/train"},
                             "training": {"tokens": 2.5e9},
                             "faultTolerance": {"hangTimeoutSeconds": 3600,
                                                "nodeFailureGraceSeconds": GRACE_S}}}

        # Watches, not polling: listing 800 pods every few ms would load the apiserver more than
        # the operator does, and the figures would measure the benchmark.
        created, running_at, pods_running, lock = {}, {}, set(), threading.Lock()

        def follow(list_fn, on_event, *fn_args):
            w = watch.Watch()
            while not stop.is_set():
                for event in w.stream(list_fn, *fn_args, timeout_seconds=5):
                    with lock:
                        on_event(event["type"], event["object"])
                    if stop.is_set():
                        w.stop()

        def on_job(kind, obj):
            name = obj["metadata"]["name"]
            if (obj.get("status") or {}).get("phase") == "Running":
                running_at.setdefault(name, time.monotonic())

        def on_pod(kind, pod):
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
                        objs.list_namespaced_custom_object, on_job, crd.GROUP, crd.VERSION, ns,
                        crd.PLURAL)),
                    threading.Thread(target=follow, daemon=True, args=(
                        core.list_namespaced_pod, on_pod, ns))]
        for t in watchers:
            t.start()
        time.sleep(1)
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for name, when in pool.map(lambda n: (n, objs.create_namespaced_custom_object(
                    crd.GROUP, crd.VERSION, ns, crd.PLURAL, body(n)) and time.monotonic()), names):
                created[name] = when
        print(f"created {args.jobs} jobs in {time.monotonic() - start:.1f}s")
        want = args.jobs * args.pods
        deadline = start + 600
        while time.monotonic() < deadline:
            with lock:
                if len(seen) >= want and "pods_created_s" not in results:
                    results["pods_created_s"] = round(time.monotonic() - start, 1)  # operator's share
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
        core.patch_node(victim, {"metadata": {"labels": {stack_env["CRUCIBLE_KWOK_LABEL"]: "dead"}}})
        killed = time.monotonic()
        deadline = killed + 300

        def ready(node) -> bool:
            return next(c for c in core.read_node(node).status.conditions
                        if c.type == "Ready").status == "True"

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
            "pods_on_node": len(lost), "heartbeat_stop_to_not_ready_s": round(not_ready - killed, 1),
            "not_ready_to_running_elsewhere_s": round(moved_s, 1), "grace_s": GRACE_S,
            "goal_s": GRACE_S + 15, "met": moved_s <= GRACE_S + 15,
            "worker_pods_moved": len(workers), "jobs_restarted_for_pod_0": len(store_jobs)}
        print(f"node {victim}: {len(lost)} pods Running elsewhere {moved_s:.1f}s after NotReady "
              f"(grace {GRACE_S}s)")
        results["reconcile"] = scrape(metrics_port)
        results["reconcile_steady_and_node_loss"] = scrape(
            metrics_port, since=results["reconcile_after_startup"])
        for key in ("reconcile", "reconcile_after_startup", "reconcile_steady_and_node_loss"):
            results[key].pop("_buckets")
        results["memory"] = memory_mb(operator.pid)
        results["goals"] = {"all_running_le_60s": results["all_running_s"] <= 60,
                            "reconcile_p99_le_2s": results["reconcile"]["p99_s"] <= 2,
                            "reconcile_p99_le_2s_after_startup":
                                results["reconcile_steady_and_node_loss"]["p99_s"] <= 2,
                            "rss_le_300mb": results["memory"]["peak_rss_mb"] <= 300}
    finally:
        stop.set()
        if victim:
            core.patch_node(victim, {"metadata": {"labels": {
                stack_env["CRUCIBLE_KWOK_LABEL"]: "managed"}}, "spec": {"unschedulable": None}})
        try:
            objs.delete_collection_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL)
            time.sleep(5)
        finally:
            operator.terminate()
            operator.wait(30)
            core.delete_namespace(ns)
            if not args.keep_stack:
                subprocess.run([str(REPO / "e2e" / "stack.sh"), "down"], env=shell_env)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
