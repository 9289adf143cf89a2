"""The KubeRay RayJob manifest: the shipped YAML is exactly what the renderer produces, its
entrypoint parses with the real `crucible` parser and runs on Ray, its config is a valid corpus
config, and every pod (head, workers, submitter) has the Indexed Job's security posture, with
Ray's writable places and S3 credentials read key by key."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from crucible.trainer.cli import build_parser, main
from crucible.trainer.corpus import config as corpus_config
from crucible.trainer.corpus.indexed_job import to_yaml
from crucible.trainer.corpus.rayjob import render_rayjob
from tests.corpus.test_indexed_job import restricted_namespace  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "manifests" / "corpus" / "rayjob.yaml"
EXAMPLE = REPO / "manifests" / "corpus" / "corpus.yaml"


def rendered(**kwargs) -> list[dict]:
    return render_rayjob("corpus", "registry.example/crucible-trainer:0.1", EXAMPLE.read_text(),
                         8, **kwargs)


def test_shipped_manifest_is_the_rendered_one():
    assert SHIPPED.read_text() == to_yaml(rendered())
    assert list(yaml.safe_load_all(SHIPPED.read_text())) == rendered()


def test_manifest_cli_renders_the_rayjob(capsys):
    argv = ["corpus", "manifest", "--config", str(EXAMPLE), "--workers", "8", "--image",
            "registry.example/crucible-trainer:0.1", "--name", "corpus"]
    assert main(argv + ["--engine", "ray"]) == 0
    assert capsys.readouterr().out == SHIPPED.read_text()
    assert main(argv) == 0                                      # the default engine
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)] == [
        "ConfigMap", "NetworkPolicy", "Job"]
    assert main(argv + ["--engine", "ray", "--ray-resources", "buckets=cpu:1,memory:2Gi"]) == 0
    _, _, job = yaml.safe_load_all(capsys.readouterr().out)
    assert job["spec"]["entrypoint"].endswith("--ray-resources buckets=cpu:1,memory:2Gi")
    assert main(argv + ["--engine", "ray", "--ray-resources", "buckets=gpu:1"]) == 2
    assert main(argv + ["--engine", "ray", "--ray-resources", "bucket=cpu:1"]) == 2  # a typo
    assert "no stage bucket in this run" in capsys.readouterr().err
    assert main(argv + ["--ray-resources", "buckets=cpu:1"]) == 2   # not for the Indexed Job


def test_entrypoint_parses_with_the_real_cli_and_reads_the_mounted_config():
    config_map, _, job = rendered(ray_resources=["clusters=memory:8Gi"])
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "crucible"
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.corpus_command, args.ray) == ("corpus", "run", "auto")
    assert args.shards == 4 * 8 and args.ray_resources == ["clusters=memory:8Gi"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == "config")
    assert args.config.startswith(mount["mountPath"] + "/") and mount["readOnly"]
    volume = next(v for v in head["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    cfg = corpus_config.load(config_map["data"]["corpus.yaml"])
    assert cfg.output.startswith("s3://")


def test_head_runs_no_tasks_and_the_worker_group_has_the_workers():
    _, _, job = rendered()
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["authOptions"] == {"mode": "token"}      # the job API wants KubeRay's token
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    [workers] = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 8
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "1", "memory": "4Gi"}
    with pytest.raises(ValueError, match="workers"):
        rendered(cpus_per_worker=0)


def pods(job: dict) -> dict[str, dict]:
    cluster = job["spec"]["rayClusterSpec"]
    return {"head": cluster["headGroupSpec"]["template"]["spec"],
            "worker": cluster["workerGroupSpecs"][0]["template"]["spec"],
            "submitter": job["spec"]["submitterPodTemplate"]["spec"]}


def test_every_pod_runs_restricted_and_writes_only_to_its_empty_dirs():
    _, _, job = rendered()
    for role, spec in pods(job).items():
        [container] = spec["containers"]
        assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000,
                                           "runAsGroup": 1000,
                                           "seccompProfile": {"type": "RuntimeDefault"}}, role
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}, role
        assert spec["automountServiceAccountToken"] is False, role
        volumes = {v["name"]: v for v in spec["volumes"]}
        for mount in container["volumeMounts"]:
            if not mount.get("readOnly"):
                assert "sizeLimit" in volumes[mount["name"]]["emptyDir"], (role, mount)
    for role in ("head", "worker"):
        [container] = pods(job)[role]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HOME"] == env["TMPDIR"] == "/scratch"
        assert env["RAY_TMPDIR"] == "/tmp"                    # Ray's session folder: /tmp/ray
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/scratch", "/tmp/ray"}
        assert "command" not in container                     # KubeRay writes `ray start`


def test_the_ray_pods_meet_each_other_and_only_the_job_api_is_open_to_the_cluster():
    _, policy, job = rendered()
    spec = policy["spec"]
    cluster = job["spec"]["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"],
                 "worker": cluster["workerGroupSpecs"][0]["template"],
                 "submitter": job["spec"]["submitterPodTemplate"]}
    for role, template in templates.items():
        labels = template["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in spec["podSelector"]["matchLabels"].items()), role
    own, api = spec["ingress"]
    assert own == {"from": [{"podSelector": spec["podSelector"]}]}      # every port, own pods
    assert api["ports"] == [{"protocol": "TCP", "port": 8265}]
    blocked = {a for peer in spec["egress"][0]["to"] for a in peer.get("ipBlock", {}).get(
        "except", [])}
    assert "169.254.169.254/32" in blocked
    for role in ("head", "worker"):
        env = {e["name"]: e.get("value") for e in pods(job)[role]["containers"][0]["env"]}
        assert env["AWS_EC2_METADATA_DISABLED"] == "true"


def test_s3_credentials_are_read_key_by_key_where_tasks_run():
    _, _, job = rendered(s3_secret="minio", s3_keys={"AWS_ACCESS_KEY_ID": "accessKey"})
    for role in ("head", "worker"):
        [container] = pods(job)[role]["containers"]
        assert "envFrom" not in container
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
                if "valueFrom" in e}
        assert refs["AWS_ACCESS_KEY_ID"] == {"name": "minio", "key": "accessKey",
                                             "optional": False}
        assert refs["AWS_SECRET_ACCESS_KEY"]["key"] == "AWS_SECRET_ACCESS_KEY"
    [submitter] = pods(job)["submitter"]["containers"]
    assert not any("valueFrom" in e for e in submitter["env"])   # it only submits the job


@pytest.mark.stack
def test_restricted_namespace_admits_every_ray_pod(kube, restricted_namespace):  # noqa: F811
    """Pod Security admission on a real API server: the head, worker and submitter pods as their
    templates describe them (KubeRay adds a command, probes, env and the /dev/shm emptyDir, none
    of which the restricted profile looks at). The RayJob itself needs KubeRay's CRD, which the
    stack does not have."""
    _, policy, job = rendered(namespace=restricted_namespace)
    core = kube.core()
    from kubernetes import client
    client.NetworkingV1Api(kube.client()).create_namespaced_network_policy(
        restricted_namespace, policy, dry_run="All")
    for role, spec in pods(job).items():
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"corpus-{role}", "namespace": restricted_namespace},
               "spec": {**spec, "containers": [{**c, "command": ["sleep", "1"]}
                                               for c in spec["containers"]]}}
        core.create_namespaced_pod(restricted_namespace, pod, dry_run="All")
