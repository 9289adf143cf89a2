"""The Indexed Job manifest: the shipped YAML is exactly what the renderer produces, it is a valid
Indexed Job, its config is a valid corpus config, its container command parses with the real
`crucible` parser and resolves its shard from JOB_COMPLETION_INDEX, its pods meet the Pod Security
Standards' "restricted" profile (checked by a real API server's admission on the stack) and read
S3 credentials key by key."""

from __future__ import annotations

import copy
import secrets
from pathlib import Path

import pytest
import yaml

from crucible.trainer.cli import build_parser, main
from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus.indexed_job import render_job, to_yaml
from crucible.trainer.corpus.shards import Shard
from tests.support.services import eventually

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "manifests" / "corpus" / "indexed-job.yaml"
EXAMPLE = REPO / "manifests" / "corpus" / "corpus.yaml"


def rendered() -> list[dict]:
    return render_job("corpus", "registry.example/crucible-trainer:0.1", EXAMPLE.read_text(), 8)


def test_shipped_manifest_is_the_rendered_one():
    assert SHIPPED.read_text() == to_yaml(rendered())
    assert list(yaml.safe_load_all(SHIPPED.read_text())) == rendered()


def test_job_is_indexed_and_mounts_a_valid_config():
    config_map, _, job = rendered()
    spec = job["spec"]
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 8
    # backoffLimitPerIndex requires restartPolicy Never.
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    volume = spec["template"]["spec"]["volumes"][0]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    cfg = corpus_config.load(config_map["data"]["corpus.yaml"])
    assert cfg.output.startswith("s3://") and [s.name for s in cfg.sources] == ["web", "books"]


def test_container_command_parses_with_the_real_cli():
    _, _, job = rendered()
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["crucible"]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.corpus_command) == ("corpus", "run")
    assert args.config == "/etc/crucible/corpus/corpus.yaml"
    mount = container["volumeMounts"][0]["mountPath"]
    assert args.config.startswith(mount + "/")
    for index in range(8):
        assert Shard.parse(args.shard, {"JOB_COMPLETION_INDEX": str(index)}) == Shard(index, 8)


def test_more_shards_than_pods_reach_the_workers():
    _, _, job = render_job("c", "img", EXAMPLE.read_text(), 4, shards=32)
    args = build_parser().parse_args(job["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.shards == 32 and Shard.parse(args.shard, {"JOB_COMPLETION_INDEX": "3"}) == \
        Shard(3, 4)
    assert "--shards" not in pod_spec(rendered()[-1])["containers"][0]["args"]   # one per pod
    with pytest.raises(ValueError, match="shards"):
        render_job("c", "img", EXAMPLE.read_text(), 4, shards=0)


def pod_spec(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def test_pods_run_restricted_with_one_writable_scratch_dir():
    _, _, job = rendered()
    spec = pod_spec(job)
    [container] = spec["containers"]
    assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                       "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert spec["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HOME"] == env["TMPDIR"] == container["workingDir"] == "/scratch"
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
    assert writable == [{"name": "scratch", "mountPath": "/scratch"}]
    assert volumes["scratch"]["emptyDir"] == {"sizeLimit": "32Gi"}


def secret_refs(container: dict) -> dict:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "valueFrom" in e}


def test_s3_credentials_are_read_key_by_key():
    _, _, job = rendered()
    [container] = pod_spec(job)["containers"]
    assert "envFrom" not in container
    assert secret_refs(container) == {
        "AWS_ACCESS_KEY_ID": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID", "optional": False},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY",
                                  "optional": False},
        "AWS_ENDPOINT_URL": {"name": "s3-creds", "key": "AWS_ENDPOINT_URL", "optional": True},
        "AWS_DEFAULT_REGION": {"name": "s3-creds", "key": "AWS_DEFAULT_REGION", "optional": True}}
    _, _, job = render_job("c", "img", EXAMPLE.read_text(), 1, s3_secret="minio",
                        s3_keys={"AWS_ACCESS_KEY_ID": "accessKey"})
    refs = secret_refs(pod_spec(job)["containers"][0])
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "minio", "key": "accessKey", "optional": False}
    assert refs["AWS_SECRET_ACCESS_KEY"]["key"] == "AWS_SECRET_ACCESS_KEY"
    _, _, job = render_job("c", "img", EXAMPLE.read_text(), 1, s3_secret=None)
    assert secret_refs(pod_spec(job)["containers"][0]) == {}
    with pytest.raises(ValueError, match="AWS_SECRET_KEY"):
        render_job("c", "img", EXAMPLE.read_text(), 1, s3_keys={"AWS_SECRET_KEY": "k"})


def test_the_pods_get_a_network_policy_first_no_ingress_and_no_instance_metadata(capsys):
    objects = rendered()
    assert [o["kind"] for o in objects] == ["ConfigMap", "NetworkPolicy", "Job"]
    _, policy, job = objects
    labels = job["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector and all(labels.get(k) == v for k, v in selector.items())
    assert policy["spec"]["ingress"] == [] and "Ingress" in policy["spec"]["policyTypes"]
    [egress] = policy["spec"]["egress"]
    blocked = {a for peer in egress["to"] for a in peer.get("ipBlock", {}).get("except", [])}
    assert "169.254.169.254/32" in blocked and "fd00:ec2::254/128" in blocked
    env = {e["name"]: e.get("value") for e in pod_spec(job)["containers"][0]["env"]}
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"
    # An admin who lets the pods use the node's role (GKE workload identity) says so.
    argv = ["corpus", "manifest", "--config", str(EXAMPLE), "--workers", "2", "--image", "img"]
    assert main(argv + ["--allow-instance-metadata"]) == 0
    _, policy, job = yaml.safe_load_all(capsys.readouterr().out)
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
    assert "AWS_EC2_METADATA_DISABLED" not in {
        e["name"] for e in pod_spec(job)["containers"][0]["env"]}


def test_manifest_cli_takes_secret_keys(capsys):
    argv = ["corpus", "manifest", "--config", str(EXAMPLE), "--workers", "2", "--image", "img"]
    assert main(argv + ["--s3-key", "AWS_SECRET_ACCESS_KEY=secretKey", "--scratch", "8Gi"]) == 0
    _, _, job = yaml.safe_load_all(capsys.readouterr().out)
    refs = secret_refs(pod_spec(job)["containers"][0])
    assert refs["AWS_SECRET_ACCESS_KEY"]["key"] == "secretKey"
    assert pod_spec(job)["volumes"][1]["emptyDir"] == {"sizeLimit": "8Gi"}
    assert main(argv + ["--s3-key", "AWS_SECRET_ACCESS_KEY"]) == 2
    assert main(argv + ["--s3-key", "AWS_TYPO=secretKey"]) == 2


@pytest.fixture
def restricted_namespace(kube):
    """A namespace where Pod Security admission enforces the restricted profile; deleted after."""
    from kubernetes import client

    name = f"t-restricted-{secrets.token_hex(3)}"     # "t-": a killed run's leftover is cleaned
    core = kube.core()
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"pod-security.kubernetes.io/enforce": "restricted",
                           "pod-security.kubernetes.io/enforce-version": "latest"})))
    try:
        # Pods are refused until the controller-manager has created the "default" SA.
        eventually(lambda: core.read_namespaced_service_account("default", name), 30,
                   f"ServiceAccount default in {name}")
        yield name
    finally:
        kube.delete_namespace(name)


@pytest.mark.stack
def test_restricted_namespace_admits_the_job_and_refuses_its_pods_without_hardening(
        kube, restricted_namespace):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    namespace = restricted_namespace
    config_map, policy, job = render_job("corpus", "registry.example/crucible-trainer:0.1",
                                         EXAMPLE.read_text(), 2, namespace=namespace)
    core, batch = kube.core(), client.BatchV1Api(kube.client())
    core.create_namespaced_config_map(namespace, config_map, dry_run="All")
    client.NetworkingV1Api(kube.client()).create_namespaced_network_policy(namespace, policy,
                                                                          dry_run="All")
    batch.create_namespaced_job(namespace, job, dry_run="All")
    # Pod Security admission enforces on pods only (a Job gets warnings at most), so the pod the
    # Job controller would create is submitted too, and once more without the securityContexts.
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "corpus-0", "namespace": namespace,
                        "labels": job["spec"]["template"]["metadata"]["labels"]},
           "spec": copy.deepcopy(pod_spec(job))}
    core.create_namespaced_pod(namespace, pod, dry_run="All")
    del pod["spec"]["securityContext"], pod["spec"]["containers"][0]["securityContext"]
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(namespace, pod, dry_run="All")
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body
