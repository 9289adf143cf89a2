"""The Helm chart: lint, render with default and other values, server-side dry run, install.

The chart keeps no copy of the generated manifests: its CRD, RBAC rules, dashboard and alert
rules are files/ and crds/ links to manifests/, and the tests here prove the rendered objects are
what the generators (`crucible-operator crd|rbac`) produce.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from crucible.operator import crd
from crucible.operator import manifests as m
from crucible.operator import rbac
from crucible.operator.cluster_policy import parse_label_selector, parse_peers
from tests.ship.monitoring_crds import ensure_monitoring_crds
from tests.support.apply import strict_dry_run
from tests.support.chart import CHART, by_kind, helm, render
from tests.support.repo import REPO
from tests.support.services import Kube, eventually

HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/instance", "app.kubernetes.io/version",
               "app.kubernetes.io/managed-by"}
ALERTS = REPO / "manifests" / "prometheus" / "crucible-alerts.yaml"
DASHBOARD = REPO / "manifests" / "grafana" / "crucible-dashboard.json"

# Every optional part on, and every value changed that changes a template's output.
NON_DEFAULT = {
    "image": {"repository": "registry.example/team/crucible-operator", "tag": "0.1.0-rc1",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {"watchNamespaces": ["team-a", "team-b"], "resyncIntervalSeconds": 5,
                 "workers": 8, "verbose": True, "metricsPort": 9090, "healthPort": 9091,
                 "nodeSelector": {"kubernetes.io/os": "linux"},
                 "tolerations": [{"key": "ops", "operator": "Exists", "effect": "NoSchedule"}],
                 "priorityClassName": "system-cluster-critical", "podLabels": {"team": "ml"},
                 "metricsScrapers": [{"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": "monitoring"}}}],
                 "stragglerCordonNodeLabels": {"pool": "gpu",
                                               "crucible.dev/straggler-cordon": "allowed"},
                 "allowInstanceMetadata": True},
    "serviceAccount": {"name": "ptj-operator", "annotations": {"example.com/role": "x"}},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "15s",
                                   "labels": {"release": "kube-prometheus-stack"}},
                "trainerPodMonitor": {"enabled": True, "interval": "10s"}},
    "dashboard": {"namespace": "monitoring", "labels": {"grafana_dashboard": "1", "team": "ml"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                       "runbookBaseUrl": "https://example.org/crucible/blob/v0.1.0/"},
}


def _strip_helm(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    labels = doc["metadata"].get("labels", {})
    for key in HELM_LABELS:
        labels.pop(key, None)
    labels["app.kubernetes.io/name"] = "crucible-operator"
    return doc


def _rules(docs: list[dict]) -> list[dict]:
    return [rule for role in by_kind(docs, "ClusterRole") for rule in role["rules"]]


def _operator(docs: list[dict]) -> dict:
    return by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]


def test_helm_lint_passes_strict():
    out = helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def _hooks(docs: list[dict]) -> list[dict]:
    return [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]


def test_default_render_is_the_generated_rbac_and_crd():
    docs = render(include_crds=True)
    docs = [d for d in docs if d not in _hooks(docs)]    # the uninstall hook: tested apart
    generated = {(d["kind"], d["metadata"]["name"]): d for d in rbac.documents()}
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        [doc] = by_kind(docs, kind)
        assert _strip_helm(doc) == generated[kind, rbac.NAME], kind
    [definition] = by_kind(docs, "CustomResourceDefinition")
    assert definition == yaml.safe_load(crd.render())
    # Nothing optional is on by default; the dashboard ConfigMap is (it costs nothing), so is
    # the queue-label policy (Kueue on: an admitted job's queue is kept while it runs) and the
    # operator's NetworkPolicy.
    assert sorted(d["kind"] for d in docs) == sorted([
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
        "ConfigMap", "CustomResourceDefinition", "NetworkPolicy"] + (len(rbac.FENCES) + 1) * [
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"])
    queue_label = [d for d in docs if d["metadata"]["name"].endswith("-queue-label")]
    assert len(queue_label) == 2
    assert not [d for d in render({"kueue": {"enabled": False}})
                if d["metadata"]["name"].endswith("-queue-label")]
    docs = [d for d in docs if d not in queue_label]
    # The fence is the generated one, matching this release's ServiceAccount.
    fences = by_kind(docs, "ValidatingAdmissionPolicy")
    assert len(fences) == len(rbac.FENCES)
    for fence, kind in zip(fences, (f.kind for f in rbac.FENCES)):
        generated_fence = generated["ValidatingAdmissionPolicy", f"{rbac.FENCE}-{kind}"]
        assert fence["spec"]["validations"] == generated_fence["spec"]["validations"]
        assert fence["spec"]["variables"] == generated_fence["spec"]["variables"]
        [condition] = fence["spec"]["matchConditions"]
        assert condition["expression"].endswith(":crucible-operator'")
    assert sorted(b["spec"]["policyName"] for b in by_kind(
        docs, "ValidatingAdmissionPolicyBinding")) == sorted(f["metadata"]["name"] for f in fences)


def test_uninstall_stops_the_operator_then_releases_the_finalizers_with_rights_for_that_alone():
    hooks = _hooks(render())
    assert {d["metadata"]["annotations"]["helm.sh/hook"] for d in hooks} == {"pre-delete"}
    [job] = by_kind(hooks, "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["release-finalizers",
                                 "--stop-deployment=crucible-system/crucible-operator"]
    assert container["image"] == "crucible-operator:0.1.0"
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    weights = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooks}
    assert max(v for k, v in weights.items() if k != "Job") < weights["Job"]   # rights first
    [role] = by_kind(hooks, "Role")
    assert all(rule["resourceNames"] == ["crucible-operator"] for rule in role["rules"]
               if rule["apiGroups"] == ["apps"])
    assert {(r, v) for rule in role["rules"] for r in rule["resources"]
            for v in rule["verbs"]} == {("deployments", "get"), ("deployments/scale", "patch"),
                                        ("pods", "list")}
    [cluster_role] = by_kind(hooks, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": ["crucible.dev"], "resources": ["pretrainjobs"],
                                      "verbs": ["get", "list", "patch"]}]
    scoped = by_kind(_hooks(render({"operator": {"watchNamespaces": ["team-a"]}})), "Job")[0]
    assert "--namespace=team-a" in scoped["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _hooks(render({"uninstallHook": {"enabled": False}})) == []
    assert "--quarantine-minutes=60" in _operator(render())["args"]
    assert "--quarantine-minutes=0" in _operator(render({"operator": {"quarantineMinutes": 0}}))[
        "args"]


def test_kueue_off_takes_its_rights_and_its_watches():
    kueue = {"workloads", "workloads/status", "localqueues", "resourceflavors",
             "workloadpriorityclasses"}
    granted = {r for rule in _rules(render()) if "kueue.x-k8s.io" in rule["apiGroups"]
               for r in rule["resources"]}
    assert granted == kueue
    assert "--no-kueue" not in _operator(render())["args"]
    without = render({"kueue": {"enabled": False}})
    assert not [rule for rule in _rules(without) if "kueue.x-k8s.io" in rule["apiGroups"]]
    assert len(_rules(without)) == len(_rules(render())) - 5   # the rest untouched
    assert "--no-kueue" in _operator(without)["args"]
    assert "--manage-jobs-without-queue-name" not in _operator(render())["args"]
    everyone = _operator(render({"kueue": {"manageJobsWithoutQueueName": True}}))
    assert "--manage-jobs-without-queue-name" in everyone["args"]


def test_operator_deployment_defaults():
    docs = render()
    [deploy] = by_kind(docs, "Deployment")
    spec, pod = deploy["spec"], deploy["spec"]["template"]["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    assert "--leader-election-namespace=crucible-system" in _operator(docs)["args"]
    single = by_kind(render({"operator": {"replicas": 1}}), "Deployment")[0]["spec"]
    assert single["replicas"] == 1 and single["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith("--leader-election") for a in
                   single["template"]["spec"]["containers"][0]["args"])
    container = _operator(docs)
    assert container["image"] == "crucible-operator:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == m.RUN_UID == 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert container["args"][:2] == ["run", "--all-namespaces"]
    assert "--liveness=http://0.0.0.0:8081/healthz" in container["args"]
    assert "--metrics-port=8080" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert container["resources"]["limits"]["memory"] == "512Mi"
    [service] = by_kind(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()


def test_the_operator_gets_a_network_policy_in_metrics_and_health_out_dns_and_the_apiserver():
    docs = render()
    [deploy] = by_kind(docs, "Deployment")
    [policy] = by_kind(docs, "NetworkPolicy")
    spec = policy["spec"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    metrics, health = spec["ingress"]
    assert metrics == {"ports": [{"protocol": "TCP", "port": 8080}],
                       "from": [{"namespaceSelector": {}}]}
    assert health == {"ports": [{"protocol": "TCP", "port": 8081}]}    # the kubelet's probes
    dns, api = spec["egress"]
    assert "to" not in dns and {p["port"] for p in dns["ports"]} == {53}
    assert api == {"ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}

    custom = render(NON_DEFAULT)
    [policy] = by_kind(custom, "NetworkPolicy")
    metrics, health = policy["spec"]["ingress"]
    assert metrics["from"] == NON_DEFAULT["operator"]["metricsScrapers"]
    assert metrics["ports"][0]["port"] == 9090 and health["ports"][0]["port"] == 9091
    ported = render({"operator": {"networkPolicy": {"enabled": True, "apiServerPorts": [8443]}}})
    assert by_kind(ported, "NetworkPolicy")[0]["spec"]["egress"][1]["ports"] == [
        {"protocol": "TCP", "port": 8443}]
    assert not by_kind(render({"operator": {"networkPolicy": {"enabled": False,
                                                                "apiServerPorts": [443]}}}),
                       "NetworkPolicy")


def test_non_default_values_render_every_optional_part():
    docs = render(NON_DEFAULT, release="ml", namespace="ops")
    docs = [d for d in docs if d not in _hooks(docs)]    # the uninstall hook: tested apart
    container = _operator(docs)
    assert container["image"] == "registry.example/team/crucible-operator:0.1.0-rc1"
    assert container["args"][:3] == ["run", "--namespace=team-a", "--namespace=team-b"]
    assert {"--interval=5", "--workers=8", "--metrics-port=9090", "--verbose",
            "--liveness=http://0.0.0.0:9091/healthz"} <= set(container["args"])
    [scrapers] = [a for a in container["args"] if a.startswith("--metrics-scrapers=")]
    assert parse_peers(scrapers.split("=", 1)[1]) == tuple(NON_DEFAULT["operator"]["metricsScrapers"])
    assert not any(a.startswith("--metrics-scrapers") for a in _operator(render())["args"])
    [selector] = [a for a in container["args"] if a.startswith("--straggler-cordon-selector=")]
    assert parse_label_selector(selector.split("=", 1)[1]) == tuple(sorted(
        NON_DEFAULT["operator"]["stragglerCordonNodeLabels"].items()))
    assert not any(a.startswith("--straggler-cordon") for a in _operator(render())["args"])
    assert "--allow-instance-metadata" in container["args"]
    assert "--allow-instance-metadata" not in _operator(render())["args"]

    # RBAC: the generated rules, split by scope; namespaced ones only in the watched namespaces.
    roles = {r["metadata"]["name"]: r for r in by_kind(docs, "ClusterRole")}
    assert set(roles) == {"ml-crucible-operator", "ml-crucible-operator-namespaced"}
    generated = [{"apiGroups": g, "resources": r, "verbs": v} for g, r, v, _ in rbac.RULES]
    assert sorted(map(json.dumps, _rules(docs))) == sorted(map(json.dumps, generated))
    assert {res for rule in roles["ml-crucible-operator"]["rules"] for res in rule["resources"]} \
        == set(rbac.CLUSTER_SCOPED)
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ops", "team-a", "team-b"]
    for binding in bindings + by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ptj-operator",
                                        "namespace": "ops"}]
    # Beyond the generated ClusterRoles, only the leader Lease, in the release's own namespace.
    [leader_role] = by_kind(docs, "Role")
    assert leader_role["metadata"]["namespace"] == "ops"
    assert leader_role["rules"] == [{"apiGroups": ["coordination.k8s.io"],
                                     "resources": ["leases"], "verbs": ["get", "create", "patch"]}]

    # Monitoring objects keep Crucible's own labels (honorLabels) and select the right things.
    [monitor] = by_kind(docs, "ServiceMonitor")
    [service] = by_kind(docs, "Service")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    [pods] = by_kind(docs, "PodMonitor")
    assert pods["spec"]["selector"]["matchLabels"] == {m.LABEL_MANAGED_BY: m.MANAGER,
                                                       m.LABEL_INDEX: "0"}
    # The trainer's own labels are not honoured (it is the tenant's code); job from the pod.
    [endpoint] = pods["spec"]["podMetricsEndpoints"]
    assert {k: endpoint[k] for k in ("port", "path", "interval", "honorLabels")} == {
        "port": "metrics", "path": "/metrics", "interval": "10s", "honorLabels": False}
    # The operator's series come from the operator alone; a scrape's size is bounded.
    assert endpoint["metricRelabelings"] == [{"sourceLabels": ["__name__"],
                                              "regex": "crucible_operator_.*", "action": "drop"}]
    assert pods["spec"]["jobLabel"] == m.LABEL_JOB and pods["spec"]["sampleLimit"] == 5000
    assert pods["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    trainer_pod = m.pod("gpt", "team-a", "uid", _spec(), 0, 0)
    assert {"name": "metrics", "containerPort": m.METRICS_PORT} in \
        trainer_pod["spec"]["containers"][0]["ports"]
    assert pods["spec"]["selector"]["matchLabels"].items() <= trainer_pod["metadata"]["labels"].items()

    # The alert rules are the rule file's, with the runbook base URL in front.
    [rule] = by_kind(docs, "PrometheusRule")
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for group in groups:
        for alert in group["rules"]:
            alert["annotations"]["runbook_url"] = ("https://example.org/crucible/blob/v0.1.0/"
                                                   + alert["annotations"]["runbook_url"])
    assert rule["spec"]["groups"] == groups

    # The dashboard ConfigMap holds the dashboard file as is, labelled for Grafana's sidecar.
    [dashboard] = by_kind(docs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["crucible-pretraining.json"]) == json.loads(DASHBOARD.read_text())


def _spec():
    from crucible.api.spec import PretrainJobSpec

    return PretrainJobSpec.model_validate({"image": "x", "nodes": {"min": 1, "max": 1},
                                           "model": {"preset": "tiny"},
                                           "data": {"train": "s3://bucket/t"},
                                           "training": {"tokens": 1e6}})


@pytest.mark.parametrize("values, message", [
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"operator": {"workers": 0}}, "/operator/workers"),
    ({"operator": {"watchNamespaces": ["team-*"]}}, "/operator/watchNamespaces/0"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"metrics": {"serviceMonitor": {"enabled": True, "interval": "often"}}},
     "/metrics/serviceMonitor/interval"),
])
def test_schema_rejects_bad_values_naming_the_key(values, message, tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = helm("template", "x", str(CHART), "--values", str(path), check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


@pytest.mark.stack
def test_rendered_manifests_pass_a_server_side_dry_run(kube, namespace):
    ensure_monitoring_crds(kube)
    other = kube.create_namespace("ship-dry-run-b")
    try:
        values = json.loads(json.dumps(NON_DEFAULT))
        values["operator"]["watchNamespaces"] = [namespace, other]
        values["dashboard"]["namespace"] = other
        default = render(release="dry", namespace=namespace, include_crds=True)
        custom = render(values, release="dry", namespace=namespace)
        assert strict_dry_run(kube.client(), default, namespace) == []
        assert strict_dry_run(kube.client(), custom, namespace) == []
        # The dry run is not a rubber stamp: a misspelt field is refused.
        [deploy] = by_kind(default, "Deployment")
        deploy["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
        [refusal] = strict_dry_run(kube.client(), [deploy], namespace)
        assert "livenesProbe: field not declared in schema" in refusal
    finally:
        kube.delete_namespace(other)


def _allowed(kube: Kube, user: str, verb: str, resource: str, namespace: str | None = None) -> bool:
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=user, groups=["system:serviceaccounts", "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(verb=verb, resource=resource,
                                                        namespace=namespace)))
    return client.AuthorizationV1Api(kube.client()).create_subject_access_review(
        review).status.allowed


@pytest.mark.stack
def test_helm_install_puts_the_operator_and_its_rbac_in_place(kube, release):
    api = kube.client()
    apps, rbac_api = client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    name = f"{release.name}-crucible-operator"
    deploy = apps.read_namespaced_deployment(name, release.namespace)
    assert deploy.spec.replicas == 2 and deploy.spec.strategy.type == "RollingUpdate"
    # helm --wait counts a Deployment ready at replicas - maxUnavailable (1 of 2 here), so the
    # second replica may still be starting when it returns (on kind it is a real container).
    assert eventually(lambda: apps.read_namespaced_deployment(name, release.namespace)
                      .status.available_replicas == 2, 120, "both operator replicas Available")
    assert f"--leader-election-namespace={release.namespace}" in \
        deploy.spec.template.spec.containers[0].args
    leader_role = rbac_api.read_namespaced_role(f"{name}-leader", release.namespace)
    assert leader_role.rules[0].resources == ["leases"]  # watchNamespaces leaves it out
    assert deploy.spec.template.spec.service_account_name == release.operator_account
    assert deploy.spec.template.spec.containers[0].args[:2] == ["run",
                                                               f"--namespace={release.jobs_namespace}"]
    cluster_role = rbac_api.read_cluster_role(name)
    namespaced = rbac_api.read_cluster_role(f"{name}-namespaced")
    installed = [{"apiGroups": r.api_groups, "resources": r.resources, "verbs": r.verbs}
                 for r in cluster_role.rules + namespaced.rules]
    generated = [{"apiGroups": g, "resources": r, "verbs": v} for g, r, v, _ in rbac.RULES]
    assert sorted(map(json.dumps, installed)) == sorted(map(json.dumps, generated))
    binding = rbac_api.read_namespaced_role_binding(name, release.jobs_namespace)
    assert binding.role_ref.name == f"{name}-namespaced"
    assert [(s.name, s.namespace) for s in binding.subjects] == [(release.operator_account,
                                                                  release.namespace)]
    crb = rbac_api.read_cluster_role_binding(name)
    assert crb.role_ref.name == name
    # Namespaced mode, as the apiserver's authorizer sees it: pods only where jobs are served,
    # the cordon (cluster-scoped) anywhere.
    user = f"system:serviceaccount:{release.namespace}:{release.operator_account}"
    assert _allowed(kube, user, "create", "pods", release.jobs_namespace)
    assert not _allowed(kube, user, "create", "pods", "default")
    assert not _allowed(kube, user, "list", "pods", "kube-system")
    assert _allowed(kube, user, "patch", "nodes")
    # The CRD came from crds/ (or was there already) and is Established.
    ext = client.ApiextensionsV1Api(api)
    assert eventually(lambda: any(c.type == "Established" and c.status == "True" for c in
                                  ext.read_custom_resource_definition(crd.NAME).status.conditions),
                      30, "the PretrainJob CRD Established")
    core = client.CoreV1Api(api)
    assert core.read_namespaced_service(f"{name}-metrics", release.namespace)
    dashboard = core.read_namespaced_config_map(f"{release.name}-crucible-dashboard",
                                                release.namespace)
    assert dashboard.metadata.labels["grafana_dashboard"] == "1"
    status = helm("status", release.name, "--namespace", release.namespace,
                  kubeconfig=kube.kubeconfig).stdout
    assert "STATUS: deployed" in status
    assert re.search(rf"rollout status deployment/{name}", status), "NOTES say what to do next"
