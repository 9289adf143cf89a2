#!/usr/bin/env bash
# More faults for the example job on the kind cluster, after `run.sh up` (and `run.sh chaos`):
#   e2e/kind/chaos.sh [fault ...]     default: all, in this order
#     pod-delete delete pod 1 (a worker): the survivors re-rendezvous, the operator recreates it
#     node-kill  `docker kill` the node container under pod 0 (real node loss: its kubelet stops,
#                the node controller taints it); the operator cordons it and restarts the group;
#                then the node is started again and uncordoned, and the job must use it again
#     sigkill    kill -9 the training process (torchrun's worker) in pod 0
#     sigstop    SIGSTOP the training process in pod 0: a hang (faultTolerance.hangTimeoutSeconds)
#     node-pause `docker pause` the node under pod 0 for $CRUCIBLE_CHAOS_PAUSE_S (60 s), unpause
#     operator-delete  delete the operator pods (Deployment recreates it); the job should train on
#     s3-restart-mid-save  stop the S3 server's container right after a checkpoint is due (the
#                kubelet restarts it; its emptyDir keeps the data)
#     netpol-probe  a pod in another namespace cannot reach pod 0's c10d store (port 29400)
#     apiserver-restart  stop the control plane's kube-apiserver container mid-step (the kubelet
#                restarts its static pod): training must go on, nothing restarted
#     operator-kill-mid-restart  delete pod 0, and delete both operator pods as soon as the group
#                restart it causes has begun (a new pod generation): the new operator finishes it,
#                counted once, never more pods than nodes.max
#     s3-outage-5min  freeze the S3 server (SIGSTOP) for $CRUCIBLE_CHAOS_S3_OUTAGE_S (300 s): saves
#                fail or hang, training must go on (steps advance, nothing restarted), and the next
#                save after the outage must commit
#     node-loss-worker  with nodes.min raised to nodes.max (no elastic slack), `docker kill` the node
#                under pod 1; no spare node exists: the node must be cordoned, the job must wait
#                and train no step with one pod, and resume from its newest commit with both pods
#                once the node is started again and uncordoned;
#                nodes.min is put back afterwards
#     leader-node-kill  two operator replicas, the leader on the worker under pod 0 and the standby
#                on the control plane: `docker kill` that worker. The standby must take the Lease,
#                judge the node (NodeFailure, cordon) and restart the job, which resumes from its
#                newest commit; the node is started again and uncordoned and the job fills it. The
#                operator's placement is put back afterwards
#     kueue      (Kueue installed by run.sh up) the example job suspended; a job queued through a
#                LocalQueue (e2e/kind/kueue-queues.yaml) at low priority commits a checkpoint, then
#                a high-priority job of 60 steps is queued: Kueue must preempt the first, whose
#                pods go as one unit (never more pods of the two than the quota's 2), the second
#                must run and succeed, and the first must be admitted again and resume from its
#                newest commit, its preemption counted once (Preempted); the example resumes
# For each fault one line goes to ~/.cache/crucible/kind/logs/chaos-results.tsv (a header first
# when the file is new): the time, the fault's name, the restart causes recorded
# (status.restarts.byCause, before -> after), seconds from the fault to the first step after it
# (from the trainer's log; for a fault that must restart, the first step after the restart), the
# step at the fault, the step resumed from (trainer log "resumed from"; 0 for a start from
# scratch; - when nothing restarted), steps lost, whether a node got cordoned, the most pods of
# the current generation seen (pending ones included) over nodes.max, and ok: whether every check
# below held (the run stops at the first fault that is not ok).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="${CRUCIBLE_KIND_CLUSTER:-crucible-e2e}"
ctx="kind-$cluster"
ns=crucible-e2e
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}"
k8s_version="$(sed -n 's/^K8S_VERSION=//p' "$here/lib.sh")"
export PATH="$cache/bin:$cache/kind/bin/kube-$k8s_version:$PATH"
results="${CRUCIBLE_CHAOS_RESULTS:-${CRUCIBLE_CACHE:-$HOME/.cache/crucible}/kind/logs/chaos-results.tsv}"
k() { kubectl --context "$ctx" "$@"; }
say() { printf '\n== %s  %s\n' "$(date -u +%T)" "$*"; }
die() { echo "kind chaos: $*" >&2; exit 1; }
st() { k -n "$ns" get ptj example -o jsonpath="{.status.$1}" 2>/dev/null || true; }
max_pods() { k -n "$ns" get ptj example -o jsonpath='{.spec.nodes.max}'; }
HEADER=$'time\tfault\trestarts_by_cause\tfault_to_resumed_step_s\tstep_at_fault\tresumed_from\tsteps_lost\tcordoned\tpods_seen\tok'
mkdir -p "$(dirname "$results")"
# A file of an earlier layout (other columns) is kept aside, not mixed with this one's rows.
if [[ -s "$results" && "$(head -1 "$results")" != "$HEADER" ]]; then mv "$results" "$results.$(date +%s).old"; fi
[[ -s "$results" ]] || echo "$HEADER" >"$results"
# One row of the results: the fields after the time, tab-separated.
row() { (IFS=$'\t'; printf '%s\t%s\n' "$(date -u +%FT%TZ)" "$*") | tee -a "$results"; }
# Restarts counted in a status.restarts.byCause map ({"PodDeleted":1,...}), all causes together.
restart_count() { python3 -c 'import json, sys; print(sum(json.loads(sys.argv[1] or "{}").values()))' "$1"; }

# NodeFailure restarts in such a map.
node_failures() { python3 -c 'import json, sys; print(json.loads(sys.argv[1] or "{}").get("NodeFailure", 0))' "$1"; }

# The training process in a pod: torchrun's worker (a python whose command line is not torchrun's).
train_pids() {
  k -n "$ns" exec "$1" -- python3 -c '
import os
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) in (1, os.getpid(), os.getppid()):
        continue
    try:
        cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    s = b" ".join(cmd)
    if b"python" in cmd[0] and b"torchrun" not in s and b"torch.distributed.run" not in s and b"-c" not in cmd[1:2]:
        print(p)'
}

# The steps the trainer in pod $1 resumed from, oldest first.
# A start from scratch (the first step logged is 1, no checkpoint restored) counts as step 0.
resumes() {
  k -n "$ns" logs "$1" 2>/dev/null | sed -n -e 's/.*resumed from .*(step \([0-9]*\).*/\1/p' \
    -e 's/^step  *1\/.*/0/p'
}

# Steps pod $1 logged since its newest resume ("resumed from", or a fresh start's step 1).
steps_since_resume() {
  k -n "$ns" logs "$1" 2>/dev/null | awk '/resumed from/ {n = 0; next} /^step +1\// {n = 0} /^step +[0-9]+\// {n++} END {print n + 0}'
}

# Wait until a checkpoint is committed and training is running in every pod of the generation.
settle() {
  local deadline=$((SECONDS + 600))
  while ((SECONDS < deadline)); do
    [[ "$(st phase)" == Running && -n "$(st lastCheckpoint.step)" ]] && return 0
    sleep 3
  done
  die "the job did not settle (phase $(st phase))"
}

# Run a fault and measure: $1 name, $2.. the command that injects it (may block, e.g. pause).
measure() {
  local name=$1; shift
  settle
  local r0 r gen0 step0 ckpt0 loss0 causes0 t0 cordoned=no resumed="-" first="" seen=0 n s g deadline
  gen0=$(st podGeneration); step0=$(st step); causes0=$(st restarts.byCause)
  ckpt0=$(st lastCheckpoint.step); loss0=$(st loss)
  say "$name: generation $gen0, step $step0, newest checkpoint $(st lastCheckpoint.step)"
  mapfile -t r < <(resumes "example-$gen0-0"); r0=${#r[@]}
  if declare -F "$1_pre" >/dev/null; then "$1_pre"; fi   # e.g. wait for the moment, off the clock
  t0=$SECONDS
  "$@"
  # The first step after the fault: status.step above the step the trainer resumed from (its log's
  # newest "resumed from", in pod 0 of the new generation or, for a restart inside the pod, in the
  # same pod), or above step0 when nothing restarted (after min_quiet seconds). With
  # expect_restart set, only a step after a restart counts: a fault that must restart the group
  # (the survivors of a lost peer step on until their collective fails) and never does times out.
  deadline=$((SECONDS + ${CRUCIBLE_CHAOS_WAIT_S:-600}))
  while ((SECONDS < deadline)); do
    g=$(st podGeneration); s=$(st step)
    n=$(k -n "$ns" get pods -l "crucible.dev/job=example" --no-headers 2>/dev/null \
        | awk -v g="example-$g-" 'index($1, g) == 1 && $3 != "Terminating"' | wc -l)
    ((n > seen)) && seen=$n
    mapfile -t r < <(resumes "example-$g-0")
    if [[ "$g" != "$gen0" && ${#r[@]} -gt 0 ]] || ((${#r[@]} > r0)); then resumed=${r[-1]}; fi
    if [[ "$resumed" != "-" ]]; then
      # From the trainer's own log, not status.step (which holds the old generation's last step
      # until the new one reports): a step logged after the newest resume (a fresh start's step 1
      # counts).
      if (($(steps_since_resume "example-$g-0") > 0)); then first=$((SECONDS - t0)); break; fi
    elif [[ -z "${expect_restart:-}" && -n "$s" ]] && ((s > step0 && SECONDS - t0 >= ${min_quiet:-0})); then
      first=$((SECONDS - t0)); break
    fi
    sleep 2
  done
  k get nodes -o jsonpath='{range .items[*]}{.metadata.name}={.spec.unschedulable}{"\n"}{end}' | grep -q '=true' && cordoned=yes
  local lost="-"
  [[ "$resumed" != "-" ]] && lost=$((step0 > resumed ? step0 - resumed : 0))
  [[ "$resumed" == "-" ]] && lost=0
  local causes1 rc=0; causes1=$(st restarts.byCause)
  if [[ -z "$first" ]]; then
    echo "kind chaos: $name: no step after the fault within the wait" >&2; rc=1
  else
    # The checks run in a subshell: `die` ends it, and the row still records ok=false.
    set +e
    (set -e
     check_recovery "$name" "$ckpt0" "$resumed" "$lost" "$seen" "$loss0"
     if declare -F "$1_post" >/dev/null; then "$1_post"; fi)   # its own rule, e.g. a node back
    rc=$?
    set -e
  fi
  row "$name" "${causes0:-{\}} -> ${causes1:-{\}}" "${first:-timeout}" "$step0" "$resumed" "$lost" \
    "$cordoned" "$seen/$(max_pods)" "$( ((rc == 0)) && echo true || echo false)"
  ((rc == 0)) || die "$name: not ok (the lines above say why)"
}

# What every fault must leave: a restart resumed from the newest commit at the fault (or a newer
# one), at most one checkpoint interval of steps lost, never more pods of a generation than
# nodes.max, and a loss that carries on (once 10 more steps have been reported, below 1.5x the
# loss at the fault or within 0.5 of it: a restart from scratch or a corrupt restore jumps back
# up to ~7.6, ln of the vocabulary, while one batch's loss of a model that has memorised its small
# corpus wanders between ~0.1 and ~0.25 at step 1000, past 1.5x on its own).
loss_carries_on() {
  python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(not (b < 1.5 * a or b < a + 0.5))' "$1" "$2"
}
check_recovery() {
  local name=$1 ckpt0=$2 resumed=$3 lost=$4 seen=$5 loss0=$6 every s0 loss1
  every=$(k -n "$ns" get ptj example -o jsonpath='{.spec.checkpoint.everySteps}')
  if [[ "$resumed" != "-" ]]; then
    ((resumed >= ckpt0)) || die "$name: resumed from step $resumed, older than the newest commit $ckpt0"
    ((lost <= every)) || die "$name: $lost steps lost, more than one checkpoint interval ($every)"
  fi
  ((seen <= $(max_pods))) || die "$name: $seen pods of one generation, more than nodes.max"
  s0=$(st step)
  for _ in $(seq 150); do (($(st step) >= s0 + 10)) && break; sleep 2; done
  loss1=$(st loss)
  loss_carries_on "$loss0" "$loss1" \
    || die "$name: loss $loss1 after the fault, from $loss0 before it"
  echo "$name: resumed from ${resumed/-/no restart} (newest commit $ckpt0), $lost steps lost, loss $loss0 -> $loss1"
}

f_pod() {
  local pod; pod="example-$(st podGeneration)-1"
  echo "kubectl delete pod $pod"
  k -n "$ns" delete pod "$pod" --wait=false
}
f_node() {
  local node; node=$(k -n "$ns" get pod "example-$(st podGeneration)-0" -o jsonpath='{.spec.nodeName}')
  echo "docker kill $node (under pod 0)"
  echo "$node" > "$state/killed-node"
  docker kill "$node" >/dev/null
}
f_node_post() {
  # The node controller's taint and the operator's cordon, then the node back and repaired: the
  # job trusts it again and its pods fill both workers (a pod created to avoid that node while it
  # was down is recreated without the constraint).
  # The survivor may exit (its connections to the dead node reset) before the node controller
  # marks the node: the operator then counts the restart again once the node is judged.
  # (An earlier fault's NodeFailure is no evidence: the count must grow past the one at the fault,
  # $causes0 of measure.)
  local node causes cordoned before; node=$(cat "$state/killed-node")
  before=$(node_failures "$causes0")
  for _ in $(seq 60); do
    causes=$(st restarts.byCause)
    cordoned=$(k get node "$node" -o jsonpath='{.spec.unschedulable}')
    (($(node_failures "$causes") > before)) && [[ "$cordoned" == true ]] && break
    sleep 3
  done
  (($(node_failures "$causes") > before)) || die "node kill: no NodeFailure restart recorded ($causes0 -> $causes)"
  [[ "$cordoned" == true ]] || die "node kill: $node not cordoned"
  echo "node kill: restarts by cause $causes; $node cordoned"
  docker start "$node" >/dev/null
  k wait --for=condition=Ready "node/$node" --timeout=180s >/dev/null
  k uncordon "$node" >/dev/null
  local deadline=$((SECONDS + 300)) running g
  while ((SECONDS < deadline)); do
    g=$(st podGeneration)
    running=$(k -n "$ns" get pods -l crucible.dev/job=example --field-selector=status.phase=Running \
      --no-headers 2>/dev/null | awk -v g="example-$g-" 'index($1, g) == 1' | wc -l)
    ((running == $(max_pods))) && { echo "$node back: $running pods of generation $g Running"; return 0; }
    sleep 3
  done
  die "node kill: $node is back and uncordoned, but the job has not filled its $(max_pods) pods"
}
f_sigkill() {
  local pod pids; pod="example-$(st podGeneration)-0"
  pids=$(train_pids "$pod"); echo "kill -9 $pids in $pod"
  k -n "$ns" exec "$pod" -- sh -c "kill -9 $pids"
}
f_sigstop() {
  local pod pids; pod="example-$(st podGeneration)-0"
  pids=$(train_pids "$pod"); echo "kill -STOP $pids in $pod (hangTimeoutSeconds $(k -n "$ns" get ptj example -o jsonpath='{.spec.faultTolerance.hangTimeoutSeconds}'))"
  k -n "$ns" exec "$pod" -- sh -c "kill -STOP $pids"
}
f_pause() {
  local node; node=$(k -n "$ns" get pod "example-$(st podGeneration)-0" -o jsonpath='{.spec.nodeName}')
  echo "docker pause $node for ${CRUCIBLE_CHAOS_PAUSE_S:-60}s"
  echo "$node" > "$state/killed-node"
  docker pause "$node"; sleep "${CRUCIBLE_CHAOS_PAUSE_S:-60}"; docker unpause "$node"
}
f_pause_post() {
  # The operator judges the frozen node once it has been silent past the grace, which may be
  # after the unpause: its cordon (a quarantine of an hour) comes then, and an uncordon right
  # at the unpause lost that race once, leaving the job one node short for every later fault.
  # As after node-kill: wait for the cordon, lift it (a person's repair), and the job must fill
  # both workers again.
  local node; node=$(cat "$state/killed-node")
  for _ in $(seq 45); do
    [[ "$(k get node "$node" -o jsonpath='{.spec.unschedulable}')" == true ]] && break
    sleep 2
  done
  k uncordon "$node" >/dev/null
  wait_group_training 300
}
f_operator() {
  k -n crucible-system delete pod -l app.kubernetes.io/name=crucible-operator --wait=false
}
f_s3_pre() {
  # Stop S3 when a save is due: the step just below a multiple of checkpoint.everySteps.
  local every s; every=$(k -n "$ns" get ptj example -o jsonpath='{.spec.checkpoint.everySteps}')
  for _ in $(seq 300); do s=$(st step); (( s % every >= every - 3 )) && break; sleep 0.5; done
}
f_s3_post() {
  # The save that S3's stop interrupted is retried: a newer checkpoint than the one at the fault
  # gets committed once S3 is back.
  local before=$ckpt0 now
  for _ in $(seq 90); do
    now=$(st lastCheckpoint.step)
    ((now > before)) && { echo "S3 back: checkpoint step $now committed (newest at the fault: $before)"; return 0; }
    sleep 2
  done
  die "S3 restart: no checkpoint committed after step $before within 180 s"
}
f_s3() {
  local s cid; s=$(st step)
  cid=$(docker exec "$cluster-control-plane" crictl ps --name seaweedfs -q | head -1)
  echo "step $s: crictl stop seaweedfs container $cid"
  docker exec "$cluster-control-plane" crictl stop "$cid" >/dev/null
}

cordoned_nodes() {
  k get nodes -o jsonpath='{range .items[?(@.spec.unschedulable==true)]}{.metadata.name}{" "}{end}'
}
f_apiserver() {
  cordoned_nodes >"$state/cordoned-before"   # a node an earlier fault left cordoned is no news
  local cid; cid=$(docker exec "$cluster-control-plane" crictl ps --name kube-apiserver -q | head -1)
  echo "step $(st step): crictl stop kube-apiserver container $cid (the kubelet restarts it)"
  docker exec "$cluster-control-plane" crictl stop "$cid" >/dev/null
}
f_apiserver_post() {
  # An apiserver restart is no failure of the job: nothing restarted, no node cordoned.
  local before after; before=$(restart_count "$causes0"); after=$(restart_count "$(st restarts.byCause)")
  ((after == before)) || die "apiserver restart: $((after - before)) restart(s) of the job"
  local now; now=$(cordoned_nodes)
  [[ "$now" == "$(cat "$state/cordoned-before")" ]] \
    || die "apiserver restart: nodes cordoned: '$now', before it: '$(cat "$state/cordoned-before")'"
}

f_operator_mid_restart() {
  local gen; gen=$(st podGeneration)
  # Pod 0 (the c10d store's host): its loss restarts the whole group (a new pod generation).
  echo "kubectl delete pod example-$gen-0, then the operator pods once generation $gen is replaced"
  k -n "$ns" delete pod "example-$gen-0" --wait=false
  for _ in $(seq 300); do [[ "$(st podGeneration)" != "$gen" ]] && break; sleep 0.2; done
  [[ "$(st podGeneration)" != "$gen" ]] || die "operator kill mid-restart: no group restart within 60 s"
  echo "generation $gen -> $(st podGeneration): kubectl delete the operator pods"
  k -n crucible-system delete pod -l app.kubernetes.io/name=crucible-operator --wait=false
}
f_operator_mid_restart_post() {
  # The restart the first operator began is counted once, not again by its successor.
  local before after; before=$(restart_count "$causes0"); after=$(restart_count "$(st restarts.byCause)")
  ((after == before + 1)) || die "operator kill mid-restart: $((after - before)) restarts counted, not 1"
}

f_s3_outage() {
  local s0 s1 outage=${CRUCIBLE_CHAOS_S3_OUTAGE_S:-300}
  s0=$(st step)
  echo "step $s0: SIGSTOP the S3 server (weed) for ${outage}s"
  docker exec "$cluster-control-plane" pkill -STOP -x weed
  sleep "$outage"
  docker exec "$cluster-control-plane" pkill -CONT -x weed
  s1=$(st step)
  echo "S3 back after ${outage}s: steps $s0 -> $s1 meanwhile, newest commit $(st lastCheckpoint.step)"
  echo "$s0 $s1" >"$state/s3-outage-steps"
}
f_s3_outage_post() {
  # Training went on through the outage (more than two checkpoint intervals of steps), nothing
  # restarted, and a save after the outage commits.
  local s0 s1 every before after; read -r s0 s1 <"$state/s3-outage-steps"
  every=$(k -n "$ns" get ptj example -o jsonpath='{.spec.checkpoint.everySteps}')
  ((s1 > s0 + 2 * every)) || die "S3 outage: training stalled ($s0 -> $s1 during the outage)"
  before=$(restart_count "$causes0"); after=$(restart_count "$(st restarts.byCause)")
  ((after == before)) || die "S3 outage: $((after - before)) restart(s) of the job"
  f_s3_post
}

# Pods of the current generation Running: all nodes.max of them, and the trainer in pod 0 past a
# step after its start, within $1 seconds.
wait_group_training() {
  local deadline=$((SECONDS + $1)) g running
  while ((SECONDS < deadline)); do
    g=$(st podGeneration)
    running=$(k -n "$ns" get pods -l crucible.dev/job=example --field-selector=status.phase=Running \
      --no-headers 2>/dev/null | awk -v g="example-$g-" 'index($1, g) == 1' | wc -l)
    if ((running == $(max_pods))) && (($(steps_since_resume "example-$g-0") > 0)); then
      echo "generation $g: $running pods Running and training"; return 0
    fi
    sleep 3
  done
  die "the job's $(max_pods) pods were not all Running and training within $1 s"
}
set_min_nodes() {
  local gen; gen=$(st podGeneration)
  echo "nodes.min -> $1 (a pod-facing change: the group restarts)"
  k -n "$ns" patch ptj example --type merge -p "{\"spec\":{\"nodes\":{\"min\":$1}}}" >/dev/null
  for _ in $(seq 60); do [[ "$(st podGeneration)" != "$gen" ]] && break; sleep 2; done
  wait_group_training 600
  settle
}
f_node_worker() {
  local node gen down=${CRUCIBLE_CHAOS_NODE_DOWN_S:-60} s0 seen=0 running g
  gen=$(st podGeneration); s0=$(st step)
  node=$(k -n "$ns" get pod "example-$gen-1" -o jsonpath='{.spec.nodeName}')
  echo "docker kill $node (under pod 1; nodes.min = nodes.max: no spare node)"
  echo "$node" > "$state/killed-node"
  docker kill "$node" >/dev/null
  # The operator judges the node (NodeFailure, cordon) and restarts the group, which cannot be
  # placed: one schedulable worker for two pods. Nothing may train with one pod meanwhile.
  local deadline=$((SECONDS + 180))
  while ((SECONDS < deadline)); do
    [[ "$(k get node "$node" -o jsonpath='{.spec.unschedulable}')" == true ]] && break
    sleep 3
  done
  [[ "$(k get node "$node" -o jsonpath='{.spec.unschedulable}')" == true ]] \
    || die "node loss (worker): $node not cordoned within 180 s"
  # Steps reported until a few seconds after the cordon may still be the lost group's last ones.
  sleep 10
  s0=$(st step)
  echo "$node cordoned; the job waits ${down}s without it (step $s0)"
  deadline=$((SECONDS + down))
  while ((SECONDS < deadline)); do
    g=$(st podGeneration)
    running=$(k -n "$ns" get pods -l crucible.dev/job=example --field-selector=status.phase=Running \
      --no-headers 2>/dev/null | awk -v g="example-$g-" 'index($1, g) == 1' | wc -l)
    ((running > seen)) && seen=$running
    (($(st step) == s0)) || die "node loss (worker): the job stepped $s0 -> $(st step) with one node, below nodes.min"
    sleep 3
  done
  echo "while $node was down: phase $(st phase), step $s0 held, at most $seen pod(s) of generation $(st podGeneration) Running"
  docker start "$node" >/dev/null
  k wait --for=condition=Ready "node/$node" --timeout=180s >/dev/null
  k uncordon "$node" >/dev/null
  echo "$node started again and uncordoned"
}
f_node_worker_post() {
  # (The cordon while it was down is checked by the fault itself.)
  wait_group_training 300
}

# The operator's replicas: the Deployment, the pod holding the leader Lease (its holderIdentity
# is "<pod name>-<pid>", operator/leader.py) and the node a pod runs on.
operator_deploy() {
  k -n crucible-system get deploy -l app.kubernetes.io/name=crucible-operator -o jsonpath='{.items[0].metadata.name}'
}
leader_pod() {
  local h; h=$(k -n crucible-system get lease crucible-operator-leader -o jsonpath='{.spec.holderIdentity}' 2>/dev/null)
  echo "${h%-*}"
}
pod_node() { k -n "$1" get pod "$2" -o jsonpath='{.spec.nodeName}' 2>/dev/null || true; }

lead_from_pod0_node() {
  # Before the fault: one operator replica on the worker under pod 0, the other on the control
  # plane (required anti-affinity: never both on one node), and the one on the worker leading.
  local d node cp sel leader deleted=" " deadline
  d=$(operator_deploy); cp="$cluster-control-plane"
  node=$(pod_node "$ns" "example-$(st podGeneration)-0")
  sel=$(k -n crucible-system get deploy "$d" -o jsonpath='{.spec.selector.matchLabels}')
  k -n crucible-system get deploy "$d" -o jsonpath='{.spec.template.spec.nodeSelector}' >"$state/operator-node-selector"
  k -n crucible-system get deploy "$d" -o jsonpath='{.spec.template.spec.affinity}' >"$state/operator-affinity"
  echo "operator replicas: one on $node (under pod 0), one on $cp"
  k -n crucible-system patch deploy "$d" --type merge -p "{\"spec\":{\"template\":{\"spec\":{
    \"nodeSelector\":null,
    \"affinity\":{
      \"nodeAffinity\":{\"requiredDuringSchedulingIgnoredDuringExecution\":{\"nodeSelectorTerms\":[
        {\"matchExpressions\":[{\"key\":\"kubernetes.io/hostname\",\"operator\":\"In\",\"values\":[\"$node\",\"$cp\"]}]}]}},
      \"podAntiAffinity\":{\"requiredDuringSchedulingIgnoredDuringExecution\":[
        {\"topologyKey\":\"kubernetes.io/hostname\",\"labelSelector\":{\"matchLabels\":$sel}}]}}}}}}" >/dev/null
  k -n crucible-system rollout status deploy "$d" --timeout=300s >/dev/null
  # A leader elsewhere is deleted until the replica on $node holds the Lease (its successor on the
  # control plane is then the standby).
  deadline=$((SECONDS + 300))
  while ((SECONDS < deadline)); do
    leader=$(leader_pod)
    if [[ -n "$leader" && "$(pod_node crucible-system "$leader")" == "$node" ]]; then break; fi
    if [[ -n "$leader" && "$deleted" != *" $leader "* && -n "$(pod_node crucible-system "$leader")" ]]; then
      echo "leader $leader is on $(pod_node crucible-system "$leader"): deleting it"
      k -n crucible-system delete pod "$leader" --wait=false >/dev/null; deleted+="$leader "
    fi
    sleep 2
  done
  [[ "$(pod_node crucible-system "$leader")" == "$node" ]] || die "leader node kill: no leader on $node within 300 s"
  k -n crucible-system rollout status deploy "$d" --timeout=300s >/dev/null
  echo "$node" >"$state/killed-node"; echo "$leader" >"$state/old-leader"
  echo "leader $leader on $node; standby: $(k -n crucible-system get pod -l app.kubernetes.io/name=crucible-operator \
    --field-selector spec.nodeName="$cp",status.phase=Running -o jsonpath='{.items[*].metadata.name}') on $cp"
}
f_leader_node() {
  local node old t leader=""
  node=$(cat "$state/killed-node"); old=$(cat "$state/old-leader"); t=$SECONDS
  echo "docker kill $node (under the operator leader $old and pod 0)"
  docker kill "$node" >/dev/null
  # The standby takes the Lease once it has not changed for its duration (operator/leader.py).
  while ((SECONDS - t < 120)); do
    leader=$(leader_pod)
    [[ -n "$leader" && "$leader" != "$old" ]] && break
    sleep 1
  done
  [[ -n "$leader" && "$leader" != "$old" ]] || die "leader node kill: the Lease still names $old after 120 s"
  echo "new leader $leader on $(pod_node crucible-system "$leader") $((SECONDS - t)) s after the kill"
}
f_leader_node_post() {
  # The new leader judged the node (NodeFailure, cordon) and, once it is back, the job uses it.
  f_node_post
}
restore_operator() {
  # The operator's placement before leader-node-kill (the chart's nodeSelector and affinity).
  local d sel aff; d=$(operator_deploy)
  sel=$(cat "$state/operator-node-selector"); aff=$(cat "$state/operator-affinity")
  k -n crucible-system patch deploy "$d" --type merge \
    -p "{\"spec\":{\"template\":{\"spec\":{\"nodeSelector\":${sel:-null},\"affinity\":${aff:-null}}}}}" >/dev/null
  # The rolling update alone deadlocks: the new pods go to the control plane, where the standby
  # of the old revision sits with its required anti-affinity against them. The old pods go now
  # (the new leader takes over as after operator-delete).
  sleep 2
  k -n crucible-system delete pod -l app.kubernetes.io/name=crucible-operator --wait=false >/dev/null
  k -n crucible-system rollout status deploy "$d" --timeout=300s >/dev/null
  echo "operator replicas back on: $(k -n crucible-system get pod -l app.kubernetes.io/name=crucible-operator \
    -o jsonpath='{range .items[*]}{.spec.nodeName}{" "}{end}')"
}

# --- kueue ---------------------------------------------------------------------------------------
jst() { k -n "$ns" get ptj "$1" -o jsonpath="{.status.$2}" 2>/dev/null || true; }
# A job of the example's spec in the LocalQueue `team` (e2e/kind/kueue-queues.yaml): $1 its name,
# $2 its WorkloadPriorityClass, $3 its training tokens; 2 pods, no elastic slack; its checkpoints
# under a prefix of this run's own (an earlier run's commits must not be what it resumes).
queued_job() {
  k create --dry-run=client -o json -f "$here/pretrainjob.yaml" | python3 -c '
import json, sys
job = json.load(sys.stdin)
name, priority, tokens, run = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
job["metadata"] = {"name": name, "namespace": job["metadata"]["namespace"], "labels": {
    "kueue.x-k8s.io/queue-name": "team", "kueue.x-k8s.io/priority-class": priority}}
job["spec"]["nodes"] = {"min": 2, "max": 2}
job["spec"]["training"]["tokens"] = tokens
job["spec"]["checkpoint"]["uri"] = f"s3://crucible/runs/{name}-{run}"
print(json.dumps(job))' "$1" "$2" "$3" "$state_run" | k apply -f - >/dev/null
}
# Pods of the two queued jobs that hold or may take node room: not yet Succeeded or Failed
# (pending and terminating ones included).
queued_pods() {
  k -n "$ns" get pods -l 'crucible.dev/job in (queued-low,queued-high)' \
    --field-selector=status.phase!=Succeeded,status.phase!=Failed --no-headers 2>/dev/null | wc -l
}
preemptions() { python3 -c 'import json, sys; print(json.loads(sys.argv[1] or "{}").get("Preempted", 0))' "$1"; }

f_kueue() {
  # The example job is suspended meanwhile: the queue's quota is the room it takes.
  local state_run every s0 c0 g0 causes0 causes1 loss0 loss1 cq resumed="-" first="" seen=0 high_done=no
  local n g r deadline t0 lost="-" ok=true why=()
  state_run=$(date +%s); every=$(k -n "$ns" get ptj example -o jsonpath='{.spec.checkpoint.everySteps}')
  k apply -f "$here/kueue-queues.yaml" >/dev/null
  echo "example suspended; queued-low (WorkloadPriorityClass crucible-kind-low) applied to LocalQueue team"
  k -n "$ns" patch ptj example --type merge -p '{"spec":{"suspend":true}}' >/dev/null
  k -n "$ns" wait --for=delete pod -l crucible.dev/job=example --timeout=300s >/dev/null 2>&1 || true
  queued_job queued-low crucible-kind-low 40000000
  deadline=$((SECONDS + 600))
  while ((SECONDS < deadline)); do
    [[ "$(jst queued-low phase)" == Running && -n "$(jst queued-low lastCheckpoint.step)" ]] && break
    sleep 3
  done
  [[ -n "$(jst queued-low lastCheckpoint.step)" ]] \
    || die "kueue: queued-low has no commit within 600 s (phase $(jst queued-low phase): $(k -n "$ns" get ptj queued-low -o jsonpath='{.status.conditions[?(@.type=="Admitted")].message}'))"
  cq=$(k -n "$ns" get workloads.kueue.x-k8s.io -l crucible.dev/job=queued-low -o jsonpath='{.items[0].status.admission.clusterQueue}')
  g0=$(jst queued-low podGeneration); s0=$(jst queued-low step); c0=$(jst queued-low lastCheckpoint.step)
  causes0=$(jst queued-low restarts.byCause); loss0=$(jst queued-low loss)
  echo "queued-low admitted by ClusterQueue '$cq', generation $g0, step $s0, newest commit $c0: queued-high (crucible-kind-high, 60 steps) applied"
  t0=$SECONDS
  queued_job queued-high crucible-kind-high $((60 * 4096))
  # Kueue preempts queued-low; the operator deletes its pods as one unit and releases the quota;
  # queued-high is admitted, trains its 60 steps and succeeds; queued-low is admitted again and
  # resumes from its newest commit. The two jobs' pods never take more than the quota's 2.
  deadline=$((SECONDS + 900))
  while ((SECONDS < deadline)); do
    n=$(queued_pods); ((n > seen)) && seen=$n
    [[ "$(jst queued-high phase)" == Succeeded ]] && high_done=yes
    g=$(jst queued-low podGeneration)
    if [[ "$g" != "$g0" ]]; then
      mapfile -t r < <(resumes "queued-low-$g-0")
      if ((${#r[@]})) && (($(steps_since_resume "queued-low-$g-0") > 0)); then
        resumed=${r[-1]}; first=$((SECONDS - t0)); break
      fi
    fi
    sleep 2
  done
  causes1=$(jst queued-low restarts.byCause)
  echo "queued-high: $(jst queued-high phase); queued-low: generation $g0 -> $(jst queued-low podGeneration), resumed from $resumed, restarts $causes0 -> $causes1"
  if [[ -z "$first" ]]; then
    why+=("queued-low did not resume within 900 s (its Admitted condition: $(k -n "$ns" get ptj queued-low -o jsonpath='{.status.conditions[?(@.type=="Admitted")].message}'))")
  else
    lost=$((s0 > resumed ? s0 - resumed : 0))
    ((resumed >= c0)) || why+=("resumed from step $resumed, older than the newest commit $c0")
    ((lost <= every)) || why+=("$lost steps lost, more than one checkpoint interval ($every)")
  fi
  [[ "$cq" == crucible-kind ]] || why+=("queued-low was not admitted through ClusterQueue crucible-kind ('$cq')")
  [[ "$high_done" == yes ]] || why+=("queued-high did not succeed before queued-low resumed")
  (($(preemptions "$causes1") == $(preemptions "$causes0") + 1)) \
    || why+=("restarts by cause $causes0 -> $causes1: not one Preempted")
  ((seen <= 2)) || why+=("$seen pods of the two jobs at once, over the quota's 2")
  if [[ -n "$first" ]]; then
    for _ in $(seq 150); do (($(jst queued-low step) >= resumed + 10)) && break; sleep 2; done
    loss1=$(jst queued-low loss)
    loss_carries_on "$loss0" "$loss1" \
      || why+=("loss $loss1 after the preemption, from $loss0 before it")
    echo "queued-low: loss $loss0 -> $loss1"
  fi
  ((${#why[@]} == 0)) || ok=false
  row kueue-preempt "${causes0:-{\}} -> ${causes1:-{\}}" "${first:-timeout}" "$s0" "$resumed" "$lost" no "$seen/2" "$ok"
  # Put back: the queued jobs gone, the example resumed.
  k -n "$ns" delete ptj queued-low queued-high --wait=true --timeout=180s >/dev/null
  k -n "$ns" patch ptj example --type merge -p '{"spec":{"suspend":false}}' >/dev/null
  wait_group_training 600
  ((${#why[@]} == 0)) || die "kueue-preempt: $(IFS=';'; echo "${why[*]}")"
}

netpol() {
  local pod0 ip other=crucible-netpol-probe code
  pod0="example-$(st podGeneration)-0"; ip=$(k -n "$ns" get pod "$pod0" -o jsonpath='{.status.podIP}')
  k create namespace "$other" --dry-run=client -o yaml | k apply -f - >/dev/null
  # A probe whose container could not even start (runc on a cgroup v1 node that was just
  # frozen by node-pause: "unable to freeze", seen once) says nothing: tried again, twice at most.
  local try phase
  for try in 1 2 3; do
    k -n "$other" delete pod probe --ignore-not-found --wait=true >/dev/null
    k -n "$other" run probe --restart=Never --image "registry.k8s.io/kube-proxy:$k8s_version" \
      --image-pull-policy=Never --command -- bash -c "timeout 5 bash -c 'exec 3<>/dev/tcp/$ip/29400' && echo OPEN || echo BLOCKED" >/dev/null
    for _ in $(seq 60); do
      phase=$(k -n "$other" get pod probe -o jsonpath='{.status.phase}')
      [[ "$phase" == Succeeded || "$phase" == Failed ]] && break
      sleep 2
    done
    [[ "$phase" == Succeeded ]] && break
    echo "netpol: probe pod $phase ($(k -n "$other" get pod probe -o jsonpath='{.status.containerStatuses[0].state.terminated.reason}')), try $try of 3"
  done
  [[ "$phase" == Succeeded ]] || die "netpol: the probe pod never ran ($phase)"
  code=$(k -n "$other" logs probe | tail -1)
  local s0 s1; s0=$(st step); sleep 20; s1=$(st step)
  echo "netpol: from $other to $ip:29400: $code; job steps $s0 -> $s1 in 20 s"
  k delete namespace "$other" --wait=false >/dev/null
  local ok=false; [[ "$code" == BLOCKED ]] && ((s1 > s0)) && ok=true
  row netpol-probe "$(st restarts.byCause)" - "$s0" - 0 no - "$ok"
  [[ "$ok" == true ]] || die "netpol: expected BLOCKED from $other and a training job"
}

ALL=(pod-delete node-kill sigkill sigstop node-pause operator-delete s3-restart-mid-save netpol-probe
     apiserver-restart operator-kill-mid-restart s3-outage-5min node-loss-worker leader-node-kill kueue)
(($#)) || set -- "${ALL[@]}"
state=$(mktemp -d); trap 'rm -rf "$state"' EXIT
for fault in "$@"; do
  case "$fault" in
    pod-delete) expect_restart=1 measure pod-delete f_pod ;;
    node-kill) expect_restart=1 measure node-kill f_node ;;
    sigkill) expect_restart=1 measure sigkill f_sigkill ;;
    sigstop) expect_restart=1 measure sigstop f_sigstop ;;
    node-pause) expect_restart=1 measure "node-pause-${CRUCIBLE_CHAOS_PAUSE_S:-60}s" f_pause ;;
    operator-delete) min_quiet=5 measure operator-delete f_operator ;;
    s3-restart-mid-save) min_quiet=5 measure s3-restart-mid-save f_s3 ;;
    netpol-probe) netpol ;;
    apiserver-restart) min_quiet=10 measure apiserver-restart f_apiserver ;;
    operator-kill-mid-restart) expect_restart=1 measure operator-kill-mid-restart f_operator_mid_restart ;;
    s3-outage-5min) min_quiet=5 measure s3-outage-5min f_s3_outage ;;
    node-loss-worker)
      max=$(max_pods); min0=$(k -n "$ns" get ptj example -o jsonpath='{.spec.nodes.min}')
      ((min0 == max)) || set_min_nodes "$max"
      expect_restart=1 measure node-loss-worker f_node_worker
      ((min0 == max)) || set_min_nodes "$min0" ;;
    leader-node-kill)
      lead_from_pod0_node
      expect_restart=1 measure leader-node-kill f_leader_node
      restore_operator ;;
    kueue) f_kueue ;;
    *) die "unknown fault $fault (one of: ${ALL[*]})" ;;
  esac
done
