"""The real apiserver rejects bad PretrainJobs at apply time, naming the field.

Each case goes to the apiserver as `kubectl apply` sends it (a create with server-side field
validation Strict; dry run, so nothing is stored) and through `kubectl apply --dry-run=server`
itself. The same spec must also fail the trainer's pydantic model (one source of truth), except
what only the apiserver can judge: the object's name and transitions between versions.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from crucible.api.spec import PretrainJobSpec
from crucible.operator import crd
from tests.operator.cluster import job_body

pytestmark = pytest.mark.stack


def _set(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, leaf = path.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(leaf)
    else:
        node[leaf] = value
    return doc


DELETE = object()
# (case id, field path to set under the object, value, text the rejection must contain)
CASES = [
    ("min-above-max", "spec.nodes", {"min": 4, "max": 2}, "spec.nodes"),
    ("min-zero", "spec.nodes.min", 0, "spec.nodes.min"),
    ("max-too-large", "spec.nodes.max", 5000, "spec.nodes.max"),
    ("procs-zero", "spec.procsPerNode", 0, "spec.procsPerNode"),
    ("procs-not-a-number", "spec.procsPerNode", "eight", "spec.procsPerNode"),
    ("no-image", "spec.image", DELETE, "spec.image"),
    ("empty-image", "spec.image", "", "spec.image"),
    ("no-model", "spec.model", DELETE, "spec.model"),
    ("unknown-preset", "spec.model.preset", "gpt-5", "spec.model.preset"),
    ("model-incomplete", "spec.model", {"layers": 4}, "spec.model"),
    ("dim-not-divisible", "spec.model", {"preset": "tiny", "heads": 3}, "spec.model"),
    ("odd-head-dim", "spec.model", {"layers": 2, "heads": 32, "dim": 96, "seqLen": 64,
                                    "vocabSize": 512}, "spec.model"),
    ("layers-out-of-range", "spec.model.layers", 1000, "spec.model.layers"),
    ("no-data", "spec.data", DELETE, "spec.data"),
    ("empty-train", "spec.data.train", "", "spec.data.train"),
    ("tokens-zero", "spec.training.tokens", 0, "spec.training.tokens"),
    ("lr-above-one", "spec.training.lr", 2.0, "spec.training.lr"),
    ("unknown-schedule", "spec.training.schedule", "linear", "spec.training.schedule"),
    ("unknown-precision", "spec.training.precision", "fp16", "spec.training.precision"),
    ("beta1-one", "spec.training.beta1", 1.0, "spec.training.beta1"),
    ("micro-batch-zero", "spec.training.microBatch", 0, "spec.training.microBatch"),
    ("ramp-start-not-below-batch", "spec.training.batchRamp",
     {"startTokens": 524288, "rampTokens": 1e5}, "startTokens must be below"),
    ("ramp-longer-than-run", "spec.training.batchRamp",
     {"startTokens": 32768, "rampTokens": 2e6}, "rampTokens must not exceed training.tokens"),
    # tiny: 4 heads, tied head; the job: 1 process a node, 1 to 2 nodes.
    ("tensor-outside-a-node", "spec.training.parallelism", {"tensor": 2},
     "tensor must divide procsPerNode"),
    ("tensor-misfits-heads", "spec.training.parallelism", {"tensor": 8},
     "must divide the model's heads"),
    ("pipeline-tied-head", "spec.training.parallelism", {"pipeline": 2}, "needs an untied head"),
    ("unknown-pipeline-schedule", "spec.training.parallelism", {"schedule": "zeroBubble"},
     "spec.training.parallelism.schedule"),
    ("interleaved-one-virtual-stage", "spec.training.parallelism",
     {"pipeline": 2, "schedule": "interleaved1F1B"}, "virtualStages is at least 2"),
    ("virtual-stages-without-interleaving", "spec.training.parallelism",
     {"pipeline": 2, "virtualStages": 2}, "virtualStages is at least 2"),
    ("interleaved-without-a-pipeline", "spec.training.parallelism",
     {"schedule": "interleaved1F1B", "virtualStages": 2}, "needs pipeline of at least 2"),
    ("keep-one", "spec.checkpoint.keep", 1, "spec.checkpoint.keep"),
    ("checkpoint-bad-bucket", "spec.checkpoint.uri", "s3://B/runs", "spec.checkpoint"),
    ("checkpoint-bad-scheme", "spec.checkpoint.uri", "gs://bucket/runs", "spec.checkpoint"),
    ("negative-interval", "spec.checkpoint.everyMinutes", -1, "spec.checkpoint.everyMinutes"),
    ("hang-timeout-short", "spec.faultTolerance.hangTimeoutSeconds", 10,
     "spec.faultTolerance.hangTimeoutSeconds"),
    ("negative-budget", "spec.faultTolerance.maxRestarts", -1, "spec.faultTolerance.maxRestarts"),
    ("exit-code-zero", "spec.faultTolerance.retryableExitCodes", [0],
     "spec.faultTolerance.retryableExitCodes[0]"),
    ("exit-code-duplicate", "spec.faultTolerance.retryableExitCodes", [3, 3],
     "spec.faultTolerance.retryableExitCodes[1]"),
    ("grace-too-long", "spec.faultTolerance.nodeFailureGraceSeconds", 4000,
     "spec.faultTolerance.nodeFailureGraceSeconds"),
    ("failure-condition-ready", "spec.faultTolerance.nodeFailureConditions",
     ["GPUUnhealthy", "Ready"], "spec.faultTolerance.nodeFailureConditions"),
    ("suspend-not-bool", "spec.suspend", "yes", "spec.suspend"),
    ("resources-bad-key", "spec.resources", {"limitz": {"cpu": 1}}, "spec.resources"),
    ("resources-bad-quantity", "spec.resources", {"limits": {"cpu": "lots"}},
     "spec.resources.limits.cpu"),
    ("toleration-exists-with-value", "spec.scheduling.tolerations",
     [{"key": "gpu", "operator": "Exists", "value": "x"}], "spec.scheduling.tolerations[0]"),
    ("toleration-bad-effect", "spec.scheduling.tolerations",
     [{"key": "gpu", "operator": "Exists", "effect": "Sometimes"}],
     "spec.scheduling.tolerations[0].effect"),
    ("negative-ttl", "spec.ttlSecondsAfterFinished", -1, "spec.ttlSecondsAfterFinished"),
    ("secret-not-a-name", "spec.checkpoint.credentialsSecret", "S3_Creds",
     "spec.checkpoint.credentialsSecret"),
    ("priority-class-not-a-name", "spec.scheduling.priorityClassName", "High Priority",
     "spec.scheduling.priorityClassName"),
    ("shm-not-a-quantity", "spec.shmSizeLimit", "lots", "spec.shmSizeLimit"),
    ("unknown-field", "spec.nodez", {"min": 1}, "spec.nodez"),
    ("name-too-long", "metadata.name", "g" * 41, "metadata.name"),
    ("name-starts-with-digit", "metadata.name", "1gpt", "metadata.name"),
]
# The name is not part of the spec; pydantic's lax mode reads the string "yes" as true (it must stay
# lax: PyYAML reads `tokens: 2.5e9` as a string), the apiserver's schema does not.
APISERVER_ONLY = {"name-too-long", "name-starts-with-digit", "suspend-not-bool"}


def _valid() -> dict:
    return job_body("gpt", checkpoint={"uri": "s3://crucible/runs/gpt"})


def _kubectl_rejection(cluster, doc: dict) -> str | None:
    out = subprocess.run(["kubectl", "apply", "--dry-run=server", "-n", cluster.namespace,
                          "-f", "-"], input=yaml.safe_dump(doc), capture_output=True, text=True,
                         env={**os.environ, "KUBECONFIG": str(cluster.kube.kubeconfig)},
                         timeout=60)
    return out.stderr if out.returncode else None


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_a_valid_job_is_accepted_with_the_models_defaults(cluster):
    created = cluster.objs.create_namespaced_custom_object(
        crd.GROUP, crd.VERSION, cluster.namespace, crd.PLURAL, _valid(), dry_run="All",
        field_validation="Strict")
    expected = PretrainJobSpec.model_validate(_valid()["spec"]).model_dump(
        by_alias=True, exclude_none=True, mode="json")
    assert created["spec"] == expected


@pytest.mark.parametrize("case, path, value, field", CASES, ids=[c[0] for c in CASES])
def test_invalid_spec_is_rejected_naming_the_field(cluster, case, path, value, field):
    doc = _set(_valid(), path, value)
    message = cluster.rejection(doc)
    assert message is not None, f"{case}: the apiserver accepted it"
    assert field in message, f"{case}: {field!r} not named in {message}"
    if shutil.which("kubectl"):  # the CLI prints the same server-side message
        printed = _kubectl_rejection(cluster, doc)
        assert printed is not None and field in printed, printed
    if case not in APISERVER_ONLY:
        with pytest.raises(ValidationError):
            PretrainJobSpec.model_validate(doc["spec"])


@pytest.mark.parametrize("model, parallelism", [
    ({"preset": "llama-tiny"}, {"tensor": 2, "pipeline": 2}),
    ({"preset": "llama-8b"}, {"tensor": 8, "schedule": "GPipe", "pipeline": 4}),
    ({"preset": "gpt2-124m", "tiedEmbeddings": False}, {"pipeline": 4}),
    ({"preset": "llama-8b"}, {"tensor": 8, "pipeline": 4, "schedule": "interleaved1F1B",
                              "virtualStages": 4}),
])
def test_the_apiserver_accepts_the_layouts_that_fit(cluster, model, parallelism):
    # The CEL rules must not refuse what the trainer runs: each is checked by pydantic too.
    doc = _valid()
    doc["spec"].update(model=model, procsPerNode=8, nodes={"min": 4, "max": 4})
    doc["spec"]["training"]["parallelism"] = parallelism
    PretrainJobSpec.model_validate(doc["spec"])
    assert cluster.rejection(doc) is None


def test_checkpoint_uri_cannot_change_once_set(cluster):
    cluster.objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, cluster.namespace,
                                                 crd.PLURAL, _valid())
    with pytest.raises(ApiException) as rejected:
        cluster.patch_spec("gpt", {"checkpoint": {"uri": "s3://crucible/runs/elsewhere"}})
    assert rejected.value.status == 422
    assert "spec.checkpoint" in rejected.value.body and "cannot change" in rejected.value.body
    cluster.patch_spec("gpt", {"training": {"lr": 1e-4}})   # other edits are fine
    cluster.delete_job("gpt")


def test_the_workload_identity_cannot_change_once_the_job_exists(cluster):
    body = _valid()
    irsa = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/gpt"}
    body["spec"]["serviceAccount"] = {"annotations": irsa}
    cluster.objs.create_namespaced_custom_object(crd.GROUP, crd.VERSION, cluster.namespace,
                                                 crd.PLURAL, body)
    for change in ({"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/admin"}},
                   {"annotations": None}):
        with pytest.raises(ApiException) as rejected:
            cluster.patch_spec("gpt", {"serviceAccount": change})
        assert rejected.value.status == 422
        assert "serviceAccount cannot change" in rejected.value.body
    cluster.patch_spec("gpt", {"serviceAccount": {"annotations": irsa}})   # the same is fine
    cluster.delete_job("gpt")
