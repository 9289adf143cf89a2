"""Failure classification: what went wrong with a pod or a node, and whether it was our fault.

Owns the rules that decide which restarts spend the job's budget. The split follows Kubeflow's
`ExitCode` restart policy (exit codes 1-127 come from the program and are permanent; 128-255 mean
the process was killed by signal `code - 128` and are retryable: kubeflow/trainer release-1.9
`pkg/util/train/train_util.go IsRetryableExitCode`) and JobSet's documented pattern of not
counting disruptions (`DisruptionTarget`) against `maxRestarts`
(jobset/site/static/examples/failure-policy/host-maintenance-event-model.yaml):

  infrastructure (retried, not counted): pod deleted (whatever it exited with once its deletion
      was asked for), evicted or disrupted (preemption, taint manager, Eviction API, node
      shutdown), killed by a signal (exit >= 128), an exit code the user listed in
      retryableExitCodes, a failed node;
  application (counted against faultTolerance.maxRestarts): exit codes 1-127, hangs, and
      OOMKilled: the container outgrew the memory limit the spec gave it, which no retry fixes
      (a node short of memory evicts instead: `Evicted`, infrastructure). Counted, an OOM loop
      ends (the budget, and maxRestartsWithoutProgress when it dies before a step); uncounted,
      one below maxInfrastructureRestarts per window restarted forever. Listing its exit code
      (137) in retryableExitCodes makes it infrastructure again.

Pure functions of the records in `observed.py` and the job spec; "now" is a parameter.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from crucible.api.launch import STORAGE_UNAVAILABLE
from crucible.api.spec import FaultToleranceSpec
from crucible.operator.observed import UNREACHABLE_TAINTS, NodeView, PodView

INFRASTRUCTURE = "infrastructure"
APPLICATION = "application"

# Container waiting reasons that will not fix themselves: after pendingTimeoutSeconds they fail
# the job instead of leaving it Pending forever (kubeflow/trainer#2001, #1282).
HOPELESS_WAITING = {
    "ErrImagePull": "ImagePullFailed", "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed", "ErrImageNeverPull": "ImagePullFailed",
    "CreateContainerConfigError": "ContainerConfigError",
    "CreateContainerError": "ContainerConfigError",
}


@dataclass(frozen=True)
class Failure:
    cause: str       # CamelCase, becomes a status counter key, event reason and metric label
    kind: str        # INFRASTRUCTURE or APPLICATION
    message: str
    node: str | None = None   # the failed node, for a node's failure (loops are counted per node)

    @property
    def counted(self) -> bool:
        return self.kind == APPLICATION


def pod_failure(pod: PodView, ft: FaultToleranceSpec, *,
                store_answered: bool = False) -> Failure | None:
    """Why a pod in phase Failed failed; None for a pod that has not failed. `store_answered`:
    the job has committed a checkpoint, so its storage settings have worked."""
    if pod.phase != "Failed":
        return None
    where = f"pod {pod.name}" + (f" on {pod.node}" if pod.node else "")
    if pod.reason == "Evicted":
        return Failure("Evicted", INFRASTRUCTURE,
                       f"{where} was evicted: {pod.message or ''}".strip())
    if pod.disruption:
        return Failure("Disrupted", INFRASTRUCTURE, f"{where} was disrupted ({pod.disruption})")
    code = pod.exit_code
    if pod.ended_by_deletion:
        # torchrun turns the kubelet's SIGTERM into an exception and exits 1, which would
        # otherwise read as the program failing (torch.distributed.elastic SignalException).
        # An OOM kill after the deletion (a checkpoint saved on SIGTERM) is the deletion's too.
        return Failure("PodDeleted", INFRASTRUCTURE, f"{where} was deleted" + (
            f" (its exit code {code} is torchrun's answer to SIGTERM)" if code else ""))
    if pod.terminated_reason == "OOMKilled" and code not in ft.retryable_exit_codes:
        return Failure("OOMKilled", APPLICATION, f"{where} ran out of memory (OOMKilled: it used "
                       "more than its memory limit)")
    if code is None:
        return Failure("PodFailed", INFRASTRUCTURE,
                       f"{where} failed without an exit code ({pod.reason or 'no reason given'})")
    if code >= 128:
        return Failure("Signal", INFRASTRUCTURE,
                       f"{where} was killed by signal {code - 128} (exit code {code})")
    if code in ft.retryable_exit_codes:
        return Failure("RetryableExitCode", INFRASTRUCTURE,
                       f"{where} exited with {code}, listed in retryableExitCodes")
    if code == 0:
        return None  # phase Failed with exit 0: another container failed; not ours to judge
    message = (pod.terminated_message or "").strip()
    if message.startswith(f"{STORAGE_UNAVAILABLE}:"):
        # The trainer's checkpoint store did not answer through its retries: an outage of a
        # service the job depends on, not the job's fault, once the job has committed there
        # (its endpoint and network have worked). Before that it is as likely a wrong endpoint
        # or a blocked egress, which no restart fixes: counted, so such a job fails rather than
        # restarting for ever. A tenant's own code writes this message, so it can only spare
        # its own job's budget, as retryableExitCodes can.
        why = message[len(STORAGE_UNAVAILABLE) + 1:].strip()[:200]
        said = f"{where} stopped: its checkpoint storage did not answer ({why})"
        if store_answered:
            return Failure(STORAGE_UNAVAILABLE, INFRASTRUCTURE, said)
        return Failure(STORAGE_UNAVAILABLE, APPLICATION, said + "; counted: the job has no "
                       "commit there yet, so check checkpoint.uri, AWS_ENDPOINT_URL and egress")
    detail = f": {pod.terminated_message.strip()[:200]}" if pod.terminated_message else ""
    return Failure("ApplicationError", APPLICATION, f"{where} exited with {code}{detail}")


def deleted_failure(pod: PodView) -> Failure:
    """A pod of the current generation that someone else deleted (or the taint manager evicted)."""
    how = f" ({pod.disruption})" if pod.disruption else ""
    return Failure("PodDeleted", INFRASTRUCTURE, f"pod {pod.name} was deleted{how}")


def vanished_failure(name: str) -> Failure:
    return Failure("PodDeleted", INFRASTRUCTURE, f"pod {name} disappeared")


@dataclass(frozen=True)
class NodeFailure:
    node: str
    reason: str                 # NodeNotReady, NodeUnreachable, NodeDeleted, or Node<Condition>
    message: str
    since: dt.datetime | None   # when it started (condition transition or taint time)

    def age_s(self, now: dt.datetime) -> float:
        return (now - self.since).total_seconds() if self.since else float("inf")


def node_failure(name: str, node: NodeView | None, ft: FaultToleranceSpec,
                 allowed: frozenset[str] | None = None) -> NodeFailure | None:
    """Whether a node is broken: NotReady/Unknown, tainted unreachable, gone, or a condition the
    job names (node-problem-detector, GPU health checkers) and the operator allows (`allowed`;
    None: any) is True."""
    if node is None:
        return NodeFailure(name, "NodeDeleted", f"node {name} no longer exists", None)
    ready = node.condition("Ready")
    if ready is not None and ready.status != "True":
        reason = "NodeUnreachable" if ready.status == "Unknown" else "NodeNotReady"
        detail = ready.message or ready.reason or f"Ready={ready.status}"
        return NodeFailure(name, reason, f"node {name} is {reason[4:]}: {detail}", ready.since)
    for key, effect, since in node.taints if ready is None else ():
        # Only when the node has no Ready condition at all: on a node that is Ready again the
        # taint is the node controller's leftover for a few seconds, and the scheduler already
        # places pods there (they tolerate it for 300 s); judged by it, a pod just placed on a
        # returned node would be failed at once, dated from the old outage.
        if key in UNREACHABLE_TAINTS and effect == "NoExecute":
            return NodeFailure(name, "NodeUnreachable", f"node {name} is tainted {key}", since)
    for cond in node.conditions:
        if (cond.type in ft.node_failure_conditions and cond.status == "True"
                and (allowed is None or cond.type in allowed)):
            detail = cond.message or cond.reason
            said = f"node {name} reports {cond.type}" + (f": {detail}" if detail else "")
            return NodeFailure(name, f"Node{cond.type}", said, cond.since)
    return None


def stuck_terminating(pod: PodView, ft: FaultToleranceSpec, now: dt.datetime) -> bool:
    """Terminating for longer than its grace period plus terminatingTimeoutSeconds.

    deletionTimestamp is already the end of the grace period (request time + grace).
    """
    return (pod.deletion is not None
            and (now - pod.deletion).total_seconds() >= ft.terminating_timeout_seconds)


# How long a pod of a deleted job may stay Terminating past its grace before the operator
# force-deletes it: a live job's default terminatingTimeoutSeconds.
ORPHAN_TERMINATING_S = FaultToleranceSpec.model_fields["terminating_timeout_seconds"].default


def orphan_stuck(pod: PodView, now: dt.datetime) -> bool:
    """A pod no live job owns, Terminating ORPHAN_TERMINATING_S past its grace (its node is
    gone or dead: nothing else will ever end it)."""
    return (pod.deletion is not None
            and (now - pod.deletion).total_seconds() >= ORPHAN_TERMINATING_S)


@dataclass(frozen=True)
class PendingProblem:
    reason: str      # Unschedulable, ImagePullFailed, ContainerConfigError
    message: str
    hopeless: bool   # True: will not fix itself (fails the job after the timeout)


# The kubelet's message when a pod's env names a Secret that does not exist (pkg/kubelet
# kubelet_pods.go, makeEnvironmentVariables: `secret "NAME" not found`).
MISSING_SECRET = re.compile(r'secret "([^"]+)" not found')


def missing_secret(pod: PodView) -> str | None:
    """The Secret a Pending pod cannot start without, as its kubelet reports it. The operator
    holds no right on Secrets (it could read every tenant's keys), so the kubelet, which does,
    is the one who can say."""
    if pod.waiting_reason != "CreateContainerConfigError":
        return None
    found = MISSING_SECRET.search(pod.waiting_message or "")
    return found.group(1) if found else None


def pending_problem(pod: PodView) -> PendingProblem | None:
    if pod.phase != "Pending" or pod.deleting:
        return None
    secret = missing_secret(pod)
    if secret is not None:
        return PendingProblem("CredentialsMissing", f"pod {pod.name}: Secret {secret} does not "
                              "exist: create it in this namespace (checkpoint.credentialsSecret, "
                              "checkpoint.signingKeySecret)", True)
    if pod.waiting_reason in HOPELESS_WAITING:
        return PendingProblem(HOPELESS_WAITING[pod.waiting_reason],
                              f"pod {pod.name}: {pod.waiting_reason}: {pod.waiting_message or ''}"
                              .strip(), True)
    if pod.unschedulable:
        return PendingProblem("Unschedulable", f"pod {pod.name}: {pod.unschedulable}", False)
    return None


def pending_too_long(pod: PodView, ft: FaultToleranceSpec, now: dt.datetime) -> bool:
    return (pod.created is not None
            and (now - pod.created).total_seconds() >= ft.pending_timeout_seconds)
