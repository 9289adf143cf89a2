"""Pure manifests: names, the launch contract (read back by torchrun's own parser), security."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest

from crucible.api.spec import TrainJobConfig, load_train_config
from crucible.operator import manifests as m
from crucible.operator.cluster_policy import ClusterPolicy, parse_peers
from tests.operator import builders as b


def _pod(gen=3, index=0, avoid=(), **spec_overrides):
    return m.pod(b.JOB, b.NS, b.UID, b.spec(**spec_overrides), gen, index, avoid_nodes=list(avoid))


def _env(pod) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def expand(text: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion of command/args (k8s.io/kubernetes third_party expansion)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda mt: env.get(mt.group(1), mt.group(0)),
                  text)


def test_names_are_deterministic_and_fit_dns_labels():
    pod = _pod()
    assert pod["metadata"]["name"] == "gpt-3-0" == pod["spec"]["hostname"]
    assert pod["spec"]["subdomain"] == m.service_name(b.JOB) == "gpt"
    longest = m.pod_name("a" * 40, 999999, 4095)
    assert len(longest) <= 63
    assert pod["metadata"]["labels"] == {
        m.LABEL_MANAGED_BY: m.MANAGER, m.LABEL_JOB: "gpt", m.LABEL_GENERATION: "3",
        m.LABEL_INDEX: "0"}
    assert m.pod(b.JOB, b.NS, b.UID, b.spec(), 3, 0) == _pod()  # same inputs, same manifest


def test_every_child_is_owned_by_the_job():
    children = m.static_children(b.JOB, b.NS, b.UID, b.spec()) + [_pod()]
    for child in children:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "crucible.dev/v1alpha1", "kind": "PretrainJob",
                         "name": "gpt", "uid": b.UID, "controller": True,
                         "blockOwnerDeletion": True}
        assert child["metadata"]["namespace"] == b.NS


def test_torchrun_reads_every_flag_from_the_rendered_env(monkeypatch):
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    pod = _pod(gen=3, index=1)
    env = {k: v for k, v in _env(pod).items() if isinstance(v, str)}
    for key in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    args = get_args_parser().parse_args([expand(a, env) for a in container["args"]])
    assert parse_min_max_nnodes(args.nnodes) == (2, 4)
    assert args.nproc_per_node == "8"
    assert args.rdzv_backend == "c10d"
    assert args.rdzv_endpoint == "gpt-3-0.gpt:29400"      # pod 0, through the headless Service
    assert args.rdzv_id == "gpt-3"
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    conf = _parse_rendezvous_config(args.rdzv_conf)
    assert conf["is_host"] == "0"                         # only pod 0 serves the c10d store
    assert conf["join_timeout"] == "600"                  # faultTolerance.rendezvousTimeoutSeconds
    assert args.max_restarts == 3
    assert args.module and args.training_script == "crucible.trainer"
    assert args.training_script_args == ["train", "--config", "/etc/crucible/job.yaml"]
    assert _env(_pod(index=0))["PET_RDZV_CONF"].startswith("is_host=1,")


def test_pods_find_their_lease_and_credentials_through_env():
    env = _env(_pod())
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-creds", "key":
                                                         "AWS_ACCESS_KEY_ID", "optional": False}}
    assert env["AWS_ENDPOINT_URL"]["secretKeyRef"]["optional"] is True
    no_secret = _env(_pod(checkpoint={"uri": "s3://bucket/p", "credentialsSecret": None}))
    # No credentials but the default chain's, which must not end at the node's role.
    assert {k for k in no_secret if k.startswith("AWS_")} == {"AWS_EC2_METADATA_DISABLED"}
    assert no_secret["AWS_EC2_METADATA_DISABLED"] == "true"
    assert "CRUCIBLE_CHECKPOINT_SIGNING_KEY" not in env
    signed = _env(_pod(checkpoint={"signingKeySecret": "ckpt-hmac"}))
    assert signed["CRUCIBLE_CHECKPOINT_SIGNING_KEY"] == {"secretKeyRef": {
        "name": "ckpt-hmac", "key": "CRUCIBLE_CHECKPOINT_SIGNING_KEY", "optional": False}}


def test_scratch_and_shared_memory_are_bounded():
    volumes = {v["name"]: v for v in _pod()["spec"]["volumes"]}
    assert volumes["scratch"]["emptyDir"] == {"sizeLimit": "100Gi"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    sized = {v["name"]: v for v in _pod(scratchSizeLimit="20Gi", shmSizeLimit="2Gi")["spec"][
        "volumes"]}
    assert sized["scratch"]["emptyDir"]["sizeLimit"] == "20Gi"
    assert sized["dshm"]["emptyDir"]["sizeLimit"] == "2Gi"
    with pytest.raises(ValueError, match="shmSizeLimit"):
        b.spec(shmSizeLimit="lots")


def test_workload_identity_annotates_the_trainer_service_account_only():
    plain = m.service_account(b.JOB, b.NS, b.UID, b.spec())
    assert "annotations" not in plain["metadata"]
    irsa = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/crucible-gpt"}
    account = m.service_account(b.JOB, b.NS, b.UID, b.spec(serviceAccount={"annotations": irsa},
                                                           checkpoint={"credentialsSecret": None}))
    assert account["metadata"]["annotations"] == irsa
    assert account["metadata"]["name"] == _pod()["spec"]["serviceAccountName"]
    # Without a Secret the pods carry no AWS credentials: the SDK's default chain finds the
    # identity (web identity, not the instance metadata, which it is told to skip).
    env = _env(_pod(serviceAccount={"annotations": irsa}, checkpoint={"credentialsSecret": None}))
    assert {k for k in env if k.startswith("AWS_")} == {"AWS_EC2_METADATA_DISABLED"}
    allowed = m.pod(b.JOB, b.NS, b.UID, b.spec(checkpoint={"credentialsSecret": None}), 0, 0,
                    instance_metadata=True)
    assert not any(k.startswith("AWS_") for k in _env(allowed))


def test_object_names_the_job_refers_to_are_checked_at_apply():
    with pytest.raises(ValueError, match="credentialsSecret"):
        b.spec(checkpoint={"credentialsSecret": "S3_Creds"})
    with pytest.raises(ValueError, match="priorityClassName"):
        b.spec(scheduling={"priorityClassName": "High Priority"})


def test_job_config_is_mounted_and_the_trainer_accepts_it(tmp_path):
    cm = m.config_map(b.JOB, b.NS, b.UID, b.spec())
    path = tmp_path / m.CONFIG_FILE
    path.write_text(cm["data"][m.CONFIG_FILE])
    cfg = load_train_config(path)
    assert isinstance(cfg, TrainJobConfig) and cfg.name == "gpt"
    assert cfg.checkpoint.uri == "s3://bucket/runs/gpt" and cfg.output_dir == "runs/gpt"
    assert _pod()["spec"]["containers"][0]["workingDir"] == m.SCRATCH_DIR  # writable emptyDir
    mounts = {v["mountPath"]: v["name"] for v in _pod()["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[m.CONFIG_DIR] == "config"
    volumes = {v["name"]: v for v in _pod()["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "gpt-config"


def test_pods_run_as_non_root_with_a_read_only_root():
    pod = _pod()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == m.RUN_UID != 0
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["serviceAccountName"] == "gpt-trainer"


def test_scheduling_fields_and_anti_affinity_to_bad_nodes():
    pod = _pod(avoid=["gpu-node-7", "gpu-node-2"], scheduling={
        "nodeSelector": {"crucible.dev/pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "training"})
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"crucible.dev/pool": "gpu"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                    "effect": "NoSchedule"}]
    assert spec["priorityClassName"] == "training"
    expr = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expr == {"key": "kubernetes.io/hostname", "operator": "NotIn",
                    "values": ["gpu-node-2", "gpu-node-7"]}
    assert "affinity" not in _pod()["spec"]
    # Read back from the pod as the operator observes it, to recreate a waiting pod.
    assert m.avoided_nodes(spec) == ("gpu-node-2", "gpu-node-7")
    assert m.avoided_nodes(_pod()["spec"]) == ()
    assert _pod()["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "8"}}


def test_headless_service_publishes_not_ready_pods():
    svc = m.service(b.JOB, b.NS, b.UID)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {m.LABEL_JOB: "gpt", m.LABEL_MANAGED_BY: m.MANAGER}


def test_trainer_role_grants_only_its_own_lease():
    (rule,) = m.role(b.JOB, b.NS, b.UID)["rules"]
    assert rule == {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                    "resourceNames": ["gpt-progress"], "verbs": ["get", "patch"]}
    binding = m.role_binding(b.JOB, b.NS, b.UID)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpt-trainer",
                                    "namespace": b.NS}]


@pytest.mark.parametrize("change, restarts", [
    ({"image": "other:1"}, True), ({"nodes": {"min": 1, "max": 4}}, True),
    ({"training": {"tokens": 2e9}}, True), ({"faultTolerance": {"torchrunMaxRestarts": 9}}, True),
    ({"faultTolerance": {"maxRestarts": 99}}, False), ({"suspend": True}, False),
    ({"ttlSecondsAfterFinished": 60}, False),
    ({"faultTolerance": {"nodeFailureGraceSeconds": 5}}, False),
])
def test_spec_hash_covers_what_reaches_the_pods(change, restarts):
    assert (m.spec_hash(b.spec(**change)) != m.spec_hash(b.spec())) == restarts


def test_builders_do_not_mutate_the_spec():
    spec = b.spec(scheduling={"nodeSelector": {"a": "b"}})
    before = copy.deepcopy(spec.model_dump())
    pod = m.pod(b.JOB, b.NS, b.UID, spec, 0, 0)
    pod["spec"]["nodeSelector"]["x"] = "y"
    m.config_map(b.JOB, b.NS, b.UID, spec)
    assert spec.model_dump() == before


def test_an_operator_upgrade_that_adds_or_moves_defaults_restarts_nothing():
    """The drift hash and the mounted config hold only what the job set: a field spelled out at
    its default (as a newer operator's defaults would appear) changes neither, and a trainer
    image older than the operator meets no field it does not know in its config."""
    from crucible.api.spec import PretrainJobSpec

    doc = b.spec_doc()
    spelled = {**doc, "faultTolerance": {**doc.get("faultTolerance", {}),
                                         "rendezvousTimeoutSeconds": 600},
               "training": {**doc["training"], "gradientSync": "everyMicroBatch"}}
    plain, explicit = PretrainJobSpec.model_validate(doc), PretrainJobSpec.model_validate(spelled)
    assert m.spec_hash(explicit) == m.spec_hash(plain)
    text = m.config_text("gpt", explicit)
    assert "gradientSync" not in text and m.config_text("gpt", plain) == text
    edited = PretrainJobSpec.model_validate({**doc, "training": {**doc["training"], "lr": 1e-3}})
    assert m.spec_hash(edited) != m.spec_hash(plain)  # what the user changes still restarts


def test_a_moved_default_changes_no_running_jobs_hash(monkeypatch):
    """As a release that moves a default would: the same document, validated with another
    default, hashes the same (and the new value reaches the pods at their next start)."""
    from crucible.api import spec as api

    doc = b.spec_doc()
    before = m.spec_hash(api.PretrainJobSpec.model_validate(doc))
    field = api.FaultToleranceSpec.model_fields["rendezvous_timeout_seconds"]
    monkeypatch.setattr(field, "default", 900)
    try:
        for model in (api.FaultToleranceSpec, api.PretrainJobSpec):
            model.model_rebuild(force=True)
        moved = api.PretrainJobSpec.model_validate(doc)
        assert moved.fault_tolerance.rendezvous_timeout_seconds == 900
        assert m.spec_hash(moved) == before
    finally:
        monkeypatch.undo()
        for model in (api.FaultToleranceSpec, api.PretrainJobSpec):
            model.model_rebuild(force=True)
    assert api.PretrainJobSpec.model_validate(doc).fault_tolerance.rendezvous_timeout_seconds == 600


def test_the_network_policy_fences_the_job_pods_off_from_everyone_but_each_other():
    policy = m.network_policy("gpt", "team-a", "uid-1")
    pods = policy["spec"]["podSelector"]["matchLabels"]
    assert pods == {m.LABEL_JOB: "gpt", m.LABEL_MANAGED_BY: m.MANAGER}
    assert pods.items() <= m.pod("gpt", "team-a", "uid-1", b.spec(), 0, 0)["metadata"][
        "labels"].items()
    # Egress is open (S3, DNS, the apiserver, every pod) but for the instance-metadata address.
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    [egress] = policy["spec"]["egress"]
    assert {"namespaceSelector": {}} in egress["to"]
    [v4] = [peer["ipBlock"] for peer in egress["to"]
            if peer.get("ipBlock", {}).get("cidr") == "0.0.0.0/0"]
    assert "169.254.169.254/32" in v4["except"] and "100.100.100.200/32" in v4["except"]
    assert "ports" not in egress
    allowed = m.network_policy("gpt", "team-a", "uid-1", instance_metadata=True)
    assert allowed["spec"]["policyTypes"] == ["Ingress"] and "egress" not in allowed["spec"]
    peer, scrape = policy["spec"]["ingress"]
    assert peer == {"from": [{"podSelector": {"matchLabels": pods}}]}   # every port: NCCL, c10d
    assert scrape["ports"] == [{"protocol": "TCP", "port": 9400}]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_the_metrics_port_is_open_to_the_scrapers_the_administrator_names():
    monitoring = ({"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}},)
    policy = ClusterPolicy.from_settings("*", 6, json.dumps(list(monitoring)))
    assert policy.metrics_from == monitoring
    _, scrape = m.network_policy("gpt", "team-a", "uid-1", policy.metrics_from)["spec"]["ingress"]
    assert scrape["from"] == list(monitoring)
    assert ClusterPolicy.from_settings("*", 6, "").metrics_from == m.ANY_NAMESPACE
    for bad, says in (("{nope", "not JSON"), ("[]", "non-empty"),
                      ('[{"namespace": "monitoring"}]', "not a NetworkPolicy peer")):
        with pytest.raises(ValueError, match=says):
            parse_peers(bad)
