"""One projection from a PretrainJob to the trainer's config, and a drift hash of what reaches pods.

`TrainJobConfig.from_job` is the only way from a spec to the trainer's config: the operator's
ConfigMap and `crucible train --config <a whole PretrainJob>` must both come out equal to it, for
every field, over random valid specs (hypothesis). Which fields the operator alone reads is
declared on the models (`OPERATOR_ONLY`); the list is pinned here, and a change to such a field
restarts nothing and rewrites nothing, while a change to anything else does.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crucible.api import arch
from crucible.api.launch import CONFIG_FILE, METRICS_PORT, output_dir
from crucible.api.names import API_VERSION, KIND
from crucible.api.spec import (OPERATOR_ONLY, PretrainJobSpec, TrainJobConfig, load_train_config,
                               pod_facing)
from crucible.operator import manifests as m
from crucible.operator.decision import decide
from tests.operator import builders as b

# Every spec field only the operator reads, by its API path. Adding one is a decision: it must
# never change what a pod runs.
OPERATOR_ONLY_PATHS = {
    "suspend", "ttlSecondsAfterFinished",
    "faultTolerance.maxRestarts", "faultTolerance.cordonFailedNodes",
    "faultTolerance.hangTimeoutSeconds", "faultTolerance.retryableExitCodes",
    "faultTolerance.maxRestartsWithoutProgress", "faultTolerance.nodeFailureGraceSeconds",
    "faultTolerance.nodeFailureConditions", "faultTolerance.pendingTimeoutSeconds",
    "faultTolerance.terminatingTimeoutSeconds", "faultTolerance.maxInfrastructureRestarts",
    "faultTolerance.infrastructureRestartWindowMinutes", "faultTolerance.startupTimeoutSeconds",
    "faultTolerance.capacityTimeoutSeconds", "faultTolerance.capacityRetrySeconds",
    "faultTolerance.avoidFailedNodesMinutes", "faultTolerance.stragglers.replaceAfterMinutes",
}
# A valid new value for each, to change it with.
OPERATOR_ONLY_EDITS = {
    "suspend": True, "ttlSecondsAfterFinished": 60,
    "faultTolerance.maxRestarts": 7, "faultTolerance.cordonFailedNodes": False,
    "faultTolerance.hangTimeoutSeconds": 1234, "faultTolerance.retryableExitCodes": [42],
    "faultTolerance.maxRestartsWithoutProgress": 9, "faultTolerance.nodeFailureGraceSeconds": 5,
    "faultTolerance.nodeFailureConditions": ["GPUUnhealthy"],
    "faultTolerance.pendingTimeoutSeconds": 900, "faultTolerance.terminatingTimeoutSeconds": 30,
    "faultTolerance.maxInfrastructureRestarts": 3,
    "faultTolerance.infrastructureRestartWindowMinutes": 10,
    "faultTolerance.startupTimeoutSeconds": 900,
    "faultTolerance.capacityTimeoutSeconds": 600, "faultTolerance.capacityRetrySeconds": 60,
    "faultTolerance.avoidFailedNodesMinutes": 30,
    "faultTolerance.stragglers.replaceAfterMinutes": 15,
}
POD_FACING_EDITS = {
    "training.lr": 1e-3, "image": "registry.example/crucible-trainer:0.2",
    "faultTolerance.spikeGuard.zSkip": 9.0, "faultTolerance.torchrunMaxRestarts": 5,
    "checkpoint.keep": 5, "data.val": "s3://bucket/tokens/val",
}


def operator_only_paths(model=PretrainJobSpec, prefix: str = "") -> set[str]:
    from crucible.api.spec import model_type

    out = set()
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        if OPERATOR_ONLY in field.metadata:
            out.add(path)
        elif (sub := model_type(field.annotation)) is not None:
            out |= operator_only_paths(sub, path + ".")
    return out


def with_edit(doc: dict, path: str, value) -> dict:
    doc = yaml.safe_load(yaml.safe_dump(doc))  # a deep copy
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return doc


def test_the_operator_only_fields_are_declared_on_the_models():
    assert operator_only_paths() == OPERATOR_ONLY_PATHS
    assert set(OPERATOR_ONLY_EDITS) == OPERATOR_ONLY_PATHS
    facing = pod_facing(b.spec())
    assert "maxRestarts" not in facing["faultTolerance"] and "suspend" not in facing
    assert facing["training"]["lr"] == 6e-4 and facing["faultTolerance"]["spikeGuard"]


def test_from_job_carries_the_pod_facing_parts_and_the_launch_contract():
    spec = b.spec(training={"tokens": 1e9, "lr": 3e-4})
    cfg = TrainJobConfig.from_job(spec, "gpt")
    assert cfg.name == "gpt" and cfg.output_dir == output_dir("gpt")
    assert cfg.metrics.port == METRICS_PORT
    assert (cfg.model, cfg.data, cfg.training, cfg.checkpoint) == (
        spec.model, spec.data, spec.training, spec.checkpoint)
    assert cfg.fault_tolerance.spike_guard == spec.fault_tolerance.spike_guard


@pytest.mark.parametrize("path", sorted(OPERATOR_ONLY_EDITS))
def test_an_operator_only_change_restarts_nothing_and_rewrites_nothing(path):
    edited = PretrainJobSpec.model_validate(with_edit(b.spec_doc(), path,
                                                      OPERATOR_ONLY_EDITS[path]))
    assert m.spec_hash(edited) == m.spec_hash(b.spec())
    assert m.config_map(b.JOB, b.NS, b.UID, edited) == m.config_map(b.JOB, b.NS, b.UID, b.spec())
    if path == "suspend":
        return  # suspending deletes the pods on purpose (a tested lifecycle of its own)
    from tests.operator.test_decision import running_status

    h = m.spec_hash(b.spec())
    job = dataclasses.replace(b.job(status=running_status()),
                              spec=with_edit(b.spec_doc(), path, OPERATOR_ONLY_EDITS[path]))
    outcome = decide(job, b.observed(b.running(0, 4, h)), b.at(5))
    assert outcome.status["podGeneration"] == 0, path
    assert not [a for a in outcome.actions if a.kind in ("Pod", "ConfigMap")], path


@pytest.mark.parametrize("path", sorted(POD_FACING_EDITS))
def test_a_change_that_reaches_the_pods_restarts_them(path):
    from tests.operator.test_decision import running_status

    h = m.spec_hash(b.spec())
    job = dataclasses.replace(b.job(status=running_status()),
                              spec=with_edit(b.spec_doc(), path, POD_FACING_EDITS[path]))
    outcome = decide(job, b.observed(b.running(0, 4, h)), b.at(5))
    assert outcome.status["podGeneration"] == 1, path
    reasons = [c["reason"] for c in outcome.status["conditions"] if c["type"] == "Restarting"]
    assert reasons == ["SpecChanged"]


# --- random valid specs ------------------------------------------------------------------------
NAMES = st.from_regex(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", fullmatch=True)
# Bucket names as S3 allows them: 3-63 characters, starting and ending with a letter or digit.
URIS = st.one_of(st.from_regex(r"s3://[a-z0-9][a-z0-9-]{1,20}[a-z0-9]/[a-z0-9/_-]{1,30}",
                               fullmatch=True),
                 st.from_regex(r"/data/[a-z0-9_]{1,12}", fullmatch=True))


def _maybe(**fields) -> st.SearchStrategy[dict]:
    """A dict holding any subset of the given fields."""
    return st.fixed_dictionaries({}, optional=fields)


@st.composite
def models(draw) -> dict:
    if draw(st.booleans()):
        doc = {"preset": draw(st.sampled_from(sorted(arch.PRESETS)))}
        if draw(st.booleans()):
            doc["seqLen"] = draw(st.sampled_from([128, 512, 2048]))
        return doc
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    return {"layers": draw(st.integers(1, 48)), "heads": heads,
            "dim": heads * 2 * draw(st.integers(4, 64)),
            "seqLen": draw(st.sampled_from([64, 1024])),
            "vocabSize": draw(st.integers(256, 70000)), "tiedEmbeddings": draw(st.booleans())}


def spec_docs() -> st.SearchStrategy[dict]:
    nodes = st.integers(1, 8).flatmap(lambda lo: st.fixed_dictionaries(
        {"min": st.just(lo), "max": st.integers(lo, 16)}))
    training = st.fixed_dictionaries({"tokens": st.floats(1e3, 1e13)}, optional={
        "globalBatchTokens": st.integers(1, 1 << 22), "microBatch": st.integers(1, 64),
        "lr": st.floats(1e-6, 1e-2), "warmupSteps": st.integers(0, 5000),
        "schedule": st.sampled_from(["cosine", "wsd", "constant"]),
        "precision": st.sampled_from(["bf16", "fp32"]), "seed": st.integers(0, 2**31),
        "compile": st.booleans(), "evalEvery": st.integers(0, 1000)})
    checkpoint = _maybe(uri=URIS, everyMinutes=st.floats(0, 120), everySteps=st.integers(0, 10**4),
                        keep=st.integers(2, 10), keepEvery=st.integers(0, 10**4),
                        credentialsSecret=NAMES, **{"async": st.booleans()})
    guard = _maybe(enabled=st.booleans(), zSkip=st.floats(1, 20), window=st.integers(8, 1000),
                   lrFactor=st.floats(0.01, 1))
    fault = _maybe(spikeGuard=guard, torchrunMaxRestarts=st.integers(0, 10),
                   maxRestarts=st.integers(0, 100), hangTimeoutSeconds=st.integers(30, 7200),
                   cordonFailedNodes=st.booleans(),
                   nodeFailureConditions=st.lists(st.sampled_from(["GPUUnhealthy", "XidError"]),
                                                  unique=True))
    return st.fixed_dictionaries(
        {"image": st.from_regex(r"registry\.example/[a-z]{1,10}:[0-9]\.[0-9]", fullmatch=True),
         "model": models(), "data": st.fixed_dictionaries({"train": URIS}, optional={"val": URIS}),
         "training": training},
        optional={"nodes": nodes, "procsPerNode": st.integers(1, 8), "checkpoint": checkpoint,
                  "faultTolerance": fault, "suspend": st.booleans(),
                  "ttlSecondsAfterFinished": st.integers(0, 10**5)})


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=spec_docs(), name=NAMES)
def test_configmap_and_manifest_both_read_back_as_the_direct_projection(tmp_path, doc, name):
    spec = PretrainJobSpec.model_validate(doc)
    direct = TrainJobConfig.from_job(spec, name)
    # What the operator mounts, read by the trainer.
    config_file = tmp_path / CONFIG_FILE
    config_file.write_text(m.config_map(name, "ns", "uid", spec)["data"][CONFIG_FILE])
    assert load_train_config(config_file) == direct
    # A whole PretrainJob manifest given to `crucible train --config`.
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": API_VERSION, "kind": KIND,
                                        "metadata": {"name": name}, "spec": doc}))
    assert load_train_config(manifest) == direct
    # Operator-only fields change neither the projection nor the drift hash.
    for path, value in OPERATOR_ONLY_EDITS.items():
        edited = PretrainJobSpec.model_validate(with_edit(doc, path, value))
        assert TrainJobConfig.from_job(edited, name) == direct, path
        assert m.spec_hash(edited) == m.spec_hash(spec), path
