#!/usr/bin/env bash
# End to end on a kind cluster, for users with Docker:
#   e2e/kind/run.sh [up|chaos|pytest|down|all]      (default: all = up, chaos, pytest)
# up:     create the kind cluster (e2e/kind/cluster.sh: kind, its node image and every image the
#         nodes run are built from source on this machine, no registry), build the app images
#         (make images), load them, install the chart (operator on the control-plane node), start
#         S3 (SeaweedFS), apply the CPU example PretrainJob (e2e/kind/pretrainjob.yaml);
# chaos:  once a checkpoint is committed, delete a worker pod, then kill the node container
#         under pod 0, and check the job resumes from its checkpoint and trains past it;
# pytest: the repository's cluster tests that need only an apiserver, against this cluster
#         (tests/conftest.py reads CRUCIBLE_STACK_ENV, written here to e2e/kind/.env);
# down:   delete the cluster.
# More faults (kill -9, SIGSTOP, docker pause, operator restart, S3 restart, a NetworkPolicy
# probe): e2e/kind/chaos.sh after `up`. S3 is the local stack's weed on the kind slim base
# (e2e/kind/s3-image.sh); the example image goes to the workers only, gzipped (e2e/kind/load-image.sh).
# Needs: a Docker engine (e2e/host/docker.sh), Go >= 1.26, root (debootstrap), and the Python
# venv (`make venv`) for pytest. kind, kubectl and helm are built into ~/.cache/crucible (helm by
# the local stack: e2e/stack.sh). See docs/kind.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cluster="${CRUCIBLE_KIND_CLUSTER:-crucible-e2e}"
ctx="kind-$cluster"
ns=crucible-e2e
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")"
# CRUCIBLE_KIND_OPERATOR_IMAGE: another operator image tag to install (loaded like the default one).
operator_image="${CRUCIBLE_KIND_OPERATOR_IMAGE:-crucible-operator:$version}"
trainer_image="crucible-trainer:$version"
example_image="crucible-trainer-example:$version"
venv="${CRUCIBLE_VENV:-$HOME/.cache/crucible/venv}"
# kind (bins.sh), helm (the local stack's build) and kubectl (bins.sh) as built here come first.
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}"
k8s_version="$(sed -n 's/^K8S_VERSION=//p' "$here/lib.sh")"
export PATH="$cache/bin:$cache/kind/bin/kube-$k8s_version:$PATH"
k() { kubectl --context "$ctx" "$@"; }
say() { printf '\n== %s\n' "$*"; }
die() { echo "kind e2e: $*" >&2; exit 1; }

# Poll a command until it prints something non-empty, or fail after $1 seconds.
wait_for() {
  local timeout=$1 what=$2; shift 2
  local deadline=$((SECONDS + timeout)) out
  while ((SECONDS < deadline)); do
    out="$("$@" 2>/dev/null || true)"
    if [[ -n "$out" ]]; then echo "$out"; return 0; fi
    sleep 3
  done
  die "timed out after ${timeout}s waiting for $what"
}

# True when every node in the comma-separated list $2 already holds image $1 with the ID docker
# has for it (kind load re-imports 6.6 GB otherwise).
images_loaded() {
  local want node
  want=$(docker image inspect -f '{{.Id}}' "$1")
  for node in ${2//,/ }; do
    docker exec "$node" crictl images --no-trunc -o json 2>/dev/null | grep -q "\"$want\"" || return 1
  done
}

status() { k -n "$ns" get ptj example -o jsonpath="{.status.$1}"; }

up() {
  command -v docker >/dev/null || die "docker is not on PATH"
  say "kind cluster $cluster"
  CRUCIBLE_KIND_CLUSTER="$cluster" "$here/cluster.sh" up
  for tool in kind kubectl helm; do
    command -v "$tool" >/dev/null || die "$tool is not on PATH"
  done
  say "images"
  # --no-print-directory: with -C, make passes -w to the sub-make that streams each image's build
  # context, whose "Entering directory" line would then lead the tar on stdout (docker: "ambiguous
  # Dockerfile source").
  # Built once: `make images` again only when an image is missing or CRUCIBLE_KIND_REBUILD=1 (the
  # trainer image is ~6.6 GB; a build without a warm layer cache takes many minutes and the disk).
  if [[ "${CRUCIBLE_KIND_REBUILD:-0}" == 1 ]] || ! docker image inspect "$operator_image" "$trainer_image" >/dev/null 2>&1; then
    MAKEFLAGS=--no-print-directory make -C "$repo" images
  else
    echo "$operator_image and $trainer_image exist (CRUCIBLE_KIND_REBUILD=1 rebuilds them)"
  fi
  docker build -f "$here/Dockerfile.example" --build-arg "TRAINER_IMAGE=$trainer_image" \
    -t "$example_image" "$here"
  s3_image="$("$here/s3-image.sh")"
  # The trainer image (6.6 GB unpacked) only on the workers, where training runs: loading it into
  # the control plane too would cost another ~10 GB of disk for nothing. The operator
  # and S3 run on the control-plane node; they are small and go everywhere.
  local workers
  workers=$(k get nodes -l '!node-role.kubernetes.io/control-plane' \
    -o jsonpath='{range .items[*]}{.metadata.name},{end}')
  kind load docker-image --name "$cluster" "$operator_image" "$s3_image"
  if ! images_loaded "$example_image" "${workers%,}"; then
    # Not `kind load`: its uncompressed layers cost ~13 GB a node (e2e/kind/load-image.sh).
    "$here/load-image.sh" "$example_image" ${workers//,/ }
  fi
  say "chart"
  helm --kube-context "$ctx" upgrade --install crucible "$repo/charts/crucible" \
    --namespace crucible-system --create-namespace --wait --timeout 180s \
    --set image.repository=crucible-operator --set "image.tag=${operator_image#*:}" \
    --set-json 'operator.nodeSelector={"node-role.kubernetes.io/control-plane":""}' \
    --set-json 'operator.tolerations=[{"key":"node-role.kubernetes.io/control-plane","operator":"Exists","effect":"NoSchedule"}]'
  say "S3 and the example job"
  k create namespace "$ns" --dry-run=client -o yaml | k apply -f -
  k apply -f "$here/seaweedfs.yaml"
  k -n "$ns" rollout status deployment/seaweedfs --timeout 180s
  k -n "$ns" delete pod make-bucket --ignore-not-found
  k -n "$ns" run make-bucket --image "$example_image" --restart Never \
    --overrides '{"spec":{"containers":[{"name":"make-bucket","image":"'"$example_image"'","envFrom":[{"secretRef":{"name":"s3-creds"}}],"command":["python3","-c","import boto3; s3 = boto3.client(\"s3\"); s3.create_bucket(Bucket=\"crucible\") if \"crucible\" not in [b[\"Name\"] for b in s3.list_buckets()[\"Buckets\"]] else None"]}]}}'
  wait_for 180 "the bucket (kubectl -n $ns logs make-bucket)" bash -c \
    "kubectl --context $ctx -n $ns get pod make-bucket -o jsonpath='{.status.phase}' | grep -x Succeeded"
  k apply -f "$here/pretrainjob.yaml"
  wait_for 300 "the example job Running" bash -c \
    "kubectl --context $ctx -n $ns get ptj example -o jsonpath='{.status.phase}' | grep -x Running"
}

chaos() {
  say "wait for a committed checkpoint"
  local ckpt gen step pod0 node restarts
  ckpt=$(wait_for 900 "a checkpoint" status lastCheckpoint.step)
  echo "checkpoint at step $ckpt"

  say "delete a worker pod: the survivors re-rendezvous, the operator recreates it"
  gen=$(status podGeneration)
  step=$(status step)
  k -n "$ns" delete pod "example-$gen-1" --wait=false
  wait_for 300 "step to pass $step after the pod deletion" bash -c \
    "s=\$(kubectl --context $ctx -n $ns get ptj example -o jsonpath='{.status.step}'); (( s > $step )) && echo \$s"
  wait_for 300 "the pod recreated and Running" bash -c \
    "kubectl --context $ctx -n $ns get pod example-$gen-1 -o jsonpath='{.status.phase}' | grep -x Running"

  say "kill the node under pod 0: the operator restarts the group elsewhere, it resumes"
  gen=$(status podGeneration)
  pod0="example-$gen-0"
  node=$(k -n "$ns" get pod "$pod0" -o jsonpath='{.spec.nodeName}')
  ckpt=$(status lastCheckpoint.step)
  echo "pod 0 on $node; newest checkpoint step $ckpt"
  docker kill "$node"
  wait_for 300 "a new generation" bash -c \
    "g=\$(kubectl --context $ctx -n $ns get ptj example -o jsonpath='{.status.podGeneration}'); (( g > $gen )) && echo \$g"
  # status.step still holds the old generation's last step until the new one reports: wait for
  # the new pod 0's "resumed from" first, then for a step past it.
  pod0="example-$(status podGeneration)-0"
  local resumed
  resumed=$(wait_for 600 "$pod0 to resume from a checkpoint" bash -c \
    "kubectl --context $ctx -n $ns logs $pod0 2>/dev/null | sed -n 's/.*resumed from .*(step \\([0-9]*\\).*/\\1/p' | head -1")
  echo "$pod0 resumed from step $resumed"
  (( resumed >= ckpt )) || die "$pod0 resumed from step $resumed, older than the newest checkpoint $ckpt"
  wait_for 600 "the new generation to train past step $resumed" bash -c \
    "s=\$(kubectl --context $ctx -n $ns get ptj example -o jsonpath='{.status.step}'); (( s > $resumed )) && echo \$s"
  restarts=$(k -n "$ns" get ptj example -o jsonpath='{.status.restarts.byCause}')
  echo "restarts by cause: $restarts"
  [[ "$restarts" == *NodeFailure* ]] || die "no NodeFailure restart recorded"
  k get node "$node" -o jsonpath='{.spec.unschedulable}' | grep -qx true || die "$node not cordoned"
  # The node back, and trusted again (the operator avoids a node it cordoned until uncordoned).
  docker start "$node"
  k wait --for=condition=Ready "node/$node" --timeout=180s
  k uncordon "$node"
  say "chaos survived: resumed from step $ckpt after a pod deletion and a node loss"
}

pytest_suite() {
  say "pytest against the kind cluster"
  local kubeconfig="$here/.kubeconfig"
  kind get kubeconfig --name "$cluster" > "$kubeconfig"
  local workers
  workers=$(k get nodes -l '!node-role.kubernetes.io/control-plane' \
    -o jsonpath='{range .items[*]}{.metadata.name},{end}')
  cat > "$here/.env" <<ENV
export KUBECONFIG=$kubeconfig
export CRUCIBLE_KWOK_NODE_NAMES=${workers%,}
export CRUCIBLE_KWOK_LABEL=crucible.dev/kwok-not-used
ENV
  # The chart tests install a second release serving their own namespace, with the real operator
  # image; the CRD and invalid-spec tests need only the apiserver. The other cluster tests drive
  # KWOK's fake pods and the local stack's file-SD Prometheus, which kind does not have.
  (cd "$repo" && CRUCIBLE_STACK_ENV="$here/.env" CRUCIBLE_OPERATOR_IMAGE="$operator_image" \
    "$venv/bin/python" -m pytest tests/ship/test_chart.py tests/operator/test_invalid_specs.py -q)
}

down() { CRUCIBLE_KIND_CLUSTER="$cluster" "$here/cluster.sh" down; }

case "${1:-all}" in
  up) up ;;
  chaos) chaos ;;
  pytest) pytest_suite ;;
  down) down ;;
  all) up; chaos; pytest_suite ;;
  *) die "usage: $0 [up|chaos|pytest|down|all]" ;;
esac
