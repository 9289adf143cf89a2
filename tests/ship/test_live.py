"""The installed chart at work: its operator identity runs the real operator, a real trainer
reports to it, the stack's real Prometheus scrapes both, and the dashboard, the alert rules and
the RBAC are checked against what happened.

One module-scoped run (`live`):
  1. the chart installed into the stack (`release`, serving one namespace);
  2. `crucible-operator run` as a process, under a real token of the chart's ServiceAccount,
     with its metrics and kopf liveness endpoint (what the chart's probes call);
  3. a PretrainJob; KWOK runs its pod, so the training itself runs here as a local process
     (`crucible train` on the real-text corpus, 30 steps, a checkpoint and an eval every 10),
     reporting through the job's progress Lease under the per-job trainer ServiceAccount the
     operator made, exactly as in a pod (POD_NAMESPACE, POD_NAME); step 15's loss is made NaN
     (CRUCIBLE_INJECT, trainer/faults.py), so the stability guard gives a real verdict;
  4. once it has trained: its pod killed by a signal (exit 137, a restart with cause Signal),
     and a second job failing for good (exit 1 with maxRestarts 0);
  5. Prometheus scrapes the operator (honor_labels) and the trainer (not: its target is labelled
     with the namespace and job, as the chart's PodMonitor does) and evaluates the alert rules.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.operator.cluster import Cluster, free_port
from tests.operator.test_progress_lease import trainer_kubeconfig
from tests.support.chart import Release
from tests.support.metric_names import exported_metric_names
from tests.support.repo import REPO
from tests.support.services import Kube, Prometheus, eventually
from tests.support.training import crucible_cmd, job_config, write_config

pytestmark = pytest.mark.stack

DASHBOARD = REPO / "manifests" / "grafana" / "crucible-dashboard.json"
ALERTS = REPO / "manifests" / "prometheus" / "crucible-alerts.yaml"
STEPS = 30


@dataclass
class Live:
    release: Release
    job: str
    failed_job: str
    namespace: str
    start: float
    end: float
    trainer_account: str
    operator_log: Path


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def query_range(prometheus: Prometheus, expr: str, start: float, end: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1"})
    with urllib.request.urlopen(f"{prometheus.url}/api/v1/query_range?{params}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def live(kube: Kube, release: Release, prometheus: Prometheus, stack_env, corpus,
         tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    ns = release.jobs_namespace
    cluster = Cluster(kube, ns)
    name, doomed = f"dash-{secrets.token_hex(3)}", f"doomed-{secrets.token_hex(3)}"
    metrics_port, health_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(release.operator_kubeconfig),
           "CRUCIBLE_OPERATOR_METRICS_ADDRESS": "127.0.0.1"}
    env.pop("PYTHONPATH", None)
    log = tmp / "operator.log"
    operator = subprocess.Popen(
        [sys.executable, "-m", "crucible.operator.main", "run", f"--namespace={ns}",
         "--interval=2", "--workers=4", f"--metrics-port={metrics_port}",
         f"--liveness=http://127.0.0.1:{health_port}/healthz"],
        cwd=REPO, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    targets, trainer = [], None
    rules = Path(stack_env["CRUCIBLE_PROMETHEUS_RULES_DIR"]) / f"{release.name}-alerts.yml"
    try:
        rules.write_text(ALERTS.read_text())
        _reload(prometheus)
        targets.append(prometheus.add_target(f"{release.name}-operator",
                                             f"127.0.0.1:{metrics_port}"))
        eventually(lambda: _get(f"http://127.0.0.1:{health_port}/healthz")[0] == 200, 60,
                   f"the operator's liveness endpoint (log: {log})")
        start = time.time()
        cluster.create_job(name, nodes={"min": 1, "max": 1},
                           checkpoint={"uri": f"s3://crucible/ship/{name}", "everyMinutes": 1})
        cluster.wait_running(name, 1, generation=0)
        kubeconfig = eventually(lambda: trainer_kubeconfig(cluster, name, tmp / "trainer"), 30,
                                "the trainer's ServiceAccount")
        # The trainer, as the pod would run it (one process; the operator's pod is KWOK's).
        out = tmp / "run"
        # 1024-token steps (one micro-batch of 8 x 128) keep it to seconds on a shared CPU. The
        # exporter's port is chosen here so Prometheus scrapes it from its first second.
        port = free_port()
        cfg = job_config(corpus, out, name=name, steps=STEPS, batch_tokens=1024, evalEvery=10,
                         evalTokens=4096)
        cfg["checkpoint"] = {"uri": str(out / "ckpt"), "everySteps": 10, "inMemoryEverySteps": 5}
        cfg["metrics"] = {"port": port}
        # The injected NaN is to be the guard's one verdict: this 0.66M-parameter run's own
        # gradient norm can swing by 12 to 18 MADs on its own after the NaN (seen on one CI
        # machine), which at the usual thresholds skips updates and rolls back from storage.
        cfg["faultTolerance"] = {"spikeGuard": {"minHistory": 8, "zSkip": 50, "zSpike": 40}}
        # As the chart's PodMonitor scrapes it: namespace from the pod, job from its
        # crucible.dev/job label, the trainer's own labels not honoured.
        targets.append(prometheus.add_target(f"{release.name}-trainer", f"127.0.0.1:{port}",
                                             {"namespace": ns, "job": name}, pod=True))
        train_env = {**os.environ, "OMP_NUM_THREADS": "1", "KUBECONFIG": kubeconfig,
                     "POD_NAMESPACE": ns, "POD_NAME": f"{name}-0-0", "CRUCIBLE_INJECT": "nan@15",
                     "CRUCIBLE_MEMORY_DIR": str(tmp / "memory")}
        # Two runs, as a pod restarted by torchrun would: the second restores step 10 from the
        # first's in-memory snapshot, so the recovery panels and status.lastRestore have data.
        # The NaN falls in the second, with steps before and after it for Prometheus to scrape
        # (the first run's counters are gone with its process).
        # The second run's steps are made 5x slower (CRUCIBLE_SLOW_RANK, ~0.3 s a step, not
        # ~60 ms): Prometheus scrapes every 1 s, and at full speed the verdicts' zeros before
        # step 15 (without them `increase` sees no spike) or the gauges set from step 20 on
        # went unscraped in one run of four to ten.
        for more_steps, slow in ((["--max-steps", "10"], {}), ([], {"CRUCIBLE_SLOW_RANK": "0:5"})):
            trainer = subprocess.Popen(
                crucible_cmd("train", "--config", str(write_config(cfg, tmp / "job.yaml")),
                             *more_steps),
                cwd=REPO, stdout=open(tmp / "trainer.log", "ab"), stderr=subprocess.STDOUT,
                env={**train_env, **slow})
            eventually(lambda: _get(f"http://127.0.0.1:{port}/metrics")[0] == 200, 120,
                       "the trainer's /metrics")
            assert trainer.wait(timeout=300) == 0, (tmp / "trainer.log").read_text()[-3000:]
        status = eventually(lambda: (s := cluster.status(name)).get("lastCheckpoint") and
                            s.get("step") == STEPS and s, 30,
                            "the operator's status to show the trainer's progress")
        assert "goodput" in status
        # The second run's restore, from the trainer's own memory, reached the status.
        assert status["lastRestore"]["source"] == "memory", status
        assert status["lastRestore"]["step"] == 10, status
        # Chaos: the pod killed by a signal (a restart with cause Signal), and a job that fails.
        cluster.fail_pod(f"{name}-0-0", 137)
        cluster.create_job(doomed, nodes={"min": 1, "max": 1},
                           faultTolerance={"maxRestarts": 0})
        cluster.wait_running(doomed, 1, generation=0)
        cluster.fail_pod(f"{doomed}-0-0", 1)
        cluster.wait_phase(doomed, "Failed")
        eventually(lambda: prometheus.query(
            f'crucible_operator_job_restarts_by_cause_total{{job="{name}",cause="Signal"}}'), 60,
            "the restart scraped from the operator")
        eventually(lambda: prometheus.query(
            f'ALERTS{{alertname="CrucibleJobFailed",job="{doomed}",alertstate="firing"}}'), 60,
            "CrucibleJobFailed firing in the real Prometheus")
        yield Live(release, name, doomed, ns, start, time.time(), f"{name}-trainer", log)
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        for job in (name, doomed):
            try:
                cluster.delete_job(job)
            except ApiException:
                pass
        eventually(lambda: not cluster.objs.list_namespaced_custom_object(
            "crucible.dev", "v1alpha1", ns, "pretrainjobs")["items"], 30,
            "the operator to release its jobs")
        operator.terminate()
        try:
            operator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
        cluster.strip_finalizers()
        for target in targets:
            target.unlink(missing_ok=True)
        rules.unlink(missing_ok=True)
        _reload(prometheus)


def _reload(prometheus: Prometheus) -> None:
    req = urllib.request.Request(f"{prometheus.url}/-/reload", method="POST")
    urllib.request.urlopen(req, timeout=10).close()


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dash["panels"]
            for target in panel.get("targets", [])]


def _bind(expr: str, live: Live) -> str:
    """Grafana's variables as Grafana would substitute them for one job."""
    return (expr.replace("$namespace", live.namespace).replace("$job", live.job)
            .replace("$__rate_interval", "1m"))


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(crucible_[a-z_]+)", expr))


def test_every_dashboard_query_returns_data_from_the_real_run(live, prometheus):
    empty = []
    for title, expr in _dashboard_queries():
        result = query_range(prometheus, _bind(expr, live), live.start, live.end + 5)
        if not result:
            empty.append(f"{title}: {expr}")
    assert empty == [], "dashboard queries with no data:\n" + "\n".join(empty)


def test_dashboard_variables_find_the_job(live, prometheus):
    dash = json.loads(DASHBOARD.read_text())
    found = {}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"]).groups()
        expr = f"group by ({label}) ({_bind(metric, live)})"
        found[var["name"]] = {r["metric"][label] for r in
                              query_range(prometheus, expr, live.start, live.end + 5)}
    assert live.namespace in found["namespace"] and live.job in found["job"]


def test_every_metric_the_dashboard_and_the_rules_use_is_exported_and_was_scraped(live,
                                                                                   prometheus):
    used = set()
    for _, expr in _dashboard_queries():
        used |= _metric_names(expr)
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            used |= _metric_names(rule["expr"])
    assert used - exported_metric_names() == set()
    scraped = {r["metric"]["__name__"] for r in query_range(
        prometheus, 'group by (__name__) ({__name__=~"crucible_.+"})', live.start, live.end + 5)}
    assert used - scraped == set()


def test_alert_rules_load_into_the_real_prometheus_and_fire_on_the_run(live, prometheus):
    def ours() -> list[dict]:
        with urllib.request.urlopen(f"{prometheus.url}/api/v1/rules", timeout=10) as resp:
            groups = json.loads(resp.read())["data"]["groups"]
        return [r for g in groups if g["file"].endswith(f"{live.release.name}-alerts.yml")
                for r in g["rules"]]

    def firing() -> set[tuple[str, str]]:
        return {(a["labels"]["alertname"], a["labels"]["job"]) for r in ours()
                for a in r.get("alerts", []) if a["state"] == "firing"}

    rules = ours()
    alerts_in_file = sum(len(g["rules"]) for g in yaml.safe_load(
        (REPO / "manifests" / "prometheus" / "crucible-alerts.yaml").read_text())["groups"])
    assert len(rules) == alerts_in_file and all(r["health"] == "ok" for r in rules), rules
    # The failed job; the trained job's NaN step (the guard's skip and transient verdicts).
    expected = {("CrucibleJobFailed", live.failed_job), ("CrucibleLossSpike", live.job)}
    try:
        eventually(lambda: expected <= firing(), 30, f"{expected} firing")
    except AssertionError as err:
        # What Prometheus holds, to tell a missing sample from a rule that did not fire.
        spikes = query_range(prometheus, f'crucible_spikes_total{{job="{live.job}"}}',
                             live.start, time.time())
        raise AssertionError(f"{err}; firing: {sorted(firing())}; spike samples: "
                             f"{[(r['metric'].get('verdict'), r['values']) for r in spikes]}"
                             ) from None
    # Nothing else for the trained job: its loss fell, its checkpoints are fresh, one restart.
    assert {a for a in firing() if a[1] == live.job} == {("CrucibleLossSpike", live.job)}


# --- RBAC: `kubectl auth can-i` for both identities -------------------------------------------
def _can_i(kube: Kube, user: str, verb: str, resource: str, namespace: str | None,
           name: str | None = None) -> bool:
    """`kubectl auth can-i --as=<user>` (the SubjectAccessReview API it asks, when kubectl is
    absent). `resource` is plural[.group][/subresource]."""
    resource, _, sub = resource.partition("/")
    if shutil.which("kubectl"):
        args = ["kubectl", "--kubeconfig", str(kube.kubeconfig), "auth", "can-i", verb,
                f"{resource}{'/' + name if name else ''}", f"--as={user}"]
        args += ["-n", namespace] if namespace else []
        args += [f"--subresource={sub}"] if sub else []
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() in ("yes", "no"), out.stderr
        return out.stdout.strip() == "yes"
    plural, _, group = resource.partition(".")
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=user, groups=["system:serviceaccounts", "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, resource=plural, subresource=sub or None, group=group,
            namespace=namespace, name=name)))
    return client.AuthorizationV1Api(kube.client()).create_subject_access_review(
        review).status.allowed


def test_rbac_matrix_for_the_operator_and_the_trainer(live, kube):
    ns, job, other = live.namespace, live.job, live.release.namespace
    op = f"system:serviceaccount:{live.release.namespace}:{live.release.operator_account}"
    trainer = f"system:serviceaccount:{ns}:{live.trainer_account}"
    lease = "leases.coordination.k8s.io"
    matrix = [
        # the operator, in the namespace it serves: what reconciling needs
        (op, "watch", "pretrainjobs.crucible.dev", ns, None, True),
        (op, "patch", "pretrainjobs.crucible.dev/status", ns, None, True),
        (op, "create", "pods", ns, None, True),
        (op, "delete", "pods", ns, None, True),
        (op, "create", "configmaps", ns, None, True),
        (op, "create", lease, ns, None, True),
        (op, "create", "roles.rbac.authorization.k8s.io", ns, None, True),
        (op, "create", "events", ns, None, True),
        (op, "patch", "nodes", None, None, True),
        (op, "list", "customresourcedefinitions.apiextensions.k8s.io", None, None, True),
        # ... and nothing else
        (op, "get", "secrets", ns, None, False),
        (op, "list", "secrets", "kube-system", None, False),
        (op, "update", "pods", ns, None, False),
        (op, "create", "pods/exec", ns, None, False),
        (op, "create", "pods", other, None, False),        # a namespace it does not serve
        (op, "list", "pods", "default", None, False),
        (op, "delete", "nodes", None, None, False),
        (op, "create", "deployments.apps", ns, None, False),
        (op, "patch", "roles.rbac.authorization.k8s.io", ns, None, False),
        (op, "create", "clusterrolebindings.rbac.authorization.k8s.io", None, None, False),
        (op, "impersonate", "serviceaccounts", ns, None, False),
        # the trainer: its own job's Lease, get and patch
        (trainer, "get", lease, ns, f"{job}-progress", True),
        (trainer, "patch", lease, ns, f"{job}-progress", True),
        (trainer, "patch", lease, ns, f"{live.failed_job}-progress", False),
        (trainer, "delete", lease, ns, f"{job}-progress", False),
        (trainer, "list", lease, ns, None, False),
        (trainer, "create", lease, ns, None, False),
        (trainer, "patch", lease, "default", f"{job}-progress", False),
        (trainer, "get", "secrets", ns, "s3-creds", False),
        (trainer, "list", "secrets", ns, None, False),
        (trainer, "get", "pods", ns, f"{job}-0-0", False),
        (trainer, "get", "nodes", None, None, False),
        (trainer, "list", "nodes", None, None, False),
        (trainer, "get", "pretrainjobs.crucible.dev", ns, job, False),
    ]
    wrong = [f"{'allowed' if want else 'denied'} expected: {user.rsplit(':', 1)[1]} {verb} "
             f"{res}{'/' + name if name else ''} in {where or 'the cluster'}"
             for user, verb, res, where, name, want in matrix
             if _can_i(kube, user, verb, res, where, name) != want]
    assert wrong == []
