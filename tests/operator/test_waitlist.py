"""The waitlist: room that frees up goes to the jobs waiting longest, as many as it holds.

Pure (waitlist.grants over node rooms parsed from raw Node objects, as the apiserver writes
them) plus the operator's book of room, fed as its watches feed it.
"""

from __future__ import annotations

from crucible.operator import waitlist as w
from tests.operator import builders as b

GPU = "nvidia.com/gpu"


def _node(name: str, gpus: int = 8, *, ready: str = "True", cordoned: bool = False,
          labels: dict | None = None, taints: list[dict] | None = None):
    return w.node_room({"metadata": {"name": name, "labels": labels or {}},
                        "spec": {"unschedulable": cordoned, "taints": taints or []},
                        "status": {"allocatable": {"cpu": "64", GPU: str(gpus)},
                                   "conditions": [{"type": "Ready", "status": ready}]}})


def _waiter(name: str, since: float, pods: int = 2, gpus: int = 8, **kw) -> w.Waiter:
    return w.Waiter(key=("ns", name), since=b.at(since), pods=pods, per_pod={GPU: gpus}, **kw)


def _free(nodes: dict) -> dict:
    return {name: dict(node.allocatable) for name, node in nodes.items()}


def test_room_goes_to_the_job_waiting_longest_and_only_as_many_as_fit():
    nodes = {f"n{i}": _node(f"n{i}") for i in range(3)}      # 3 whole nodes
    waiters = [_waiter("young", 300), _waiter("old", 100), _waiter("middle", 200)]
    assert w.grants(waiters, _free(nodes), nodes) == [("ns", "old")]   # 2 of 3 nodes; 1 left


def test_nobody_jumps_a_job_that_does_not_fit_yet():
    """A big gang first in line is not starved by a stream of small jobs behind it."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(4)}
    waiters = [_waiter("big", 100, pods=4), _waiter("small", 200, pods=1)]
    busy = {**_free(nodes), "n3": {GPU: 0}}           # a running job holds one node
    assert w.grants(waiters, busy, nodes) == []
    assert w.grants(waiters, _free(nodes), nodes) == [("ns", "big")]


def test_a_gang_no_cluster_could_hold_holds_nobody_up():
    """Larger than every node it may use put together (or a selector no node matches): it
    waits on its timer, and those behind it are served."""
    nodes = {f"n{i}": _node(f"n{i}") for i in range(3)}
    waiters = [_waiter("huge", 100, pods=4), _waiter("nowhere", 150, pods=1,
                                                     node_selector={"pool": "absent"}),
               _waiter("small", 200, pods=1)]
    assert not w.could_fit(waiters[0], nodes) and not w.could_fit(waiters[1], nodes)
    assert w.grants(waiters, _free(nodes), nodes) == [("ns", "small")]


def test_a_taint_named_after_the_resource_the_pods_ask_for_is_theirs():
    """GKE and AKS taint GPU nodes `nvidia.com/gpu`; the ExtendedResourceToleration admission
    plugin gives pods that ask for GPUs the toleration, so their spec never names it."""
    taint = {"key": GPU, "value": "present", "effect": "NoSchedule"}
    nodes = {f"n{i}": _node(f"n{i}", taints=[taint]) for i in range(2)}
    assert w.grants([_waiter("gpu", 1)], _free(nodes), nodes) == [("ns", "gpu")]


def test_higher_priority_first_then_age():
    nodes = {f"n{i}": _node(f"n{i}") for i in range(2)}
    waiters = [_waiter("old", 100), _waiter("urgent", 500, priority=1000)]
    assert w.grants(waiters, _free(nodes), nodes) == [("ns", "urgent")]


def test_pods_share_a_node_when_its_room_holds_several():
    nodes = {"n0": _node("n0", gpus=8)}
    assert w.grants([_waiter("a", 1, pods=4, gpus=2)], _free(nodes), nodes) == [("ns", "a")]
    assert w.grants([_waiter("a", 1, pods=5, gpus=2)], _free(nodes), nodes) == []


def test_nodes_the_job_cannot_use_hold_no_room_for_it():
    taint = {"key": "dedicated", "value": "infer", "effect": "NoSchedule"}
    nodes = {"down": _node("down", ready="Unknown"), "cordoned": _node("cordoned", cordoned=True),
             "tainted": _node("tainted", taints=[taint]),
             "other-pool": _node("other-pool", labels={"pool": "b"}),
             "ok": _node("ok", labels={"pool": "a"})}
    picky = _waiter("picky", 1, pods=2, node_selector={"pool": "a"})
    assert w.grants([picky], _free(nodes), nodes) == []
    tolerant = _waiter("tolerant", 1, pods=2, tolerations=(
        {"key": "dedicated", "operator": "Equal", "value": "infer", "effect": "NoSchedule"},))
    assert w.grants([tolerant], _free(nodes), nodes) == [("ns", "tolerant")]   # ok + tainted
    # Three pods need the tainted node too (ok and other-pool hold two).
    wrong_value = _waiter("wrong", 1, pods=3, tolerations=(
        {"key": "dedicated", "value": "train"},))
    assert w.grants([wrong_value], _free(nodes), nodes) == []
    right_value = _waiter("right", 1, pods=3, tolerations=(
        {"key": "dedicated", "value": "infer"},))
    assert w.grants([right_value], _free(nodes), nodes) == [("ns", "right")]
    assert w.tolerates([{"operator": "Exists"}], ("any", "", "NoExecute"))


def test_the_book_counts_the_operators_active_pods_and_says_when_room_comes_back():
    book = w.RoomBook()
    assert book.set_node("n0", _node("n0")) is True             # a node with room joined
    assert book.set_node("n0", _node("n0")) is False            # the same again: nothing new
    job = ("ns", "a")
    assert book.set_pod("u1", job, "n0", {GPU: 6}, active=True) is False
    assert book.free() == {"n0": {GPU: 2}}
    version = book.version
    assert book.set_pod("u1", job, "n0", {GPU: 6}, active=True) is False
    assert book.version == version                              # unchanged: no new version
    assert book.set_pod("u1", job, "n0", {GPU: 6}, active=False) is True   # terminated
    assert book.free() == {"n0": {GPU: 8}}
    book.set_pod("u2", job, "n0", {GPU: 8}, active=True)
    assert book.sync_job(job, ["u1"]) is True                   # u2 deleted unseen
    assert book.free() == {"n0": {GPU: 8}}
    assert book.set_node("n0", _node("n0", ready="Unknown")) is False
    assert book.free() == {}
    assert book.set_node("n0", _node("n0")) is True             # back: room again
    book.set_node("n0", None)
    assert book.free() == {}


def test_a_job_that_asks_for_no_extended_resource_is_not_on_the_list():
    obs = b.observed()
    hold = {"since": b.ts(100)}
    assert w.waiter(("ns", "cpu"), b.spec_doc(resources={"limits": {"cpu": "4"}}), hold,
                    obs) is None
    gpu = w.waiter(("ns", "gpu"), b.spec_doc(), hold, obs)
    assert gpu.per_pod == {GPU: 8} and gpu.pods == 2 and gpu.since == b.at(100)


def test_a_granted_job_keeps_its_room_until_its_pods_have_nodes_and_a_suspended_one_leaves():
    """The handlers' bookkeeping (`handlers._enlist`): a grant reserves the job's place (and so
    the room it was granted) until nodes.min of its pods are bound, or the same GPUs would be
    granted to the next job too; a job that stops waiting for any other reason leaves."""
    import dataclasses
    from types import SimpleNamespace

    from crucible.operator.handlers import _enlist

    memo = SimpleNamespace(waitlist={}, waitlist_version=0, reserved={})
    key, job = (b.NS, b.JOB), b.job()
    hold = {"capacityHold": {"since": b.ts(100)}}
    _enlist(memo, key, job, {"phase": "Waiting", "podGeneration": 1, "tracking": hold},
            b.observed())
    assert key in memo.waitlist
    granted = dataclasses.replace(b.observed(), capacity_granted=True)
    # The pass that took the grant ends the hold and makes pod 0: phase Pending.
    _enlist(memo, key, job, {"phase": "Pending", "podGeneration": 1, "tracking": {}}, granted)
    assert key in memo.waitlist and key in memo.reserved        # its pods have no node yet
    bound = b.observed([b.pod(1, 0, node="gpu-node-0"), b.pod(1, 1, node="gpu-node-1")])
    _enlist(memo, key, job, {"phase": "Pending", "podGeneration": 1, "tracking": {}}, bound)
    assert key not in memo.waitlist and key not in memo.reserved
    # Suspended while holding: off the list, though the hold is still in its status.
    _enlist(memo, key, job, {"phase": "Waiting", "podGeneration": 1, "tracking": hold},
            b.observed())
    _enlist(memo, key, job, {"phase": "Suspended", "podGeneration": 1, "tracking": hold},
            b.observed())
    assert key not in memo.waitlist


def test_room_for_a_gang_counts_unbound_pods_and_other_jobs_claims():
    book = w.RoomBook()
    for i in range(2):
        book.set_node(f"n{i}", _node(f"n{i}"))            # 16 GPUs
    gang = _waiter("a", 0, pods=2)                       # 2 x 8
    assert book.room_for(gang)
    book.claim(("ns", "other"), {GPU: 8}, 1)             # a pass just made a pod of 8
    assert not book.room_for(gang)
    book.unclaim(("ns", "other"))
    book.set_pod("u1", ("ns", "other"), None, {GPU: 8}, active=True)   # created, unbound
    assert not book.room_for(gang)
    assert book.room_for(_waiter("b", 0, pods=1))
    book.claim(("ns", "a"), {GPU: 8}, 2)                 # its own claim is no obstacle
    book.set_pod("u1", ("ns", "other"), None, {GPU: 8}, active=False)
    assert book.room_for(gang)


def test_a_gang_with_room_is_created_at_once_and_without_it_pod_0_first():
    import dataclasses

    from crucible.operator.decision import decide

    obs = b.observed(children=None)
    first = decide(b.job(), obs, b.at(0))
    assert [a.name for a in first.actions if a.verb == "create" and a.kind == "Pod"] == \
        ["gpt-0-0"]
    roomy = decide(b.job(), dataclasses.replace(obs, room_for_gang=True), b.at(0))
    assert [a.name for a in roomy.actions if a.verb == "create" and a.kind == "Pod"] == \
        [f"gpt-0-{i}" for i in range(4)]


def test_a_new_job_waits_behind_the_waitlist_unless_the_room_left_after_it_holds_it():
    """`handlers._queued_behind`: a job arriving just as room frees must not take it from the
    jobs that released their pods and wait for it (a steady stream of new jobs would starve
    them); it joins the list's end unless the room left after them holds it too."""
    from types import SimpleNamespace

    from crucible.operator.handlers import _queued_behind

    memo = SimpleNamespace(waitlist={}, reserved={}, book=w.RoomBook())
    for i in range(3):
        memo.book.set_node(f"n{i}", _node(f"n{i}"))      # 3 whole nodes
    key, job, obs = (b.NS, b.JOB), b.job(), b.observed()
    assert _queued_behind(memo, key, job, obs, None).queued_behind is None   # nobody waits
    memo.waitlist[("ns", "old")] = _waiter("old", 100)   # 2 whole nodes: 1 is left
    behind = _queued_behind(memo, key, job, obs, None).queued_behind
    assert behind and "1 job(s)" in behind               # the new job needs 2
    memo.book.set_node("n3", _node("n3"))                # now the room left holds it too
    assert _queued_behind(memo, key, job, obs, None).queued_behind is None
    memo.book.set_node("n3", None)
    # Never a job Kueue queues, one with pods (a running job's restart), or one on the list.
    assert _queued_behind(memo, key, job, obs, "team-queue").queued_behind is None
    assert _queued_behind(memo, key, job, b.observed([b.pod(0, 0, node="n0")]),
                          None).queued_behind is None
    memo.reserved[key] = 0.0
    assert _queued_behind(memo, key, job, obs, None).queued_behind is None


def test_a_job_stuck_at_the_head_keeps_what_it_could_use_and_jobs_elsewhere_go_past():
    nodes = {"a0": _node("a0", labels={"pool": "a"}), "b0": _node("b0", labels={"pool": "b"})}
    free = _free(nodes)
    free["a0"][GPU] = 0                                   # pool a is full
    head = _waiter("head", 100, pods=1, node_selector={"pool": "a"})
    other_pool = _waiter("b", 200, pods=1, node_selector={"pool": "b"})
    same_pool = _waiter("a", 300, pods=1, node_selector={"pool": "a"})
    anywhere = _waiter("any", 400, pods=1)
    assert w.grants([head, other_pool], free, nodes) == [("ns", "b")]
    assert w.grants([head, same_pool], free, nodes) == []
    # Pool b's room is open to a job that may use either pool: it takes none of a's.
    assert w.grants([head, anywhere], free, nodes) == [("ns", "any")]
    free["a0"][GPU] = 8                                   # a0 frees: the head first
    assert w.grants([head, same_pool, anywhere], free, nodes) == [("ns", "head"), ("ns", "any")]


def test_room_after_pending_takes_unbound_pods_and_other_claims_away():
    book = w.RoomBook()
    for i in range(3):
        book.set_node(f"n{i}", _node(f"n{i}"))           # 24 GPUs
    book.set_pod("u1", ("ns", "x"), None, {GPU: 8}, active=True)       # created, unbound
    book.claim(("ns", "y"), {GPU: 8}, 1)
    book.claim(("ns", "me"), {GPU: 8}, 1)
    left = book.free_after_pending(exclude=[("ns", "me")])
    assert sum(room[GPU] for room in left.values()) == 8


def test_a_burst_of_new_jobs_and_an_elastic_one_do_not_take_the_waiting_jobs_room():
    from types import SimpleNamespace

    from crucible.operator.handlers import _queued_behind, _room_for_gang

    memo = SimpleNamespace(waitlist={}, reserved={}, book=w.RoomBook())
    for i in range(5):
        memo.book.set_node(f"n{i}", _node(f"n{i}"))      # 5 whole nodes
    memo.waitlist[("ns", "old")] = _waiter("old", 100, pods=3)        # 3 of them
    first, job = (b.NS, "first"), b.job()                # 2 pods of 8: fits after "old"
    assert _queued_behind(memo, first, job, b.observed(), None).queued_behind is None
    memo.book.claim(first, {GPU: 8}, 2)                  # its pass claimed the 2 nodes left
    assert _queued_behind(memo, (b.NS, "second"), job, b.observed(),
                          None).queued_behind                          # nothing left for it
    memo.book.unclaim(first)
    # nodes.min 2 fits after "old", nodes.max 4 does not: pod 0 first, not all 4 at once.
    elastic = b.job(nodes={"min": 2, "max": 4})
    obs = _queued_behind(memo, (b.NS, b.JOB), elastic, b.observed(), None)
    assert obs.queued_behind is None
    assert not _room_for_gang(memo, (b.NS, b.JOB), elastic, obs, None).room_for_gang


def test_room_a_pod_on_its_way_will_take_is_not_granted_again():
    """`handlers._grant`: a running job's replacement pod (made, not yet bound) will take its
    room; granting that room to a waiting job would send it after GPUs it loses the race for
    (then it releases again). A waiting job's own pods are its gang, placed once."""
    from types import SimpleNamespace

    from crucible.operator.handlers import _grant

    memo = SimpleNamespace(book=w.RoomBook(), waitlist={}, waitlist_version=0,
                           grants=(None, frozenset()), wakeups={})
    for i in range(2):
        memo.book.set_node(f"n{i}", _node(f"n{i}"))      # 16 GPUs
    memo.waitlist[("ns", "w")] = _waiter("w", 100, pods=2)
    assert _grant(memo) == {("ns", "w")}
    memo.book.set_pod("r", ("ns", "running"), None, {GPU: 8}, active=True)
    assert _grant(memo) == frozenset()
    memo.book.set_pod("r", ("ns", "running"), None, {GPU: 8}, active=False)
    memo.book.set_pod("own", ("ns", "w"), None, {GPU: 8}, active=True)   # its gang, on its way
    assert _grant(memo) == {("ns", "w")}


def test_a_pod_being_deleted_holds_its_room_until_it_is_gone():
    """The pod index (`handlers.pods_by_job`) and the housekeeping (`handlers._forget_gone`): the
    scheduler counts a Terminating pod until the object is removed, so its room is granted only
    then, also for the pods of a deleted job (no loop of its own any more)."""
    import asyncio

    from crucible.operator.handlers import _forget_gone, pods_by_job
    from crucible.operator.observed import pod_view
    from tests.operator.passes import pass_memo

    memo = pass_memo(None)
    try:
        memo.book.set_node("gpu-node-0", _node("gpu-node-0"))          # 8 GPUs
        memo.waitlist[("ns", "w")] = _waiter("w", 100, pods=1)
        body = b.pod_body(0, 0, deletion=5)
        body["spec"]["containers"] = [{"name": "trainer",
                                       "resources": {"limits": {GPU: "8"}}}]
        key = (b.NS, b.JOB)
        index: dict = {key: [pod_view(body)]}
        asyncio.run(pods_by_job(namespace=b.NS, labels=body["metadata"]["labels"], body=body,
                                memo=memo, pods_by_job=index))
        assert memo.book.free()["gpu-node-0"][GPU] == 0       # Terminating: still holds it
        _forget_gone(memo)                                    # its job has no loop; pod still there
        assert memo.book.free()["gpu-node-0"][GPU] == 0
        index[key] = []                                       # the pod is gone
        _forget_gone(memo)
        assert memo.book.free()["gpu-node-0"][GPU] == 8
        assert memo.grants[1] == {("ns", "w")}
    finally:
        memo.executor.shutdown(wait=False)
        memo.kube.events.shutdown(wait=False)
