"""The administrator's limits on what a job's scheduling and sizes ask for (pure, then in a pass).

A priority class, a toleration, a nodeSelector key and scratch or /dev/shm sizes act on nodes
every tenant shares: past the operator's limits the job fails (NotAllowed) and no pod is made.
"""

from __future__ import annotations

import pytest

from crucible.operator import manifests as m
from crucible.operator.cluster_policy import ClusterPolicy
from crucible.operator.decision import decide
from crucible.operator import tenant_limits
from crucible.operator.tenant_limits import TenantLimits
from tests.operator import builders as b
from tests.operator.test_decision import running_status

LIMITS = TenantLimits.from_settings("research-low, research-high", "nvidia.com/gpu",
                                    "node.kubernetes.io/instance-type", "200Gi", "32Gi")


def _scheduling(**fields) -> dict:
    return {"scheduling": fields}


@pytest.mark.parametrize("overrides, says", [
    (_scheduling(priorityClassName="system-node-critical"), "'system-node-critical' is not allowed"),
    (_scheduling(tolerations=[{"key": "node-role.kubernetes.io/control-plane",
                               "operator": "Exists"}]), "'node-role.kubernetes.io/control-plane'"),
    (_scheduling(tolerations=[{"operator": "Exists"}]), "every taint (no key)"),
    (_scheduling(nodeSelector={"kubernetes.io/hostname": "gpu-node-7"}),
     "'kubernetes.io/hostname' may not be selected on"),
    ({"scratchSizeLimit": "1Ti"}, "scratchSizeLimit 1Ti is more than the 200Gi allowed"),
    ({"shmSizeLimit": "33Gi"}, "shmSizeLimit 33Gi is more than the 32Gi allowed"),
])
def test_each_thing_past_the_limits_is_named_with_what_is_allowed(overrides, says):
    problems = LIMITS.violations(b.spec(**overrides))
    assert len(problems) == 1 and says in problems[0], problems


def test_what_the_limits_allow_passes_and_no_limits_allow_anything():
    within = b.spec(scheduling={"priorityClassName": "research-low",
                                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                 "effect": "NoSchedule"}],
                                "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"}},
                    scratchSizeLimit="200Gi", shmSizeLimit="32768Mi")
    assert LIMITS.violations(within) == []
    assert LIMITS.violations(b.spec()) == []   # the defaults (100Gi, 16Gi) are within
    anything = b.spec(scheduling={"priorityClassName": "system-node-critical",
                                  "tolerations": [{"operator": "Exists"}],
                                  "nodeSelector": {"kubernetes.io/hostname": "n"}},
                      scratchSizeLimit="10Ti", shmSizeLimit="1Ti")
    assert TenantLimits().violations(anything) == []
    assert TenantLimits.from_settings("*", "", " ", "", "").violations(anything) == []


def test_a_setting_that_is_not_a_quantity_is_refused_at_start_up():
    with pytest.raises(ValueError, match="--max-shm-size: 'lots' is not a Kubernetes quantity"):
        TenantLimits.from_settings(max_shm="lots")


def test_a_job_past_the_limits_fails_before_any_pod_and_one_edited_past_them_stops():
    policy = ClusterPolicy(limits=LIMITS)
    aimed = b.job(scheduling={"nodeSelector": {"kubernetes.io/hostname": "control-plane-0"}})
    outcome = decide(aimed, b.observed(children=frozenset()), b.at(0), policy)
    assert outcome.status["phase"] == "Failed"
    assert "NotAllowed" in outcome.status["message"]
    assert "kubernetes.io/hostname" in outcome.status["message"]
    assert not [a for a in outcome.actions if a.verb == "create"]
    # The same job without limits is made as usual.
    free = decide(aimed, b.observed(children=frozenset()), b.at(0))
    assert free.status["phase"] != "Failed" and [a for a in free.actions if a.verb == "create"]
    # Allowed and running, then edited to a priority class the administrator does not allow:
    # its next pods would carry it, so it stops (pods deleted; its checkpoints stay).
    pods = b.observed(b.running(0, 4, m.spec_hash(b.spec())))
    allowed = _allowed_status()
    edited = b.job(status=allowed, generation=2,
                   scheduling={"priorityClassName": "system-cluster-critical"})
    stopped = decide(edited, pods, b.at(5), policy)
    assert stopped.status["phase"] == "Failed"
    assert {a.verb for a in stopped.actions if a.kind == "Pod"} == {"delete"}


def _allowed_status() -> dict:
    """A running job the limits allowed as b.spec() (what a pass records)."""
    status = running_status()
    status["tracking"]["allowed"] = tenant_limits.asked(b.spec(), {})
    return status


def test_tightening_the_limits_stops_no_job_they_allowed():
    pods = b.observed(b.running(0, 4, m.spec_hash(b.spec())))
    strict = ClusterPolicy(limits=TenantLimits.from_settings(max_shm="8Gi"))  # default: 16Gi
    # Allowed before: not judged again while its spec is the same.
    kept = decide(b.job(status=_allowed_status()), pods, b.at(5), strict)
    assert kept.status["phase"] == "Running"
    # Running when this operator first saw it (an upgrade, a restart with new flags): allowed.
    first_seen = decide(b.job(status=running_status()), pods, b.at(5), strict)
    assert first_seen.status["phase"] == "Running"
    assert first_seen.status["tracking"]["allowed"] == tenant_limits.asked(b.spec(), {})
    # A new job past them fails.
    assert decide(b.job(), b.observed(children=frozenset()), b.at(0),
                  strict).status["phase"] == "Failed"


def test_kueues_priority_label_is_bounded_by_the_same_list():
    labels = {"kueue.x-k8s.io/queue-name": "team-a",
              "kueue.x-k8s.io/priority-class": "prod-critical"}
    [problem] = LIMITS.violations(b.spec(), labels)
    assert "label kueue.x-k8s.io/priority-class 'prod-critical' is not allowed" in problem
    outcome = decide(b.job(labels=labels), b.observed(children=frozenset()), b.at(0),
                     ClusterPolicy(limits=LIMITS))
    assert outcome.status["phase"] == "Failed"
    assert not [a for a in outcome.actions if a.verb == "create"]   # no Workload either
    assert LIMITS.violations(b.spec(), {**labels, "kueue.x-k8s.io/priority-class":
                                        "research-high"}) == []
    # An empty label names no class, for Kueue and for the limits.
    assert LIMITS.violations(b.spec(), {"kueue.x-k8s.io/priority-class": ""}) == []


def test_only_what_the_limits_read_makes_a_job_judged_again():
    base = tenant_limits.asked(b.spec(), {})
    assert tenant_limits.asked(b.spec(suspend=True), {}) == base
    assert tenant_limits.asked(b.spec(training={"tokens": 2e9}), {"team": "a"}) == base
    for changed in (b.spec(shmSizeLimit="17Gi"), b.spec(scratchSizeLimit="101Gi"),
                    b.spec(scheduling={"nodeSelector": {"pool": "a"}})):
        assert tenant_limits.asked(changed, {}) != base
    assert tenant_limits.asked(b.spec(), {"kueue.x-k8s.io/priority-class": "x"}) != base


@pytest.mark.parametrize("size", ["0", "-0", "0Gi", "0.0", "-1Ti"])
def test_a_size_limit_of_zero_which_the_kubelet_reads_as_none_is_refused(size):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="should match pattern"):
        b.spec(shmSizeLimit=size)
    with pytest.raises(ValueError, match="allows nothing"):
        TenantLimits.from_settings(max_scratch="0")


def test_the_charts_values_become_the_operators_flags():
    from crucible.operator.main import build_parser
    from tests.support.chart import by_kind, render

    values = {"operator": {"tenantLimits": {
        "priorityClasses": ["research-low", "research-high"], "tolerationKeys": ["nvidia.com/gpu"],
        "nodeSelectorKeys": ["node.kubernetes.io/instance-type"],
        "maxScratchSize": "200Gi", "maxShmSize": "32Gi"}}}
    [deploy] = by_kind(render(values), "Deployment")
    args = build_parser().parse_args(deploy["spec"]["template"]["spec"]["containers"][0]["args"])
    assert TenantLimits.from_settings(args.allowed_priority_classes, args.allowed_toleration_keys,
                                      args.allowed_node_selector_keys, args.max_scratch_size,
                                      args.max_shm_size) == LIMITS
    [default] = by_kind(render(), "Deployment")
    assert not [a for a in default["spec"]["template"]["spec"]["containers"][0]["args"]
                if a.startswith(("--allowed-", "--max-scratch", "--max-shm"))]


# --- at admission: the chart's policy, by the real apiserver ---------------------------------------
@pytest.mark.stack
def test_the_charts_policy_refuses_at_apply_what_the_limits_refuse(kube, namespace, crd):
    """operator.tenantLimits rendered by the chart, applied to the stack's apiserver: each job
    past a limit is refused by a server-side dry run saying what, and one within passes."""
    import json

    from kubernetes import client, dynamic
    from kubernetes.client.rest import ApiException

    from tests.support.chart import by_kind, render
    from tests.support.services import eventually

    values = {"operator": {"tenantLimits": {
        "priorityClasses": ["research-low"], "tolerationKeys": ["nvidia.com/gpu"],
        "nodeSelectorKeys": ["node.kubernetes.io/instance-type"],
        "maxScratchSize": "200Gi", "maxShmSize": "32Gi"}}}
    docs = render(values, release=f"tl-{namespace}"[:40])
    [policy], [binding] = ([d for d in by_kind(docs, kind) if "tenant-limits" in d["metadata"]["name"]]
                           for kind in ("ValidatingAdmissionPolicy",
                                        "ValidatingAdmissionPolicyBinding"))
    assert not [d for d in by_kind(render(), "ValidatingAdmissionPolicy")
                if "tenant-limits" in d["metadata"]["name"]]   # no limits, no policy (default)
    # Only this namespace, so other tests' jobs are untouched.
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": namespace}}}
    admission = client.AdmissionregistrationV1Api(kube.client())
    jobs = dynamic.DynamicClient(kube.client()).resources.get(api_version="crucible.dev/v1alpha1",
                                                               kind="PretrainJob")
    # A job from before the limits, past them (its operator finalizer on): it must stay
    # manageable and deletable once they are set.
    jobs.create(namespace=namespace, body={
        "apiVersion": "crucible.dev/v1alpha1", "kind": "PretrainJob",
        "metadata": {"name": "older", "namespace": namespace,
                     "finalizers": ["crucible.dev/cleanup"]},
        "spec": b.spec_doc(shmSizeLimit="64Gi")})
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)

    def refused(call) -> str | None:
        try:
            call()
        except ApiException as err:
            return json.loads(err.body)["message"] if err.status in (403, 422) else None
        return None

    def refusal(labels: dict | None = None, **overrides) -> str | None:
        body = {"apiVersion": "crucible.dev/v1alpha1", "kind": "PretrainJob",
                "metadata": {"name": "tl", "namespace": namespace, "labels": labels or {}},
                "spec": b.spec_doc(**overrides)}
        return refused(lambda: jobs.create(body=body, namespace=namespace,
                                           query_params=[("dryRun", "All")]))

    def patch_older(patch: dict) -> str | None:
        return refused(lambda: jobs.patch(name="older", namespace=namespace, body=patch,
                                          content_type="application/merge-patch+json",
                                          query_params=[("dryRun", "All")]))

    try:
        # The policy takes effect once the apiserver has loaded it.
        eventually(lambda: refusal(shmSizeLimit="64Gi"), 30, "the tenant-limits policy")
        cases = {"system-node-critical is not allowed here; allowed: research-low":
                 _scheduling(priorityClassName="system-node-critical"),
                 "may tolerate only these taint keys here: nvidia.com/gpu":
                 _scheduling(tolerations=[{"operator": "Exists"}]),
                 "may use only these node label keys here":
                 _scheduling(nodeSelector={"kubernetes.io/hostname": "control-plane-0"}),
                 "scratchSizeLimit is more than the 200Gi allowed here": {"scratchSizeLimit": "1Ti"},
                 "shmSizeLimit is more than the 32Gi allowed here": {"shmSizeLimit": "33Gi"}}
        for says, overrides in cases.items():
            message = refusal(**overrides)
            assert message and says in message, (overrides, message)
            # The operator's own check agrees (the same limits as flags).
            assert LIMITS.violations(b.spec(**overrides)), overrides
        within = dict(_scheduling(priorityClassName="research-low",
                                  tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                  nodeSelector={"node.kubernetes.io/instance-type": "p5"}),
                      scratchSizeLimit="200Gi", shmSizeLimit="32Gi")
        assert refusal(**within) is None
        assert refusal() is None   # no scheduling at all, default sizes
        says = refusal(labels={"kueue.x-k8s.io/priority-class": "prod-critical"})
        assert says and "label kueue.x-k8s.io/priority-class prod-critical is not allowed" in says
        # The older job: annotations and its finalizer still change; its spec only within.
        assert patch_older({"metadata": {"annotations": {"note": "x"}}}) is None
        assert patch_older({"metadata": {"finalizers": None}}) is None
        assert patch_older({"spec": {"suspend": True}}) is None
        assert patch_older({"metadata": {"labels": {"team": "a"}}}) is None
        assert "shmSizeLimit" in (patch_older({"spec": {"shmSizeLimit": "63Gi"}}) or "")
    finally:
        jobs.patch(name="older", namespace=namespace, body={"metadata": {"finalizers": None}},
                   content_type="application/merge-patch+json")
        admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        admission.delete_validating_admission_policy(policy["metadata"]["name"])
