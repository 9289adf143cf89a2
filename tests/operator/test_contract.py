"""The launch contract: run what the operator rendered, as a local process, against the real S3.

The contract between the operator and the trainer (docs/operator.md, "What a job owns";
docs/checkpoints.md): a pod the operator created (read back from the apiserver, not rebuilt) is
executed with its own command, args and environment, image aside. What a kubelet and a container
runtime would provide is provided the way they would:
  - env: literal values as rendered; fieldRefs from the pod object; secretKeyRefs from the real
    Secret (so the S3 credentials take the rendered path);
  - volumes: each mountPath maps to a host folder (the ConfigMap's files for `config`, empty
    folders for the emptyDirs); `$(VAR)` in args expands as Kubernetes expands it;
  - the ServiceAccount token mount: a kubeconfig holding a real token of the pod's ServiceAccount
    (trainer/lease.py reads KUBECONFIG when set), so the Lease is patched with the trainer's
    least-privilege identity;
  - cluster DNS and the pod's own network: the rendezvous host `<pod>.<service>` resolves to
    127.0.0.1 and its port to a free one (pods do not share ports; local processes do).
The trainer then runs on CPU, 1 node x 1 process: it reports progress through the Lease (the
operator turns it into status), commits checkpoints to SeaweedFS S3, and the next generation's
rendered pod resumes from the newest one.

Chaos survived: the first trainer process is SIGKILLed after its first committed checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client

from crucible.api.launch import output_dir
from crucible.api.names import LABEL_JOB
from tests.operator.cluster import free_port
from tests.operator.test_progress_lease import trainer_kubeconfig
from tests.support.operator_run import assert_clean_exit
from tests.support.services import eventually

pytestmark = pytest.mark.stack

BATCH_TOKENS = 1024      # 8 sequences of 128 tokens: one micro-batch, quick on a shared CPU
VOCAB = 2048


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Python's own reference docs (pydoc_data, shipped with CPython), BPE-tokenized into shards."""
    import pydoc_data.topics as topics

    from crucible.trainer.tokenizer.bpe import train_bpe
    from crucible.trainer.tokenizer.encode import encode_to_shards

    root = tmp_path_factory.mktemp("contract-corpus")
    docs = [topics.topics[key] for key in sorted(topics.topics)]
    tok = train_bpe(docs, VOCAB, root / "tokenizer.json")
    encode_to_shards(tok, docs, root / "shards", val_fraction=0.1, seed=0)
    return {"train": str(root / "shards" / "train"), "val": str(root / "shards" / "val"),
            "tokenizer": str(tok)}


def _job(cluster, corpus: dict, steps: int, uri: str, **checkpoint) -> None:
    cluster.create_job(
        "gpt", nodes={"min": 1, "max": 1}, procsPerNode=1,
        model={"preset": "tiny", "vocabSize": VOCAB}, data=corpus,
        training={"tokens": steps * BATCH_TOKENS, "globalBatchTokens": BATCH_TOKENS,
                  "microBatch": 8, "warmupSteps": 2, "lr": 3e-3, "precision": "fp32",
                  "evalTokens": 4096},
        checkpoint={"uri": uri, "credentialsSecret": "s3-creds", "keep": 2, **checkpoint})


def _s3_secret(cluster, s3) -> None:
    data = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_ENDPOINT_URL": s3.endpoint, "AWS_DEFAULT_REGION": s3.region}
    cluster.core.create_namespaced_secret(cluster.namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="s3-creds"), string_data=data))


class LocalPod:
    """One rendered pod, materialised on this host as a kubelet would, then run."""

    def __init__(self, cluster, pod_name: str, root: Path, kubeconfig: str):
        pod = cluster.core.read_namespaced_pod(pod_name, cluster.namespace)
        self.raw = cluster.api.sanitize_for_serialization(pod)
        self.root = root
        spec = self.raw["spec"]
        (container,) = spec["containers"]
        self.mounts = self._volumes(cluster, spec["volumes"], container["volumeMounts"])
        env = self._env(cluster, container["env"])
        env["KUBECONFIG"] = kubeconfig                 # the ServiceAccount token mount
        env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"  # the image
        self.env = self._dns({k: self._path(v) for k, v in env.items()})
        expand = lambda s: re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda mt: self.env[mt.group(1)], s)
        self.argv = container["command"] + [expand(a) for a in container["args"]]
        self.cwd = Path(self._path(container["workingDir"]))
        self.log = root / "pod.log"

    def _volumes(self, cluster, volumes: list, mounts: list) -> dict[str, Path]:
        by_name = {v["name"]: v for v in volumes}
        out = {}
        for mount in mounts:
            host = self.root / mount["name"]
            host.mkdir(parents=True, exist_ok=True)
            volume = by_name[mount["name"]]
            if "configMap" in volume:
                cm = cluster.core.read_namespaced_config_map(volume["configMap"]["name"],
                                                             cluster.namespace)
                for key, text in cm.data.items():
                    (host / key).write_text(text)
            if mount["mountPath"] != "/dev/shm":       # the host has a real one
                out[mount["mountPath"]] = host
        return out

    def _env(self, cluster, env: list) -> dict[str, str]:
        out = {}
        for var in env:
            if "value" in var:
                out[var["name"]] = var["value"]
                continue
            ref = var["valueFrom"]
            if "fieldRef" in ref:
                node = self.raw
                for part in ref["fieldRef"]["fieldPath"].split("."):
                    node = node[part]
                out[var["name"]] = node
            else:
                key = ref["secretKeyRef"]
                data = cluster.core.read_namespaced_secret(key["name"], cluster.namespace).data
                if key["key"] in data:
                    out[var["name"]] = base64.b64decode(data[key["key"]]).decode()
                else:
                    assert key.get("optional"), f"secret key {key['key']} missing"
        return out

    def _path(self, value: str) -> str:
        for mount_path, host in self.mounts.items():
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(host) + value[len(mount_path):]
        return value

    def _dns(self, env: dict) -> dict:
        host, port = env["PET_RDZV_ENDPOINT"].rsplit(":", 1)
        assert host == f"{self.raw['metadata']['name'].rsplit('-', 1)[0]}-0.{self.raw['spec']['subdomain']}"
        env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{free_port()}"
        return env

    def start(self) -> subprocess.Popen:
        return subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=open(self.log, "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def train_steps(self) -> list[int]:
        job = self.raw["metadata"]["labels"][LABEL_JOB]
        path = self.cwd / output_dir(job) / "metrics.jsonl"
        if not path.exists():
            return []
        return [r["step"] for r in map(json.loads, path.read_text().splitlines())
                if r.get("kind") == "train"]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def kill_pod(proc: subprocess.Popen) -> None:
    """What a pod's death does to its processes: all of them die (torchrun starts its workers
    in their own sessions, so a process group is not enough; walk the tree in /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, queue = [], [proc.pid]
    while queue:
        pid = queue.pop()
        tree.append(pid)
        queue += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def _finish(proc: subprocess.Popen, local: LocalPod, timeout_s: float) -> None:
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_pod(proc)
        raise AssertionError(f"the trainer did not finish in {timeout_s}s:\n{local.output()[-3000:]}")
    assert rc == 0, f"the rendered pod's command exited {rc}:\n{local.output()[-3000:]}"


def test_rendered_pod_trains_reports_progress_and_completes(cluster, run_operator, s3, tmp_path,
                                                            corpus):
    _s3_secret(cluster, s3)
    steps = 8
    with run_operator(cluster.namespace) as runner:
        _job(cluster, corpus, steps, f"s3://{s3.bucket}/runs/{cluster.namespace}/gpt")
        cluster.wait_running("gpt", 1, generation=0)
        kubeconfig = eventually(lambda: trainer_kubeconfig(cluster, "gpt", tmp_path / "kc"), 20,
                                "the trainer's ServiceAccount")
        local = LocalPod(cluster, "gpt-0-0", tmp_path / "gpt-0-0", kubeconfig)
        assert local.argv[:2] == ["torchrun", "--module"]
        _finish(local.start(), local, 300)
        assert local.train_steps()[-1] == steps
        status = eventually(lambda: (s := cluster.status("gpt")).get("step") == steps and s, 30,
                            "status.step from the trainer's Lease")
        assert status["tokensSeen"] == steps * BATCH_TOKENS and 0 < status["loss"] < 20
        assert status["worldSize"] == 1
        cluster.succeed_pod("gpt-0-0")                # the kubelet reports the exit code 0
        cluster.wait_phase("gpt", "Succeeded", 30)
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "Succeeded: pod gpt-0-0 exited 0: training complete at step 8")


def _committed_steps(s3, prefix: str) -> list[int]:
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix + "/")
    return sorted(int(mt.group(1)) for obj in listed.get("Contents", [])
                  if (mt := re.search(r"/step_0*(\d+)/manifest\.json$", obj["Key"])))


def test_rendered_pod_commits_a_checkpoint_and_the_next_generation_resumes(
        cluster, run_operator, s3, tmp_path, corpus):
    _s3_secret(cluster, s3)
    steps, prefix = 12, f"runs/{cluster.namespace}/gpt"
    with run_operator(cluster.namespace) as runner:
        _job(cluster, corpus, steps, f"s3://{s3.bucket}/{prefix}", everySteps=2)
        cluster.wait_running("gpt", 1, generation=0)
        kubeconfig = eventually(lambda: trainer_kubeconfig(cluster, "gpt", tmp_path / "kc"), 20,
                                "the trainer's ServiceAccount")
        first = LocalPod(cluster, "gpt-0-0", tmp_path / "gpt-0-0", kubeconfig)
        proc = first.start()
        try:
            committed = eventually(lambda: proc.poll() is None and _committed_steps(s3, prefix)
                                   or (proc.poll() is not None and pytest.fail(
                                       f"the trainer ended ({proc.returncode}) before committing "
                                       f"a checkpoint:\n{first.output()[-3000:]}")),
                                   240, "a committed checkpoint in S3")
        finally:
            kill_pod(proc)                             # chaos: the pod dies after a commit
        cluster.fail_pod("gpt-0-0", 137)               # what the kubelet reports for it
        cluster.wait_running("gpt", 1, generation=1)
        second = LocalPod(cluster, "gpt-1-0", tmp_path / "gpt-1-0", kubeconfig)
        _finish(second.start(), second, 300)
        resumed_at = second.train_steps()[0] - 1
        assert resumed_at >= committed[-1] > 0, (committed, second.output()[-2000:])
        assert second.train_steps()[-1] == steps
        assert "resumed from" in second.output()
        status = eventually(lambda: (s := cluster.status("gpt")).get("step") == steps and s, 30,
                            "final step in status")
        assert status["lastCheckpoint"]["step"] >= committed[-1]
        assert status["restarts"]["byCause"] == {"Signal": 1}
        cluster.succeed_pod("gpt-1-0")
        cluster.wait_phase("gpt", "Succeeded", 30)
        cluster.delete_job("gpt")
    assert_clean_exit(runner, "it hosted the c10d store; restarting the group as generation 1")
