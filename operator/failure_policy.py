"""The failure policy: which failures restart the group, which replace one pod, which fail the job.

Owns the checks of a running generation, in the order `restart_needed` applies them: spec drift,
application failures (budget and crash-loop guard; uncounted while the generation is short of
capacity), infrastructure failures of pod 0 (the c10d store host, see manifests.py), pods that
vanished, failed nodes (suspect within the grace; then cordon, annotate, anti-affinity,
force-delete), hangs timed on the operator's clock; then `replace_and_create` for single-pod
replacement and creation (pod 0 first), `infrastructure_loop` for one cause restarting too
often, and `pending` for pods that cannot start. The rules are in
decision.py's docstring and docs/operator.md; the classification itself is failures.py. Pure.
"""

from __future__ import annotations

from crucible.api.progress import format_time, parse_time
from crucible.operator import capacity
from crucible.operator import conditions as c
from crucible.operator import failures as f
from crucible.operator import manifests as m
from crucible.operator import progress, queueing
from crucible.operator.observed import PodView
from crucible.operator.quarantine import cordon_annotations
from crucible.operator.outcome import FAILED, RUNNING, Pass

MAX_BAD_NODES = 32     # anti-affinity list per job; older entries drop off


def restart_needed(p: Pass, current: dict[int, PodView]) -> bool:
    """Checks that restart the group (or fail the job), in order; True if one fired."""
    want = m.spec_hash(p.spec)
    if any(pod.spec_hash and pod.spec_hash != want and not pod.deleting
           for pod in current.values()):
        p.bump("SpecChanged", "the spec changed what the pods run")
        return True
    lost = _store_lost(p, current)
    if lost is not None:
        # Checked before anyone's exit code: without pod 0 the survivors lose the c10d store
        # and exit 1, which is the store's loss, not the program failing.
        p.bump(lost.cause, lost.message + "; it hosted the c10d store", lost)
        return True
    fresh = [pod for pod in current.values() if pod.uid not in p.handled]
    short = capacity.short_of_capacity(p, current)
    for pod in fresh:
        failure = pod_failure(p, pod)
        if failure and failure.counted and short:
            # Fewer than nodes.min pods ever had a node: the rendezvous could not complete, so
            # this exit is the survivors giving up on it (rendezvousTimeoutSeconds), not the
            # program failing. Restart without spending the budget; the job waits for capacity.
            p.bump("InsufficientCapacity", f"{failure.message} while {short}", f.Failure(
                "InsufficientCapacity", f.INFRASTRUCTURE, f"{failure.message} while {short}"))
            return True
        if failure and failure.counted:
            peer = _peer_loss_excuse(p, pod)
            if peer is not None:
                # torchrun spent its in-pod restarts on peers the cluster took: this exit is
                # that loss's, and the new generation's pods start with the budget whole.
                p.bump("PeerLost", f"{failure.message} {peer}")
                return True
            _application_failure(p, failure)
            if p.status.get("phase") != FAILED:
                _suspect_peers(p, current, pod, failure)
            return True
    for index, uid in (p.track.get("members") or {}).items():
        pod = current.get(int(index))
        if int(index) != 0 and (pod is None or pod.uid != uid) and uid not in p.handled:
            failure = f.vanished_failure(m.pod_name(p.job.name, p.gen, int(index)))
            p.mark_handled(uid)
            replaced(p, failure, int(index))
            p.event("Warning", failure.cause, failure.message + "; replacing it")
    if _node_failures(p, current):
        return True
    return _hang(p)


def pod_failure(p: Pass, pod: PodView) -> f.Failure | None:
    """`failures.pod_failure` for this job: whether its checkpoint storage has answered it (a
    commit is recorded) decides how a stop for the store's outage counts."""
    return f.pod_failure(pod, p.spec.fault_tolerance,
                         store_answered=bool(p.status.get("lastCheckpoint")))


def _store_lost(p: Pass, current: dict[int, PodView]) -> f.Failure | None:
    """Why pod 0, the c10d store's host, is gone or going for a reason not the program's: it
    failed for infrastructure (deleted, evicted, OOMKilled, a signal), vanished, or sits on a
    node that has failed while another pod has already exited (the survivors do once the
    store stops answering, long before the node's grace ends)."""
    pod = current.get(0)
    if pod is not None and pod.uid not in p.handled:
        failure = pod_failure(p, pod)
        if failure is None and pod.deleting:
            failure = f.deleted_failure(pod)
        if failure is not None:
            return None if failure.counted else failure
    member = (p.track.get("members") or {}).get("0")
    if (pod is None or pod.uid != member) and member and member not in p.handled:
        p.mark_handled(member)
        return f.vanished_failure(m.pod_name(p.job.name, p.gen, 0))
    if pod is None or pod.uid in p.handled:
        return None
    broken = p.node_broken(pod.node)
    exited = [other for other in current.values() if other.index != 0
              and other.uid not in p.handled and pod_failure(p, other) is not None]
    if broken is not None and exited and not pod.terminated:
        # Restart without waiting out the grace; the node itself is judged only after it
        # (a new pod 0 lands elsewhere anyway: the scheduler avoids a NotReady node).
        return f.Failure("NodeFailure", f.INFRASTRUCTURE, f"{broken.message} under pod "
                         f"{pod.name}, and {exited[0].name} exited without its store",
                         broken.node)
    return None


# How long after a pod's exit a peer's node may still be found dead for the exit to be that
# node's loss: the node controller marks a silent node Unknown after its monitor grace (40-50 s
# by default), and a node failure is judged after nodeFailureGraceSeconds on top.
STORE_LOSS_WINDOW_S = 120
# How long after a peer was replaced for infrastructure an exit of the program is that loss's:
# the trainer's collectives time out after 600 s (trainer/parallel.py, init_distributed), so a
# survivor blocked on the lost peer has failed by then. One exit per loss, no more.
PEER_LOSS_WINDOW_S = 600


def replaced(p: Pass, failure: f.Failure, index: int):
    """Count the infrastructure failure of pod `index`, replaced alone, and remember it for
    `_peer_loss_excuse`: each such loss costs the survivors one of torchrun's in-pod restarts
    (their workers fail with the lost peer), and once those are spent their agents exit 1."""
    p.count(failure)
    p.track["peerLost"] = {"generation": p.gen, "at": format_time(p.now),
                           "message": failure.message, "index": index}


def _peer_loss_excuse(p: Pass, exited: PodView) -> str | None:
    """Why a program exit of this generation is a peer's loss (said once per loss), or None.
    The lost pod's replacement (same index) never survived that loss: it joined after it, so
    its exit is something else's (a later failure), and the loss stays for its survivors."""
    lost = p.track.get("peerLost")
    if lost and lost.get("index") == exited.index:
        return None
    p.track.pop("peerLost", None)
    if not lost or lost.get("generation") != p.gen:
        return None
    at = parse_time(lost.get("at"))
    if at is None or (p.now - at).total_seconds() > PEER_LOSS_WINDOW_S:
        return None
    return (f"within {PEER_LOSS_WINDOW_S}s of a peer's loss ({lost.get('message')} at "
            f"{lost.get('at')}): not counted, the survivors' torchrun restarts went to it")


def _suspect_peers(p: Pass, current: dict[int, PodView], failed: PodView, failure: f.Failure):
    """A pod failed while its peers still looked alive. When a peer's whole node dies (pod 0's
    above all: it hosts the c10d store), the others can exit within seconds (their connections
    to it are reset), long before the node controller marks the node: the restart then reads
    as the program's. Remember the peers' nodes; `recount_peer_loss` settles it."""
    nodes = sorted({pod.node for pod in current.values()
                    if pod.index != failed.index and pod.node and not pod.terminated})
    if not nodes:
        p.track.pop("peerSuspect", None)
        return
    p.track["peerSuspect"] = {"nodes": nodes, "pod": failed.name, "cause": failure.cause,
                              "at": format_time(p.now)}


def _suspect(track: dict) -> dict | None:
    """`tracking.peerSuspect`, or the one-node `storeHostSuspect` an earlier version wrote."""
    if track.get("peerSuspect"):
        return track["peerSuspect"]
    old = track.get("storeHostSuspect")
    if old:
        return {"nodes": [old["node"]], "pod": old.get("pod", ""), "cause": "ApplicationError",
                "at": old["at"]}
    return None


def recount_peer_loss(p: Pass):
    """A restart counted as the program's whose peer's node is found dead within
    STORE_LOSS_WINDOW_S (and stays dead past nodeFailureGraceSeconds) was the node's loss:
    counted again as a NodeFailure (the restart budget gets its restart back), and the node is
    quarantined as any failed node is."""
    suspect = _suspect(p.track)
    if not suspect:
        return
    at, grace = parse_time(suspect["at"]), p.spec.fault_tolerance.node_failure_grace_seconds
    age = (p.now - at).total_seconds()
    dead = [broken for broken in map(p.node_broken, suspect["nodes"])
            if broken is not None and (broken.since is None
                                       or (broken.since - at).total_seconds()
                                       <= STORE_LOSS_WINDOW_S)]
    if not dead:
        if age > STORE_LOSS_WINDOW_S:
            _forget_suspect(p)                  # the nodes lived: the exit was the program's
        else:
            p.wake(STORE_LOSS_WINDOW_S - age)
        return
    broken = max(dead, key=lambda d: d.age_s(p.now))
    if broken.age_s(p.now) < grace:
        p.wake(grace - broken.age_s(p.now))
        return
    _forget_suspect(p)
    if not p.recount(f.Failure(suspect.get("cause", "ApplicationError"), f.APPLICATION, ""),
                     f.Failure("NodeFailure", f.INFRASTRUCTURE, broken.message, broken.node)):
        return
    if p.track.get("noProgressFailures"):
        p.track["noProgressFailures"] -= 1
    p.event("Warning", "NodeFailure", f"{broken.message}: it ran a peer of {suspect['pod']} when "
            f"that pod exited at {suspect['at']}; that restart is counted as a NodeFailure, not "
            "as the program's")
    quarantine(p, broken, p.obs.nodes.get(broken.node))


def _forget_suspect(p: Pass):
    p.track.pop("peerSuspect", None)
    p.track.pop("storeHostSuspect", None)


def _application_failure(p: Pass, failure: f.Failure):
    ft, r = p.spec.fault_tolerance, p.status.get("restarts") or {}
    used = r.get("application", 0)
    # Progress since the last application failure: a step seen after it (operator clock).
    stepped = parse_time(p.track.get("stepSeenAt"))
    last = parse_time(p.track.get("lastFailureTime"))
    streak = 1 if (stepped is not None and (last is None or stepped > last)) else \
        int(p.track.get("noProgressFailures", 0)) + 1
    if used >= ft.max_restarts:
        p.fail("RestartBudgetExhausted", f"{failure.message}; {used} application restart(s) "
               f"already used of faultTolerance.maxRestarts={ft.max_restarts}")
    elif streak > ft.max_restarts_without_progress:
        p.fail("CrashLoopNoProgress", f"{failure.message}; {streak} application failures in a "
               f"row with no training step between them (maxRestartsWithoutProgress="
               f"{ft.max_restarts_without_progress})")
    else:
        p.track["noProgressFailures"] = streak
        p.track["lastFailureTime"] = format_time(p.now)
        p.bump(failure.cause, failure.message + f" (application restart {used + 1} of "
               f"{ft.max_restarts})", failure)


def _node_failures(p: Pass, current: dict[int, PodView]) -> bool:
    ft = p.spec.fault_tolerance
    for pod in sorted(current.values(), key=lambda pod: pod.index or 0):
        if pod.terminated or not pod.node:
            continue
        broken = p.node_broken(pod.node)
        if broken is None:
            continue
        if pod.uid in p.handled:
            # Counted already; still listed (watch lag, or a finalizer holds it): never again.
            if not pod.deleting:
                p.act("force_delete", "Pod", pod.name, reason=broken.reason)
            continue
        wait_s = ft.node_failure_grace_seconds - broken.age_s(p.now)
        if wait_s > 0:
            # Only suspect until the grace ends: a node back within it (a kubelet restart, a
            # short partition) is neither cordoned nor kept out of the job.
            p.degraded = True
            p.cond(c.DEGRADED, True, broken.reason, f"{broken.message}; pod {pod.name} is "
                   f"replaced in {wait_s:.0f}s unless the node recovers")
            p.wake(wait_s)
            continue
        quarantine(p, broken, p.obs.nodes.get(pod.node))
        failure = f.Failure("NodeFailure", f.INFRASTRUCTURE,
                            f"{broken.message} under pod {pod.name}", broken.node)
        p.mark_handled(pod.uid)
        if pod.index == 0:
            p.bump("NodeFailure", failure.message + "; it hosted the c10d store", failure)
            return True
        replaced(p, failure, pod.index)
        p.act("force_delete", "Pod", pod.name, reason=broken.reason)
        p.event("Warning", "NodeFailure", f"{failure.message}: force-deleted it to recreate it "
                "elsewhere; the others re-rendezvous on pod 0's store meanwhile")
    return False


def avoid(p: Pass, broken: f.NodeFailure, node) -> None:
    """Remember a node for this job's anti-affinity; nothing on the node changes."""
    if broken.node not in [entry["node"] for entry in bad_entries(p.track)]:
        bad = bad_entries(p.track) + [{"node": broken.node, "since": format_time(p.now),
                                  "cordoned": bool(node and node.unschedulable)}]
        p.track["badNodes"] = bad[-MAX_BAD_NODES:]


def quarantine(p: Pass, broken: f.NodeFailure, node, event_reason: str = "NodeFailure"):
    """Cordon and annotate a failed node once; remember it for this job's anti-affinity."""
    avoid(p, broken, node)
    if node is None:
        return
    this_job = f"{p.job.namespace}/{p.job.name}"
    if _already_reported(node, broken):
        # First job to see a failure wins; no flip-flopping. A pass can start from a status
        # written before this job's own cordon landed (the node is watched apart from the
        # job): the node's annotation, not that status, says whether the job cordoned it.
        if node.annotation("crucible.dev/cordoned-by") == this_job:
            _list_cordoned(p, broken.node)
        return
    why_not = ("cordonFailedNodes is false" if not p.spec.fault_tolerance.cordon_failed_nodes
               else "this operator never cordons: --max-cordons-per-minute=0"
               if not p.cluster_policy.cordon else "it was cordoned already"
               if node.unschedulable else None)
    cordon = why_not is None
    patch = {"metadata": {"annotations": {
        "crucible.dev/failure-reason": broken.reason,
        "crucible.dev/failure-message": broken.message[:500],
        "crucible.dev/failure-job": this_job,
        "crucible.dev/failure-time": format_time(p.now)}}}
    if cordon:
        patch["spec"] = {"unschedulable": True}
        patch["metadata"]["annotations"]["crucible.dev/cordoned-by"] = this_job
        patch["metadata"]["annotations"].update(cordon_annotations(
            node, p.now, p.cluster_policy.quarantine_s))
        _list_cordoned(p, broken.node)
    p.act("patch_node", "Node", broken.node, patch, reason="Cordon" if cordon else "Annotate")
    p.event("Warning", event_reason, f"{broken.message}: " + (
        "cordoned and annotated it" if cordon else f"annotated it ({why_not})"))


def _already_reported(node, broken: f.NodeFailure) -> bool:
    """The node carries a report of this failure. One older than the failure's start is of an
    earlier one, repaired since (uncordoned, back to Ready): this failure is reported anew."""
    if not node.annotation("crucible.dev/failure-reason"):
        return False
    reported = parse_time(node.annotation("crucible.dev/failure-time"))
    return reported is None or broken.since is None or broken.since <= reported


def bad_nodes(p: Pass) -> list[str]:
    """Nodes this job keeps its pods off: those that failed under it, while they are broken or
    cordoned. Once a node is healthy and schedulable again, one seen cordoned since its failure
    is trusted at once (whoever repaired it uncordoned it); any other (not cordoned: the
    cordon was off or rate-limited) only after avoidFailedNodesMinutes, so a node that flaps
    on its own does not take the job's pods back at once."""
    avoid_s = p.spec.fault_tolerance.avoid_failed_nodes_minutes * 60
    kept = []
    for entry in bad_entries(p.track):
        name, since = entry["node"], parse_time(entry.get("since"))
        node = p.obs.nodes.get(name)
        entry = {**entry, "cordoned": entry.get("cordoned") or bool(node and node.unschedulable)}
        expired = since is None or (p.now - since).total_seconds() >= avoid_s
        if name not in p.obs.nodes:
            kept.append(entry)                 # not known to the snapshot: keep avoiding it
        elif node is None:
            if not expired:                    # deleted; a node back under its name later
                kept.append(entry)             # is a new machine
        elif p.node_broken(name) or node.unschedulable or not (entry["cordoned"] or expired):
            kept.append(entry)
    if kept != p.track.get("badNodes", []):
        p.track["badNodes"] = kept
    return [entry["node"] for entry in kept]


def bad_entries(track) -> list[dict]:
    """`tracking.badNodes` as {node, since, cordoned} (a bare name is a status written before
    entries had times: avoided until the node is healthy and schedulable)."""
    return [entry if isinstance(entry, dict) else {"node": entry}
            for entry in track.get("badNodes") or []]


def infrastructure_loop(p: Pass) -> bool:
    """Fail the job when one infrastructure cause restarted it maxInfrastructureRestarts times
    within infrastructureRestartWindowMinutes (pod 0 killed by a signal again and again, which
    would otherwise restart forever without spending the budget). Waiting for capacity is not
    a loop: it never counts."""
    ft = p.spec.fault_tolerance
    window_s = ft.infrastructure_restart_window_minutes * 60
    recent: dict[str, list[str]] = {}
    for cause, times in (p.track.get("infrastructureRestarts") or {}).items():
        kept = [t for t in times if (p.now - parse_time(t)).total_seconds() < window_s]
        if kept:
            recent[cause] = kept
    # One count per cause per pass: a node failure takes down every pod the job had on it (and
    # each is replaced, counted in `restarts`), but it is one failure, not one per pod. A
    # node's failure counts against that node: one node failing again and again is a loop;
    # twenty nodes failing one after another under a long run are bad luck (each is quarantined,
    # and the cordon cap protects the pool).
    for key in {f"{failure.cause}:{failure.node}" if failure.node else failure.cause
                for failure in p.restarts
                if failure.kind == f.INFRASTRUCTURE and failure.cause != "InsufficientCapacity"}:
        recent.setdefault(key, []).append(format_time(p.now))
    if recent:
        p.track["infrastructureRestarts"] = recent
    else:
        p.track.pop("infrastructureRestarts", None)
    for key, kept in recent.items():
        if len(kept) >= ft.max_infrastructure_restarts:
            cause, _, node = key.partition(":")
            last = [x.message for x in p.restarts if x.cause == cause]
            what = f"{cause} of node {node}" if node else cause
            p.fail("InfrastructureLoop", f"{len(kept)} restarts caused by {what} within "
                   f"{ft.infrastructure_restart_window_minutes} min "
                   f"(maxInfrastructureRestarts={ft.max_infrastructure_restarts})"
                   + (f"; the last: {last[-1]}" if last else ""))
            return True
    return False


def _list_cordoned(p: Pass, node: str) -> None:
    cordoned = p.status.setdefault("cordonedNodes", [])
    if node not in cordoned:
        cordoned.append(node)


def _hang(p: Pass) -> bool:
    """No step for hangTimeoutSeconds once the group has stepped; none within
    startupTimeoutSeconds of its start (rendezvous, restoring a checkpoint, the first compile
    can take far longer than a step). Both on the operator's clock (`progress.note_step`)."""
    if p.phase != RUNNING:
        return False
    ft = p.spec.fault_tolerance
    starts = [t for t in (c.true_since(p.conds, c.RUNNING),
                          parse_time(p.track.get("lastDisruption"))) if t is not None]
    started = max(starts) if starts else None
    stepped = parse_time(p.track.get("stepSeenAt"))
    if stepped is not None and (started is None or stepped > started):
        since, timeout, knob = stepped, ft.hang_timeout_seconds, "hangTimeoutSeconds"
    elif started is not None:
        since, timeout, knob = started, ft.startup_timeout_seconds, "startupTimeoutSeconds"
    else:
        return False
    if (p.now - since).total_seconds() < timeout:
        p.wake(timeout - (p.now - since).total_seconds())
        return False
    step = p.obs.lease.step if p.obs.lease else None
    p.cond(c.PROGRESSING, False, "Hang", f"no step completed for {timeout}s ({knob})")
    what = (f"no training step for {timeout}s (stuck after step {step})"
            if knob == "hangTimeoutSeconds" else
            f"no training step within {timeout}s of the start ({knob})")
    _application_failure(p, f.Failure("Hang", f.APPLICATION, what))
    return True


def replace_and_create(p: Pass, current: dict[int, PodView]):
    ft = p.spec.fault_tolerance
    for pod in current.values():
        failure = pod_failure(p, pod)
        if failure is None and pod.deleting and pod.uid not in p.handled:
            failure = f.deleted_failure(pod)
        if failure is not None and pod.uid not in p.handled:
            p.mark_handled(pod.uid)
            replaced(p, failure, pod.index)
            p.event("Warning", failure.cause, failure.message + "; replacing it")
        if pod.phase == "Failed" or pod.deleting:
            p.delete(pod)
            if pod.deleting:
                p.wake(ft.terminating_timeout_seconds - (p.now - pod.deletion).total_seconds())
    if current and "startTime" not in p.status:
        # The pass that created the first pod may have lost its status write (a 409: the job
        # moved meanwhile); the pods say when the job first had them.
        made = [pod.created for pod in current.values() if pod.created is not None]
        p.status["startTime"] = format_time(min(made) if made else p.now)
    avoid = bad_nodes(p)
    _recreate_if_trusted_again(p, current, avoid)
    # The adapter posts a "Created" event for each pod the API actually created.
    after = _fence(p)
    for index in _to_create(p, current):
        body = m.pod(p.job.name, p.job.namespace, p.job.uid, p.spec, p.gen, index,
                     avoid_nodes=avoid, instance_metadata=p.cluster_policy.instance_metadata)
        if p.admission is not None:
            body = queueing.admitted_pod(body, p.admission)
        p.act("create", "Pod", body["metadata"]["name"], body, after=after)
        p.status.setdefault("startTime", format_time(p.now))
    p.track["members"] = {str(i): pod.uid for i, pod in current.items() if i is not None}


def _recreate_if_trusted_again(p: Pass, current: dict[int, PodView], avoid: list[str]):
    """A pod's node affinity is fixed at creation. One still waiting for a node while its
    affinity keeps it off a node the job trusts again (repaired, uncordoned) is deleted,
    uncounted, and recreated by a later pass without it: otherwise, in a pool as small as the
    job, it would stay Pending beside the very node it needs."""
    for pod in current.values():
        trusted = sorted(set(pod.avoided_nodes) - set(avoid))
        if pod.node or pod.deleting or pod.terminated or not trusted:
            continue
        p.mark_handled(pod.uid)                # its deletion is not a failure
        p.event("Normal", "NodeTrusted", f"{pod.name} waits for a node and avoids "
                f"{', '.join(trusted)}, trusted again: recreating it without that constraint")
        p.delete(pod)


def _fence(p: Pass) -> tuple[str, str] | None:
    """What the pass's pods must come after. Pods exist only behind the job's NetworkPolicy: it
    is all that keeps other pods off pod 0's c10d store, which unpickles what it is sent. With
    the policy in the index as rendered now, nothing (it is there). Otherwise the pass writes
    it (`_ensure_children`: created when missing, replaced when it drifted) and its pods come
    after that write, in the same pass, only if it lands (`Action.after`): a new job's first
    pass starts its pods at once, and a refused or failed write holds them (the pass is
    retried). An earlier pass's create that the watch has not shown yet does not count: the
    policy may have gone since."""
    name = m.network_policy_name(p.job.name)
    if p.obs.has_child("NetworkPolicy", name) and not p.writes("NetworkPolicy", name):
        return None
    return ("NetworkPolicy", name)


def _to_create(p: Pass, current: dict[int, PodView]) -> list[int]:
    """Missing pod indices, pod 0 first: it hosts the rendezvous store, so the others are
    created only once it has a node. In a full pool the scheduler then never leaves pod 0 the
    Pending one while the others hold the GPUs and time out waiting for it. When the operator's
    book shows room for them all (`obs.room_for_gang`), all at once: a scheduling round trip
    less for every start and restart."""
    missing = [i for i in range(p.width) if i not in current]
    if p.obs.room_for_gang:
        return missing
    if 0 in missing:
        return [0]
    return missing if current[0].node else []


def pending(p: Pass, current: dict[int, PodView]) -> bool:
    ft, waiting = p.spec.fault_tolerance, []
    for pod in current.values():
        problem = f.pending_problem(pod)
        if problem is None:
            continue
        if problem.hopeless and p.track.get("everRunning"):
            # The same image and config already trained this job: a registry outage or a
            # Secret being rotated, not a mistake in the spec. Report it and let the kubelet
            # keep retrying (it backs off on its own); never end a long run over it.
            p.degraded = True
            p.cond(c.DEGRADED, True, problem.reason, f"{problem.message}; retrying (the job has "
                   "trained with this spec before)")
            continue
        if problem.hopeless and f.pending_too_long(pod, ft, p.now):
            p.fail(problem.reason, f"{problem.message} for over {ft.pending_timeout_seconds}s")
            return True
        if problem.hopeless and pod.created is not None:
            p.wake(ft.pending_timeout_seconds - (p.now - pod.created).total_seconds())
        waiting.append(problem)
    unschedulable = [w for w in waiting if w.reason == "Unschedulable"]
    placed = sum(1 for pod in current.values() if pod.node)
    short = capacity.capacity_shortage(p, current)
    if short:
        was = c.get(p.conds, c.PODS_SCHEDULED)
        if not was or was.get("reason") != "InsufficientCapacity":
            p.event("Warning", "InsufficientCapacity", f"waiting for capacity: {short}")
        p.cond(c.PODS_SCHEDULED, False, "InsufficientCapacity", short)
    elif unschedulable:
        was = c.get(p.conds, c.PODS_SCHEDULED)
        if not was or was.get("reason") != "Unschedulable":
            p.event("Warning", "Unschedulable", unschedulable[0].message)
        p.cond(c.PODS_SCHEDULED, False, "Unschedulable",
               f"{len(unschedulable)} pod(s) unschedulable: {unschedulable[0].message}")
    elif placed == p.width:
        p.cond(c.PODS_SCHEDULED, True, "Scheduled", "every pod has a node")
    else:
        p.cond(c.PODS_SCHEDULED, False, "Scheduling",
               f"{placed}/{p.width} pods have a node")
    return False


