"""decide() over a long run: failures the cluster causes never add up to a failed job, and a
program that crash-loops always does.

Pure scenarios (no cluster, no clock), as in test_decision.py:
- a pool short once: the shortage is forgotten as soon as nodes.min pods hold a node, so a
  crash loop afterwards spends the budget instead of reading as a capacity wait forever;
- a peer lost to the cluster costs the survivors one of torchrun's in-pod restarts; their exit
  within the window after it is that loss's (one exit per loss), and restarts uncounted; the
  lost pod's replacement is no survivor of it;
- a peer's node found dead soon after an exit: the exit is recounted as that node's failure;
- node failures count toward an infrastructure loop per node: twenty nodes failing one after
  another are no loop, one node failing ten times is.
"""

from __future__ import annotations

from crucible.operator import manifests as m
from crucible.operator.decision import decide
from crucible.operator.failure_policy import PEER_LOSS_WINDOW_S
from tests.operator import builders as b
from tests.operator.test_decision import cond, reasons, running_status

NO_GPU = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
SPEC = {"nodes": {"min": 2, "max": 2},
        "faultTolerance": {"maxRestarts": 3, "nodeFailureGraceSeconds": 10,
                           "maxRestartsWithoutProgress": 10}}
H = m.spec_hash(b.spec(**SPEC))


def _decide(status, pods, t, nodes=None, **spec):
    return decide(b.job(status=status, **{**SPEC, **spec}),
                  b.observed(pods, nodes=nodes if nodes is not None else b.healthy_nodes()),
                  b.at(t))


def _crash(gen: int, t: float) -> list:
    """Both pods of the generation bound; pod 1 exited 1 (the program)."""
    return [b.pod(gen, 0, node="gpu-node-0", spec_hash=H),
            b.pod(gen, 1, node="gpu-node-1", spec_hash=H, phase="Failed", exit_code=1,
                  finished=t - 1)]


def test_a_crash_loop_in_a_pool_that_was_short_once_ends_failed_within_its_budget():
    # Generation 0 waits for a GPU for pod 1: the shortage is remembered.
    short = [b.pod(0, 0, node="gpu-node-0", spec_hash=H),
             b.pod(0, 1, phase="Pending", node=None, spec_hash=H, unschedulable=NO_GPU)]
    status = _decide({"podGeneration": 0}, short, 10).status
    assert status["tracking"]["capacityShort"]["generation"] == 0
    # The GPU frees up: both pods hold a node (still Pending): the shortage is forgotten...
    bound = [b.pod(0, 0, node="gpu-node-0", spec_hash=H),
             b.pod(0, 1, phase="Pending", node="gpu-node-1", spec_hash=H)]
    status = _decide(status, bound, 20).status
    assert "capacityShort" not in status["tracking"]
    # ...so every crash from now on is the program's: the budget (3) ends it on the 4th.
    t = 30
    for gen in range(4):
        out = _decide(status, _crash(gen, t), t)
        status = out.status
        t += 30
    assert status["phase"] == "Failed", status["phase"]
    assert cond(out, "Failed")["reason"] == "RestartBudgetExhausted"
    assert status["restarts"]["application"] == 3
    assert "InsufficientCapacity" not in status["restarts"]["byCause"]


def test_survivors_that_exit_before_nodes_min_pods_ever_held_a_node_are_not_counted():
    """The shortage's own reason to be remembered: pod 0 gives up on the rendezvous, its GPU
    frees up and pod 1 is bound at once; the pass that sees the exit sees no shortage."""
    short = [b.pod(0, 0, node="gpu-node-0", spec_hash=H),
             b.pod(0, 1, phase="Pending", node=None, spec_hash=H, unschedulable=NO_GPU)]
    status = _decide({"podGeneration": 0}, short, 10).status
    after = [b.pod(0, 0, node="gpu-node-0", spec_hash=H, phase="Failed", exit_code=1,
                   finished=600),
             b.pod(0, 1, phase="Pending", node="gpu-node-0", spec_hash=H)]
    out = _decide(status, after, 601)
    assert out.status["restarts"]["application"] == 0
    assert out.status["restarts"]["byCause"] == {"InsufficientCapacity": 1}


def _node_lost_under_pod_1(status, gen: int, t: float, node: str = "gpu-node-1"):
    """Pod 1's node has been unreachable past the grace: the pass replaces pod 1 alone."""
    nodes = b.healthy_nodes()
    nodes[node] = b.node(node, ready="Unknown", since=t - 20)
    pods = [b.pod(gen, 0, node="gpu-node-0", spec_hash=H),
            b.pod(gen, 1, node=node, spec_hash=H, uid=f"uid-{gen}-1-{t}")]
    status = {**status, "tracking": {**status.get("tracking", {}),
                                     "members": {"0": f"uid-gpt-{gen}-0",
                                                 "1": f"uid-{gen}-1-{t}"}}}
    out = _decide(status, pods, t, nodes=nodes)
    assert ("force_delete", "Pod", f"gpt-{gen}-1") in [(a.verb, a.kind, a.name)
                                                       for a in out.actions]
    return out.status


def _survivor_exit(status, gen: int, t: float):
    pods = [b.pod(gen, 0, node="gpu-node-0", spec_hash=H, phase="Failed", exit_code=1,
                  finished=t - 1),
            b.pod(gen, 1, node="gpu-node-2", spec_hash=H)]
    return _decide(status, pods, t)


def test_a_survivors_exit_after_a_peer_was_lost_is_that_loss_and_is_not_counted():
    status = _node_lost_under_pod_1(running_status(0, members={}), 0, 100)
    assert status["restarts"]["byCause"] == {"NodeFailure": 1}
    out = _survivor_exit(status, 0, 150)
    assert out.status["podGeneration"] == 1                     # the group restarts...
    assert out.status["restarts"]["application"] == 0           # ...uncounted
    assert out.status["restarts"]["total"] == 1                 # the node failure alone
    assert "PeerLost" in reasons(out)
    # One exit per loss: the next generation's crash, with no loss before it, is the program's.
    again = _decide(out.status, _crash(1, 200), 200)
    assert again.status["restarts"]["application"] == 1


def test_the_lost_pods_replacement_is_no_survivor_of_that_loss():
    """Pod 1's replacement joined after pod 1 was lost: its own exit (here, seen on kind, when
    pod 0's node died 40 s after pod 1 was deleted) is not that loss's, and counts."""
    status = _node_lost_under_pod_1(running_status(0, members={}), 0, 100)
    pods = [b.pod(0, 0, node="gpu-node-0", spec_hash=H),
            b.pod(0, 1, node="gpu-node-2", spec_hash=H, uid="uid-replacement", phase="Failed",
                  exit_code=1, finished=139)]
    out = _decide(status, pods, 140)
    assert "PeerLost" not in reasons(out)
    assert out.status["restarts"]["application"] == 1


def test_an_exit_long_after_a_peer_was_lost_is_the_programs():
    status = _node_lost_under_pod_1(running_status(0, members={}), 0, 100)
    out = _survivor_exit(status, 0, 100 + PEER_LOSS_WINDOW_S + 1)
    assert out.status["restarts"]["application"] == 1 and "PeerLost" not in reasons(out)


def test_twenty_node_losses_with_the_survivors_exiting_every_third_leave_the_budget_whole():
    """torchrun's in-pod budget is 3: every third peer loss the survivors exit 1. Twenty
    losses, on four nodes in turn, within one window of maxInfrastructureRestarts."""
    status, gen, t = running_status(0, members={}), 0, 100.0
    for loss in range(20):
        node = f"gpu-node-{1 + loss % 3}"
        status = _node_lost_under_pod_1(status, gen, t, node)
        t += 15
        if loss % 3 == 2:
            out = _survivor_exit(status, gen, t)
            status, gen = out.status, gen + 1
            assert status["podGeneration"] == gen
            t += 15
        assert status["phase"] != "Failed", status.get("message")
    r = status["restarts"]
    assert (r["infrastructure"], r["application"]) == (20, 0), r
    assert r["byCause"] == {"NodeFailure": 20}


def test_one_node_failing_again_and_again_is_a_loop():
    spec = {"faultTolerance": {**SPEC["faultTolerance"], "maxInfrastructureRestarts": 3}}
    status = running_status(0, members={})
    for i in range(3):
        nodes = b.healthy_nodes()
        nodes["gpu-node-1"] = b.node("gpu-node-1", ready="Unknown", since=100 * i)
        pods = [b.pod(0, 0, node="gpu-node-0", spec_hash=H),
                b.pod(0, 1, node="gpu-node-1", spec_hash=H, uid=f"u{i}")]
        out = _decide({**status, "tracking": {**status["tracking"],
                                              "members": {"0": "uid-gpt-0-0", "1": f"u{i}"}}},
                      pods, 100 * i + 20, nodes=nodes, **spec)
        status = out.status
    assert status["phase"] == "Failed"
    assert "NodeFailure of node gpu-node-1" in cond(out, "Failed")["message"]


def test_a_peers_node_found_dead_soon_after_an_exit_takes_the_restart_back():
    """Pod 0 exits 1 while pod 1's node still looks alive; 20 s later that node is Unknown,
    and past the grace the restart is counted as its NodeFailure."""
    pods = [b.pod(0, 0, node="gpu-node-0", spec_hash=H, phase="Failed", exit_code=1,
                  finished=99),
            b.pod(0, 1, node="gpu-node-1", spec_hash=H)]
    out = _decide(running_status(0, members={"0": "uid-gpt-0-0", "1": "uid-gpt-0-1"}),
                  pods, 100)
    assert out.status["restarts"]["application"] == 1
    assert out.status["tracking"]["peerSuspect"]["nodes"] == ["gpu-node-1"]
    dead = b.healthy_nodes()
    dead["gpu-node-1"] = b.node("gpu-node-1", ready="Unknown", since=120)
    later = _decide(out.status, [], 131, nodes=dead)
    r = later.status["restarts"]
    assert (r["application"], r["infrastructure"]) == (0, 1)
    assert r["byCause"] == {"NodeFailure": 1}
    assert "peerSuspect" not in later.status["tracking"]
    assert [e["node"] for e in later.status["tracking"]["badNodes"]] == ["gpu-node-1"]
