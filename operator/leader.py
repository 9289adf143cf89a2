"""Leader election: of several operator replicas, one reconciles; the others wait to take over.

The loop is the `kubernetes` package's own (`kubernetes.leaderelection.LeaderElection`: acquire,
then renew every `retry_period`; expiry judged by when this replica last *saw* the record
change, not by the holder's timestamps, so clocks need not agree). That package ships only a
ConfigMap lock; `LeaseLock` here is the same small interface (get, create, update) over a
coordination.k8s.io Lease, which is what client-go's controllers use and what the operator's
RBAC already grants. `update` is a merge patch carrying the resourceVersion read by `get`, so two
replicas racing for an expired lease cannot both win (the loser gets 409).

Two replicas must never both act, whatever the network does. The package's loop alone does not
promise that: it catches no error but an HTTP answer (a refused connection raises urllib3's
`MaxRetryError`, which ends its thread silently, and the replica goes on acting as leader while
a standby takes the Lease), and it measures its renew deadline between calls that, without a
client timeout, can block forever. So, as controller-runtime's manager does (a lost or
unrenewable Lease ends the process, and the Deployment restarts it as a follower):
- every Lease call has a short deadline (`CALL_TIMEOUT_S`), and any error is a failed attempt;
- `Leadership` holds when the last successful renewal was *sent*; a watchdog thread ends the
  process `RENEW_DEADLINE_SECONDS` after it, whether or not the loop is stuck in a call;
- passes ask `Leadership.acting()` before each write, which is false from that same deadline;
- the election thread ending, for any reason, ends the process.
A standby takes the Lease no sooner than `LEASE_SECONDS` after it last saw it change, which is
after the holder's last successful renewal was sent: the old leader has been gone for
`LEASE_SECONDS - RENEW_DEADLINE_SECONDS` by then. The stop itself cannot hang: the log line
that says why is written with a timer armed to end the process regardless. kopf's peering was
the other candidate; it pauses lower-priority operators but elects no leader (equal priorities
all pause), so it does not give failover.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord

from crucible.operator.apiclient import API_ERRORS, describe

log = logging.getLogger(__name__)

LEASE_NAME = "crucible-operator-leader"
# client-go's defaults (leaderelection.LeaderElectionConfig, as controller-runtime sets them):
# the 5 s between the renew deadline and the lease absorbs a forward step of the standby's
# clock (the package's loop times expiry on the wall clock) and scheduling delays.
LEASE_SECONDS = 15   # a dead leader is replaced this long after its last renewal (+ one retry)
RENEW_DEADLINE_SECONDS = 10  # a leader that has not renewed for this long stops and exits
RETRY_SECONDS = 2
CALL_TIMEOUT_S = (3.0, 4.0)  # (connect, read) per Lease call: an apiserver slow for a moment
#                              fails one attempt, not the leadership
WATCHDOG_PERIOD_S = 0.25


def _micro_time(text: str) -> str:
    """The election loop's `str(datetime)` (naive, local) as a Lease's RFC 3339 MicroTime."""
    when = dt.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.astimezone()  # the loop stamps local time
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Leadership:
    """Whether this replica may act now: it holds the Lease and renewed it within the deadline.

    `renewed_at` is when the last successful write of the Lease was *sent* (monotonic clock):
    the apiserver stored it after that, so the Lease cannot expire for anyone before
    `renewed_at + LEASE_SECONDS`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 deadline_s: float = RENEW_DEADLINE_SECONDS):
        self.clock, self.deadline_s = clock, deadline_s
        self.leading = threading.Event()
        self.renewed_at: float | None = None
        self._callbacks: list[Callable[[], None]] = []

    def renewed(self, sent_at: float) -> None:
        if self.renewed_at is None or sent_at > self.renewed_at:
            self.renewed_at = sent_at

    def won(self) -> None:
        self.leading.set()
        for callback in list(self._callbacks):
            callback()

    def on_leading(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the election thread) once this replica leads."""
        self._callbacks.append(callback)
        if self.leading.is_set():
            callback()

    def expired(self) -> bool:
        """Leading, but the last renewal is older than the deadline: must stop at once."""
        return (self.leading.is_set() and self.renewed_at is not None
                and self.clock() - self.renewed_at >= self.deadline_s)

    def acting(self) -> bool:
        return self.leading.is_set() and not self.expired()


class LeaseLock:
    """The election record in a coordination Lease (spec.holderIdentity and friends). Every
    call has a deadline and every failure, HTTP or connection, is a failed attempt (logged by
    kind, never raised into the election loop)."""

    def __init__(self, api: client.ApiClient, name: str, namespace: str, identity: str,
                 leadership: Leadership | None = None):
        self.leases = client.CoordinationV1Api(api)
        self.name, self.namespace, self.identity = name, namespace, identity
        self.leadership = leadership or Leadership()
        self._version: str | None = None

    def get(self, name: str, namespace: str):
        try:
            lease = self.leases.read_namespaced_lease(name, namespace,
                                                      _request_timeout=CALL_TIMEOUT_S)
        except API_ERRORS as err:
            return False, _Failure(err)
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
        sent = self.leadership.clock()
        try:
            self.leases.create_namespaced_lease(namespace, {
                "metadata": {"name": name, "labels": {"app.kubernetes.io/name":
                                                      "crucible-operator"}},
                "spec": self._spec(election_record)}, _request_timeout=CALL_TIMEOUT_S)
        except API_ERRORS as err:
            log.info("could not create the leader Lease: %s", describe(err))
            return False
        self.leadership.renewed(sent)
        return True

    def update(self, name: str, namespace: str, updated_record: LeaderElectionRecord) -> bool:
        sent = self.leadership.clock()
        try:
            self.leases.patch_namespaced_lease(name, namespace, {
                "metadata": {"resourceVersion": self._version},
                "spec": self._spec(updated_record)}, _request_timeout=CALL_TIMEOUT_S)
        except API_ERRORS as err:
            log.info("could not update the leader Lease: %s", describe(err))
            return False
        self.leadership.renewed(sent)
        return True


class _Failure:
    """A failed `get` as the election loop reads it: `.body` (a JSON status whose `code` says
    whether the Lease is missing) and `.reason`."""

    def __init__(self, err: BaseException):
        status = getattr(err, "status", None) or 0
        self.body = f'{{"code": {int(status)}}}'
        self.reason = describe(err)


class _Election(leaderelection.LeaderElection):
    """The package's loop, with any error in one attempt counted as a failed attempt instead of
    ending the thread (the lock already turns API errors into failures; this catches the rest:
    a malformed record, say)."""

    def try_acquire_or_renew(self):
        try:
            return super().try_acquire_or_renew()
        except Exception as err:  # noqa: BLE001 - any error is a failed attempt, and is logged
            log.warning("leader election attempt failed: %s", describe(err))
            return False


def identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _exit_now() -> None:
    # Exit even if flushing the logs blocks (a stuck stdout): the process must not outlive
    # its leadership.
    threading.Timer(1.0, os._exit, args=(1,)).start()
    logging.shutdown()
    os._exit(1)


def start(api: client.ApiClient, namespace: str, leadership: Leadership,
          exit_process: Callable[[], None] = _exit_now) -> threading.Thread:
    """Campaign in a daemon thread, with a watchdog beside it. `leadership.leading` is set once
    this replica holds the Lease; losing it, failing to renew it within the deadline, or the
    election thread ending for any reason calls `exit_process` (the process's end: the
    Deployment restarts it as a follower)."""
    me = identity()
    done = threading.Event()

    def stop(why: str) -> None:
        if done.is_set():
            return
        done.set()
        leadership.leading.clear()   # passes stop writing before the process is gone
        if exit_process is _exit_now:    # the log line below must not be what keeps us alive
            threading.Timer(1.0, os._exit, args=(1,)).start()
        log.error("%s (Lease %s/%s): exiting so that only the new leader acts", why, namespace,
                  LEASE_NAME)
        exit_process()

    def won() -> None:
        log.info("leading as %s (Lease %s/%s)", me, namespace, LEASE_NAME)
        leadership.won()

    def campaign() -> None:
        try:
            _Election(config).run()
        except BaseException as err:  # noqa: BLE001 - whatever ended it, the process goes
            stop(f"the leader election stopped: {describe(err)}")
            return
        stop("lost the leader Lease")

    def watchdog() -> None:
        while not done.wait(WATCHDOG_PERIOD_S):
            if leadership.expired():
                stop(f"could not renew the leader Lease for {leadership.deadline_s:.0f}s")

    config = electionconfig.Config(LeaseLock(api, LEASE_NAME, namespace, me, leadership),
                                   lease_duration=LEASE_SECONDS,
                                   renew_deadline=RENEW_DEADLINE_SECONDS,
                                   retry_period=RETRY_SECONDS,
                                   onstarted_leading=won,
                                   onstopped_leading=lambda: stop("lost the leader Lease"))
    threading.Thread(target=watchdog, name="crucible-leader-watchdog", daemon=True).start()
    thread = threading.Thread(target=campaign, name="crucible-leader-election", daemon=True)
    thread.start()
    return thread
