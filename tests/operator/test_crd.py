"""The CRD is generated from api/spec.py, committed, and says what the pydantic models say."""

from __future__ import annotations

from pathlib import Path

import yaml

from crucible.api import arch
from crucible.api.spec import PretrainJobSpec
from crucible.operator import crd
from crucible.operator import manifests as m
from crucible.operator import rbac
from crucible.operator.decision import decide
from tests.operator import builders as b

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "manifests" / "crd" / "pretrainjobs.crucible.dev.yaml"
RBAC_FILE = REPO / "manifests" / "rbac" / "operator.yaml"


def test_committed_crd_is_what_the_generator_produces():
    assert CRD_FILE.read_text() == crd.render(), (
        "regenerate: crucible-operator crd > manifests/crd/pretrainjobs.crucible.dev.yaml")


def test_committed_rbac_is_what_the_generator_produces():
    assert RBAC_FILE.read_text() == rbac.render(), (
        "regenerate: crucible-operator rbac > manifests/rbac/operator.yaml")


def _version() -> dict:
    return crd.crd()["spec"]["versions"][0]


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_names_scope_subresource_and_printer_columns():
    doc = crd.crd()
    assert doc["metadata"]["name"] == "pretrainjobs.crucible.dev"
    assert doc["spec"]["names"]["shortNames"] == ["ptj"]
    assert _version()["name"] == "v1alpha1" and _version()["subresources"] == {"status": {}}
    columns = [c["name"].upper() for c in _version()["additionalPrinterColumns"]
               if not c.get("priority")]
    assert columns == ["PHASE", "STEP", "LOSS", "RESTARTS", "LAST-CKPT", "AGE"]


def test_every_spec_field_is_described_for_kubectl_explain():
    spec = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    undescribed = [path for path, node in _walk(spec, "spec")
                   if not path.endswith(("[]", "{}")) and not node.get("description")]
    assert undescribed == []


def test_schema_is_structural():
    # What the apiserver enforces for CRDs (apiextensions validation: structural schemas).
    root = _version()["schema"]["openAPIV3Schema"]
    for path, node in _walk(root, "root"):
        assert "$ref" not in node, path
        assert isinstance(node.get("additionalProperties", {}), dict), path  # never `false`
        assert "title" not in node and "uniqueItems" not in node, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") and node["anyOf"] == [
                {"type": "integer"}, {"type": "string"}], path
        else:
            # Untyped only where a value may be of two types (a boolean or a string): the
            # apiserver stores it as given and the operator validates it with the spec's model.
            assert "type" in node or node.get("x-kubernetes-int-or-string") or \
                node.get("x-kubernetes-preserve-unknown-fields"), path


def test_cel_rules_mirror_the_cross_field_validators():
    props = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["nodes"]["x-kubernetes-validations"][0]["rule"] == "self.min <= self.max"
    model_rules = [r["message"] for r in props["model"]["x-kubernetes-validations"]]
    assert any("divisible" in msg for msg in model_rules)
    assert any("give model.preset" in msg for msg in model_rules)
    assert props["model"]["properties"]["preset"]["enum"] == sorted(arch.PRESETS)


def _apply_defaults(schema: dict, value):
    """Structural defaulting as the apiserver does it: missing properties get their default."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = dict(value)
    for name, sub in schema["properties"].items():
        if name not in out and "default" in sub:
            out[name] = sub["default"]
        if name in out:
            out[name] = _apply_defaults(sub, out[name])
    return out


def test_apiserver_defaults_equal_pydantic_defaults():
    spec_schema = _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]
    minimal = {"image": "x", "model": {"preset": "tiny"}, "data": {"train": "d"},
               "training": {"tokens": 1e6}}
    defaulted = _apply_defaults(spec_schema, minimal)
    expected = PretrainJobSpec.model_validate(minimal).model_dump(by_alias=True, exclude_none=True,
                                                                  mode="json")
    assert defaulted == expected


def test_status_written_by_the_operator_is_declared_in_the_schema():
    status_schema = _version()["schema"]["openAPIV3Schema"]["properties"]["status"]
    nodes = b.healthy_nodes()
    nodes["gpu-node-2"] = b.node("gpu-node-2", ready="Unknown", since=0)
    pods = b.running(0, 4, m.spec_hash(b.spec()))
    job = b.job(status={"phase": "Running", "startTime": b.ts(0), "tracking": {
        "goodput": {"lastStep": 1, "lastStepTime": b.ts(1), "productiveSeconds": 1, "steps": 1}}})
    status = decide(job, b.observed(pods, nodes, b.lease(9, 60, checkpoint_step=5)),
                    b.at(100)).status

    def check(schema: dict, value, path: str):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return
        if isinstance(value, dict):
            props = schema.get("properties")
            extra = schema.get("additionalProperties")
            for key, sub in value.items():
                assert props and key in props or extra, f"{path}.{key} is not in the schema"
                check(props[key] if props and key in props else extra, sub, f"{path}.{key}")
        elif isinstance(value, list):
            for item in value:
                check(schema["items"], item, f"{path}[]")

    check(status_schema, status, "status")
    assert {"cordonedNodes", "lastCheckpoint", "goodput", "restarts", "pods"} <= set(status)


def test_generated_yaml_parses_back_to_the_same_document():
    assert yaml.safe_load(crd.render()) == crd.crd()
