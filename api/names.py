"""Names: group/version/kind, the one rule for a job's name, and every name derived from it.

Owns what the operator, the trainer, the CRD and `crucible plan --emit-job` must spell the same
way: the resource's identity, the rule a PretrainJob's name follows (the CRD enforces it at
`kubectl apply`, `job_name_problem` everywhere else), the names of the objects a job owns and the
labels and annotation keys on them. Pure strings; no I/O.

Why a job name is a DNS-1035 label of at most 40 characters: worker pods are named
`<job>-<generation>-<index>` and use that as their hostname (a DNS-1123 label, at most 63
characters: Kubernetes docs, "Object Names and IDs"), which leaves 23 characters for two
counters; the job's headless Service is named after the job and a Service name must be a
DNS-1035 label (it starts with a letter).
"""

from __future__ import annotations

import re

GROUP = "crucible.dev"
VERSION = "v1alpha1"
KIND = "PretrainJob"
PLURAL = "pretrainjobs"
SINGULAR = "pretrainjob"
SHORT_NAMES = ["ptj"]
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"

MAX_JOB_NAME_LENGTH = 40
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_JOB_NAME = re.compile(JOB_NAME_PATTERN)

# Labels and annotations on everything a job owns (and on nodes it quarantined).
PREFIX = f"{GROUP}/"
LABEL_JOB = f"{PREFIX}job"
LABEL_GENERATION = f"{PREFIX}generation"
LABEL_INDEX = f"{PREFIX}index"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "crucible-operator"
ANNOTATION_SPEC_HASH = f"{PREFIX}spec-hash"
ANNOTATION_WORKLOAD_DIGEST = f"{PREFIX}workload-digest"


def job_name_problem(name: str) -> str | None:
    """What is wrong with `name` as a PretrainJob's name, or None: the CRD's rule, in words."""
    if not name:
        return "a job name must not be empty"
    if len(name) > MAX_JOB_NAME_LENGTH:
        return (f"job name {name!r} has {len(name)} characters; at most {MAX_JOB_NAME_LENGTH} "
                "(pods are named <job>-<generation>-<index>, a hostname of <= 63)")
    if not _JOB_NAME.match(name):
        return (f"job name {name!r} must be a DNS-1035 label: lowercase letters, digits and '-', "
                "starting with a letter and ending with a letter or digit")
    return None


def pod_name(job: str, generation: int, index: int) -> str:
    return f"{job}-{generation}-{index}"


def service_name(job: str) -> str:
    """The headless Service the pods' hostnames resolve through (`<pod>.<service>`)."""
    return job


def config_map_name(job: str) -> str:
    return f"{job}-config"


def trainer_account_name(job: str) -> str:
    """The ServiceAccount (and its Role and RoleBinding) the worker pods run as."""
    return f"{job}-trainer"


def network_policy_name(job: str) -> str:
    """The NetworkPolicy that fences the job's pods off from everyone but each other."""
    return job


def progress_lease_name(job: str) -> str:
    return f"{job}-progress"


def workload_name(job: str) -> str:
    """The Kueue Workload a queued job is admitted through (`crucible.operator.queueing`). The
    prefix keeps it apart from the Workloads Kueue makes for other kinds in the namespace."""
    return f"pretrainjob-{job}"
