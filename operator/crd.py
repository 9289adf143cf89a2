"""The PretrainJob CustomResourceDefinition, generated from `crucible.api.spec`.

Owns the translation from pydantic's JSON Schema (draft 2020-12) to a Kubernetes *structural*
OpenAPI v3 schema (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
custom-resource-definitions/#specifying-a-structural-schema): `$ref`s are inlined, `X | None`
becomes an optional X, `str | int` becomes `x-kubernetes-int-or-string`, numeric `exclusive*`
bounds become OpenAPI 3.0 booleans, `additionalProperties: false` is dropped (the apiserver prunes
unknown fields, and `kubectl apply` rejects them with field validation Strict), and objects whose
fields all have defaults default to `{}` so their nested defaults apply. Descriptions, enums,
ranges and CEL rules (`x-kubernetes-validations`) come through unchanged, so `kubectl explain
pretrainjob.spec` teaches what `api/spec.py` says.

The status schema is the operator's own output and is written here by hand; `decision.py` fills
it and a unit test checks every field it writes is declared. The generated YAML is committed as
`manifests/crd/pretrainjobs.crucible.dev.yaml`; a test fails when it differs from `render()`
(regenerate with `crucible-operator crd > manifests/crd/pretrainjobs.crucible.dev.yaml`).

Must not import kopf or kubernetes: `crucible-operator crd` renders it without the operator's
runtime (main.py imports kopf only for `run`), and so do the tests that compare it with the
committed YAML (charts/crucible/crds/ links to the same file).
"""

from __future__ import annotations

import copy

import yaml
from pydantic import BaseModel

# API_VERSION is re-exported: the operator's adapter and tests spell the resource as crd.*.
from crucible.api.names import (API_VERSION, CRD_NAME, GROUP, JOB_NAME_PATTERN,  # noqa: F401
                                KIND, MAX_JOB_NAME_LENGTH, PLURAL, SHORT_NAMES, SINGULAR, VERSION)
from crucible.api.spec import PretrainJobSpec, model_type

NAME = CRD_NAME

_DROP = {"title", "additionalProperties", "$defs", "uniqueItems", "discriminator"}


def _resolve(node: dict, defs: dict) -> dict:
    """Inline a `$ref`; the referring node's own keys (description, default) win."""
    ref = node.get("$ref")
    if ref is None:
        return node
    target = copy.deepcopy(defs[ref.rsplit("/", 1)[-1]])
    target.update({k: v for k, v in node.items() if k != "$ref"})
    return target


def _without_null(node: dict) -> dict:
    """`X | None` (anyOf with a null branch) -> X: absence is how a CRD says None."""
    branches = [b for b in node.get("anyOf", []) if b.get("type") != "null"]
    if "anyOf" not in node or len(branches) == len(node["anyOf"]):
        return node
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    if len(branches) == 1:
        merged = dict(branches[0])
        merged.update(rest)
        return merged
    return {**rest, "anyOf": branches}


def _int_or_string(node: dict) -> dict | None:
    branches = node.get("anyOf")
    if not branches or sorted(b.get("type", "") for b in branches) != ["integer", "string"]:
        return None
    out = {k: v for k, v in node.items() if k != "anyOf"}
    out["x-kubernetes-int-or-string"] = True
    # The one anyOf shape a structural schema allows (as controller-gen writes resource.Quantity):
    # exactly these two bare types; a string pattern moves beside them (it ignores integers).
    for branch in branches:
        out.update({k: v for k, v in branch.items() if k != "type"})
    if len(out) > len(node):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def structural(node: dict, defs: dict) -> dict:
    """Translate one JSON Schema node (and everything under it) to a structural schema node."""
    # Resolved again after dropping null: `X | None` for a model X is a `$ref` inside anyOf.
    node = _resolve(_without_null(_resolve(node, defs)), defs)
    special = _int_or_string(node)
    if special is not None:
        return {k: v for k, v in special.items() if k not in _DROP}
    out: dict = {}
    for key, value in node.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        else:
            out[key] = value
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = structural(extra, defs)
    return out


def _factory_defaults(model: type[BaseModel], schema: dict) -> None:
    """Give fields built by `default_factory` (pydantic omits them) their full default value.

    The apiserver checks a default against the CEL rules without defaulting inside it first,
    so `nodes: {}` would fail `self.min <= self.max`; the whole object `{min: 1, max: 1}` passes.
    """
    for name, field in model.model_fields.items():
        prop = schema.get("properties", {}).get(field.alias or name)
        if prop is None:
            continue
        sub_model = model_type(field.annotation)
        if field.default_factory is not None:
            value = field.default_factory()
            prop["default"] = (value.model_dump(by_alias=True, exclude_none=True, mode="json")
                               if isinstance(value, BaseModel) else value)
        if sub_model is not None:
            _factory_defaults(sub_model, prop)


def spec_schema() -> dict:
    schema = PretrainJobSpec.model_json_schema(by_alias=True, mode="validation")
    out = structural(schema, schema.get("$defs", {}))
    _factory_defaults(PretrainJobSpec, out)
    out["description"] = ("What to train and how to survive failures. Fields and defaults: "
                          "crucible.api.spec (docs/operator.md for the failure handling).")
    return out


def _obj(description: str, properties: dict, **extra) -> dict:
    return {"type": "object", "description": description, "properties": properties, **extra}


def _int(description: str) -> dict:
    return {"type": "integer", "description": description}


def _str(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def _num(description: str) -> dict:
    return {"type": "number", "description": description}


PHASES = ["Pending", "Queued", "Running", "Restarting", "Waiting", "Suspended", "Succeeded",
          "Failed"]


def status_schema() -> dict:
    condition = _obj("A Kubernetes-style condition.", {
        "type": _str("Admitted (by Kueue), Running, Restarting, Suspended, Succeeded, Failed, "
                     "Progressing, PodsScheduled, Degraded, NameConflict, CredentialsMissing or "
                     "PriorityClassMissing."),
        "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _str("CamelCase cause (e.g. NodeFailure, Hang, ApplicationError)."),
        "message": _str("What happened, for people."),
        "lastTransitionTime": _str("When status last changed.", format="date-time"),
        "observedGeneration": _int("metadata.generation the condition was computed from."),
    }, required=["type", "status"])
    restarts = _obj("Restarts so far, by cause. Only `application` counts against "
                    "faultTolerance.maxRestarts.", {
                        "total": _int("Every restart: whole-group restarts and single pods "
                                      "replaced."),
                        "application": _int("Application failures (exit codes 1-127, "
                                            "OOMKilled) and hangs."),
                        "infrastructure": _int("Pod deleted or evicted, killed by a signal "
                                               "(exit >= 128), node failure."),
                        "byCause": {"type": "object", "description": "Counts per cause.",
                                    "additionalProperties": {"type": "integer"}},
                    })
    checkpoint = _obj("Newest committed checkpoint the trainer reported.", {
        "step": _int("Optimizer step of the checkpoint."),
        "uri": _str("Where it is."),
        "time": _str("When it was committed (RFC 3339)."),
    })
    restore = _obj("The trainer's last restore of its state.", {
        "source": _str("Where it read from: memory (each node's own), peer (a replaced node's "
                       "shards from another node's copy), s3 or disk (checkpoint.uri)."),
        "step": _int("The step restored."),
        "seconds": _num("How long the restore took."),
        "time": _str("When it finished (RFC 3339)."),
    })
    straggler = _obj("A rank the trainer reports slower than the others.", {
        "rank": _int("Its rank."), "pod": _str("Its pod."), "node": _str("The pod's node."),
        "ratio": _num("Its own work per step over the other ranks' median (windowed)."),
    })
    pods = _obj("Worker pods of the current generation.", {
        "desired": _int("nodes.max"), "running": _int("Running."), "pending": _int("Pending."),
        "failed": _int("Failed, not yet replaced."), "lost": _int("On a failed node."),
    })
    admission = _obj("Kueue's admission of the job (jobs with the kueue.x-k8s.io/queue-name "
                     "label, while admitted).", {
                         "clusterQueue": _str("The ClusterQueue whose quota the job holds."),
                         "localQueue": _str("The LocalQueue the job was submitted to."),
                         "pods": _int("Pods admitted: nodes.max, or fewer down to nodes.min "
                                      "(partial admission)."),
                     })
    tracking = {"type": "object", "description": "Operator bookkeeping that must survive its "
                "restarts (handled failures, goodput accumulators). Not a user interface.",
                "x-kubernetes-preserve-unknown-fields": True}
    return _obj("Observed state, written by crucible-operator.", {
        "phase": _str("Pending, Queued (waiting for Kueue to admit it), Running, Restarting, "
                      "Waiting (for capacity: fewer than nodes.min pods can be scheduled), "
                      "Suspended, Succeeded or Failed.", enum=PHASES),
        "conditions": {"type": "array", "description": "Kubernetes-style conditions.",
                       "items": condition, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
        "observedGeneration": _int("metadata.generation this status was computed from."),
        "podGeneration": _int("Attempt counter: pods are named <job>-<podGeneration>-<index>; "
                              "a whole-group restart bumps it."),
        "step": _int("Last optimizer step the trainer reported."),
        "tokensSeen": _int("Tokens trained on."),
        "loss": _num("Training loss at `step`."),
        "worldSize": _int("Ranks in the trainer's current rendezvous."),
        "lastProgressTime": _str("When `step` last advanced (from the progress Lease)."),
        "restarts": restarts,
        "lastCheckpoint": checkpoint,
        "lastRestore": restore,
        "stragglers": {"type": "array", "items": straggler,
                       "description": "Ranks reported slow now (empty once none is)."},
        "cordonedNodes": {"type": "array", "items": {"type": "string"},
                          "description": "Nodes this job cordoned after they failed under it."},
        "goodput": _num("Share of wall time (since start, suspended time excluded) that produced "
                        "progress still kept: steps lost to restarts are subtracted."),
        "pods": pods,
        "admission": admission,
        "startTime": _str("When the job first had pods."),
        "completionTime": _str("When it Succeeded or Failed."),
        "message": _str("One line: what the operator is doing and why."),
        "tracking": tracking,
    })


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.loss"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts.total"},
    {"name": "Last-Ckpt", "type": "integer", "jsonPath": ".status.lastCheckpoint.step"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Admitted", "type": "string",
     "jsonPath": ".status.conditions[?(@.type==\"Admitted\")].status", "priority": 1},
    {"name": "Queue", "type": "string", "jsonPath": ".status.admission.clusterQueue",
     "priority": 1},
    {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput", "priority": 1},
    {"name": "Running", "type": "integer", "jsonPath": ".status.pods.running", "priority": 1},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
]


def crd() -> dict:
    root = {
        "type": "object",
        "description": "A pretraining run: elastic torchrun pods that the operator keeps alive "
                       "through pod death, node failure and hangs.",
        "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"},
            "metadata": {"type": "object", "properties": {"name": {
                "type": "string", "maxLength": MAX_JOB_NAME_LENGTH, "pattern": JOB_NAME_PATTERN,
                "description": f"A DNS-1035 label of at most {MAX_JOB_NAME_LENGTH} characters: "
                               "pods are named <name>-<generation>-<index>, a hostname of <= 63."
            }}},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": NAME, "labels": {"app.kubernetes.io/part-of": "crucible"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": SINGULAR, "kind": KIND,
                      "shortNames": SHORT_NAMES, "categories": ["crucible"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": root},
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def render() -> str:
    header = ("# Generated by `crucible-operator crd` from crucible/api/spec.py; do not "
              "edit.\n# tests/operator/test_crd.py fails when this file differs from the "
              "generator.\n")
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)
