"""Leader election: of several operator replicas, one reconciles; the others wait to take over.

The loop is the `kubernetes` package's own (`kubernetes.leaderelection.LeaderElection`: acquire,
then renew every `retry_period`; expiry judged by when this replica last *saw* the record
change, not by the holder's timestamps, so clocks need not agree). That package ships only a
ConfigMap lock; `LeaseLock` here is the same small interface (get, create, update) over a
coordination.k8s.io Lease, which is what client-go's controllers use and what the operator's
RBAC already grants. `update` is a merge patch carrying the resourceVersion read by `get`, so two
replicas racing for an expired lease cannot both win (the loser gets 409).

Losing the lease ends the process (`os._exit`): a replica that cannot renew may be cut off from
the API, and must never go on acting beside a new leader. The Deployment restarts it as a
follower. kopf's peering was the other candidate; it pauses lower-priority operators but elects
no leader (equal priorities all pause), so it does not give failover.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord

log = logging.getLogger(__name__)

LEASE_NAME = "crucible-operator-leader"
LEASE_SECONDS = 10   # a dead leader is replaced this long after its last renewal (+ one retry)
RENEW_DEADLINE_SECONDS = 7
RETRY_SECONDS = 2


def _micro_time(text: str) -> str:
    """The election loop's `str(datetime)` (naive, local) as a Lease's RFC 3339 MicroTime."""
    when = dt.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.astimezone()  # the loop stamps local time
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseLock:
    """The election record in a coordination Lease (spec.holderIdentity and friends)."""

    def __init__(self, api: client.ApiClient, name: str, namespace: str, identity: str):
        self.leases = client.CoordinationV1Api(api)
        self.name, self.namespace, self.identity = name, namespace, identity
        self._version: str | None = None

    def get(self, name: str, namespace: str):
        try:
            lease = self.leases.read_namespaced_lease(name, namespace)
        except ApiException as err:
            return False, err
        self._version = lease.metadata.resource_version
        spec = lease.spec
        if not spec or not spec.holder_identity:
            return True, None
        return True, LeaderElectionRecord(
            spec.holder_identity, str(spec.lease_duration_seconds),
            str(spec.acquire_time), str(spec.renew_time))

    def _spec(self, record: LeaderElectionRecord) -> dict:
        return {"holderIdentity": record.holder_identity,
                "leaseDurationSeconds": int(record.lease_duration),
                "acquireTime": _micro_time(record.acquire_time),
                "renewTime": _micro_time(record.renew_time)}

    def create(self, name: str, namespace: str, election_record: LeaderElectionRecord) -> bool:
        try:
            self.leases.create_namespaced_lease(namespace, {
                "metadata": {"name": name, "labels": {"app.kubernetes.io/name":
                                                      "crucible-operator"}},
                "spec": self._spec(election_record)})
            return True
        except ApiException as err:
            log.info("could not create the leader Lease: HTTP %s", err.status)
            return False

    def update(self, name: str, namespace: str, updated_record: LeaderElectionRecord) -> bool:
        try:
            self.leases.patch_namespaced_lease(name, namespace, {
                "metadata": {"resourceVersion": self._version},
                "spec": self._spec(updated_record)})
            return True
        except ApiException as err:
            log.info("could not update the leader Lease: HTTP %s", err.status)
            return False


def identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def start(api: client.ApiClient, namespace: str, leading: threading.Event) -> threading.Thread:
    """Campaign in a daemon thread; `leading` is set once this replica holds the lease."""
    me = identity()

    def lost() -> None:
        log.error("lost the leader Lease %s/%s: exiting so that only the new leader acts",
                  namespace, LEASE_NAME)
        logging.shutdown()
        os._exit(1)

    def won() -> None:
        log.info("leading as %s (Lease %s/%s)", me, namespace, LEASE_NAME)
        leading.set()

    config = electionconfig.Config(LeaseLock(api, LEASE_NAME, namespace, me),
                                   lease_duration=LEASE_SECONDS,
                                   renew_deadline=RENEW_DEADLINE_SECONDS,
                                   retry_period=RETRY_SECONDS,
                                   onstarted_leading=won, onstopped_leading=lost)
    thread = threading.Thread(target=leaderelection.LeaderElection(config).run,
                              name="crucible-leader-election", daemon=True)
    thread.start()
    return thread
