"""Leader election and API deadlines without a cluster: what happens when the apiserver cannot
be reached.

A refused port and a port that accepts and never answers stand in for an apiserver cut off and
one behind a dead load balancer (a real socket each, no mock of our code). The stack tests in
test_leader_election.py run the same with two real replicas.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from kubernetes import client

from crucible.operator import leader
from crucible.operator.apiclient import CONNECTION_ERRORS, TimedApiClient
from tests.support.clock import FakeClock


def _client(port: int, timeout_s=(1.0, 1.0)) -> TimedApiClient:
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    cfg.retries = 0
    return TimedApiClient(cfg, timeout_s)


@pytest.fixture
def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]          # closed again: connecting is refused


@pytest.fixture
def silent_port():
    """Accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for sock in held:
        sock.close()
    listener.close()


def test_every_call_has_a_deadline_even_when_the_server_never_answers(silent_port):
    api = client.CoreV1Api(_client(silent_port, (1.0, 1.0)))
    started = time.monotonic()
    with pytest.raises(CONNECTION_ERRORS):
        api.list_node()
    assert time.monotonic() - started < 5


def test_a_call_that_names_its_own_deadline_keeps_it(silent_port):
    api = client.CoreV1Api(_client(silent_port, (30.0, 30.0)))
    started = time.monotonic()
    with pytest.raises(CONNECTION_ERRORS):
        api.list_node(_request_timeout=(1.0, 1.0))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("port_fixture", ["refused_port", "silent_port"])
def test_the_lease_lock_turns_any_connection_failure_into_a_failed_attempt(port_fixture, request):
    port = request.getfixturevalue(port_fixture)
    lock = leader.LeaseLock(_client(port), leader.LEASE_NAME, "ns", "me")
    record = leader.LeaderElectionRecord("me", "10", "2026-01-01 00:00:00",
                                         "2026-01-01 00:00:00")
    started = time.monotonic()
    found, failure = lock.get(leader.LEASE_NAME, "ns")
    assert found is False
    # What the election loop reads of a failed get: a code that is not 404 (so it does not try
    # to create the Lease) and a reason.
    assert json.loads(failure.body)["code"] != 404 and failure.reason
    assert lock.create(leader.LEASE_NAME, "ns", record) is False
    assert lock.update(leader.LEASE_NAME, "ns", record) is False
    assert lock.leadership.renewed_at is None            # nothing was renewed
    assert time.monotonic() - started < 3 * sum(leader.CALL_TIMEOUT_S) + 3


def test_leadership_ends_at_the_renew_deadline_counted_from_the_last_renewal_sent():
    clock = FakeClock(100.0)
    leadership = leader.Leadership(clock, deadline_s=7)
    assert not leadership.acting()          # not leading yet
    leadership.renewed(clock.now)
    leadership.won()
    assert leadership.acting() and not leadership.expired()
    clock.now += 6.9
    assert leadership.acting()
    leadership.renewed(clock.now - 10)      # an older send landing late moves nothing
    clock.now += 0.1
    assert leadership.expired() and not leadership.acting()
    leadership.renewed(clock.now)
    assert leadership.acting()


def test_a_leader_that_cannot_renew_is_stopped_by_the_watchdog(refused_port):
    """The election loop is stuck failing against a refused port: the watchdog ends the
    process (here: the injected exit) once the last renewal is older than the deadline, and
    passes stop acting first."""
    clock = FakeClock(100.0)
    leadership = leader.Leadership(clock, deadline_s=7)
    exited = threading.Event()
    acting_at_exit = []

    def exit_process():
        acting_at_exit.append(leadership.acting())
        exited.set()

    leadership.renewed(clock.now)
    leadership.won()
    leader.start(_client(refused_port), "ns", leadership, exit_process=exit_process)
    time.sleep(3 * leader.WATCHDOG_PERIOD_S)
    assert not exited.is_set()               # within the deadline: still leading
    clock.now += 7
    assert exited.wait(5), "the watchdog did not stop a leader past its renew deadline"
    assert acting_at_exit == [False]
    assert not leadership.leading.is_set()


def test_on_leading_callbacks_run_once_leading_and_at_once_when_registered_late():
    leadership = leader.Leadership()
    calls = []
    leadership.on_leading(lambda: calls.append("early"))
    assert calls == []
    leadership.won()
    leadership.on_leading(lambda: calls.append("late"))
    assert calls == ["early", "late"]
