"""Stand-in CRDs for prometheus-operator's ServiceMonitor, PodMonitor and PrometheusRule.

The local stack has no prometheus-operator, so the chart's monitoring objects could not reach
the apiserver at all. These CRDs are written here (not copied from prometheus-operator): they
declare only the fields the chart uses, typed as in the monitoring.coreos.com/v1 API reference
(`endpoints[].honorLabels` boolean, `port` string, `interval` a duration, rule `expr`
int-or-string, ...), so a server-side dry run with fieldValidation=Strict refuses a misspelt or
mistyped field. They do not check what they do not declare: the real CRDs are what a kind cluster
with kube-prometheus-stack would check (e2e/kind/). Created only when absent; never deleted (a
cluster-scoped stand-in other runs may be using).
"""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.support.services import Kube, eventually

GROUP = "monitoring.coreos.com"
_STR = {"type": "string"}
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
             "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "properties": {"matchLabels": _STRMAP}}
_NAMESPACES = {"type": "object", "properties": {"any": {"type": "boolean"},
                                                "matchNames": {"type": "array", "items": _STR}}}


def _endpoint() -> dict:
    relabel = {"type": "object", "properties": {
        "sourceLabels": {"type": "array", "items": _STR}, "regex": _STR, "action": _STR}}
    return {"type": "object", "properties": {"port": _STR, "path": _STR, "interval": _DURATION,
                                             "scheme": _STR, "honorLabels": {"type": "boolean"},
                                             "metricRelabelings": {"type": "array",
                                                                   "items": relabel}}}


def _crd(kind: str, plural: str, spec: dict) -> dict:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{GROUP}",
                         "labels": {"crucible.dev/test-stand-in": "true"}},
            "spec": {"group": GROUP, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                               "listKind": f"{kind}List"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                         "openAPIV3Schema": {"type": "object", "properties": {
                             "spec": {"type": "object", "properties": spec}}}}}]}}


RULE = {"type": "object", "properties": {
    "alert": _STR, "record": _STR, "for": _DURATION, "keep_firing_for": _DURATION,
    "expr": {"x-kubernetes-int-or-string": True}, "labels": _STRMAP, "annotations": _STRMAP}}

CRDS = [
    _crd("ServiceMonitor", "servicemonitors", {
        "selector": _SELECTOR, "namespaceSelector": _NAMESPACES, "jobLabel": _STR,
        "endpoints": {"type": "array", "items": _endpoint()}}),
    _crd("PodMonitor", "podmonitors", {
        "selector": _SELECTOR, "namespaceSelector": _NAMESPACES, "jobLabel": _STR,
        "sampleLimit": {"type": "integer"}, "labelLimit": {"type": "integer"},
        "podMetricsEndpoints": {"type": "array", "items": _endpoint()}}),
    _crd("PrometheusRule", "prometheusrules", {
        "groups": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": _STR, "interval": _DURATION, "rules": {"type": "array", "items": RULE}}}}}),
]


def ensure_monitoring_crds(kube: Kube) -> None:
    ext = client.ApiextensionsV1Api(kube.client())
    for doc in CRDS:
        name = doc["metadata"]["name"]
        try:
            ext.create_custom_resource_definition(doc)
        except ApiException as err:
            if err.status != 409:
                raise
            # Left by an earlier run of an older stand-in: brought up to this one's schema.
            current = ext.read_custom_resource_definition(name)
            ext.replace_custom_resource_definition(name, {
                **doc, "metadata": {**doc["metadata"],
                                    "resourceVersion": current.metadata.resource_version}})
        eventually(lambda: any(c.type == "Established" and c.status == "True" for c in
                               ext.read_custom_resource_definition(name).status.conditions or []),
                   30, f"{name} Established")
