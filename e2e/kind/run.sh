#!/usr/bin/env bash
# End to end on a kind cluster, for users with Docker:
#   e2e/kind/run.sh [up|chaos|pytest|down|all]      (default: all = up, chaos, pytest)
# up:     start a Docker engine if none answers (e2e/host/docker.sh), create the kind cluster
#         unless it exists (e2e/kind/cluster.sh: kind, its node image and every image the nodes
#         run are built from source on this machine, no registry), build the app images (make
#         local-images, as `make test KIND=1` does: the Debian base made here unless it exists,
#         used where the Dockerfiles' public base is not in the image store; Docker's layer
#         cache makes a rebuild seconds when nothing changed), load those
#         the nodes lack, install Kueue (its own chart, e2e/kind/kueue-values.yaml) and the
#         chart (operator and Kueue on the control-plane node), start S3
#         (SeaweedFS), and start the CPU example PretrainJob (e2e/kind/pretrainjob.yaml) afresh:
#         an earlier run's job and its checkpoints are deleted first. Then checks that the
#         operator's and the trainer's pods run the images `docker images` lists (same image ID);
# chaos:  every fault of e2e/kind/chaos.sh (pod deletion, node loss, kill -9, a hang, a frozen
#         node, operator and S3 restarts, the NetworkPolicy probe, an apiserver restart, the
#         operator killed mid-restart, a 5-minute S3 outage, a node lost with no elastic slack,
#         the operator leader's node killed, a Kueue preemption and re-admission),
#         each checked from outside;
# pytest: the repository's cluster tests that need only an apiserver, against this cluster
#         (tests/conftest.py reads CRUCIBLE_STACK_ENV, written here to e2e/kind/.env);
# down:   delete the cluster.
# The cluster is kept after a run, so the next one reuses it (and the images its nodes hold).
# S3 is the local stack's weed on the kind slim base (e2e/kind/binary-image.sh); the example image
# goes to the workers only, gzipped (e2e/kind/load-image.sh). Seconds per part are appended to
# ~/.cache/crucible/kind/logs/timings.
# Needs: root (the Docker engine, debootstrap), Go >= 1.26, the local stack's binaries
# (e2e/stack.sh: weed and helm) and the Python venv (`make venv`) for pytest. kind, kubectl and
# helm are built into ~/.cache/crucible. See docs/kind.md.
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
say() { printf '\n== %s  %s\n' "$(date -u +%T)" "$*"; }
die() { echo "kind e2e: $*" >&2; exit 1; }
klog="$cache/kind/logs"
mkdir -p "$klog"

# part NAME CMD...: run one part of the run and append its seconds to $klog/timings.
part() {
  local name=$1 start=$SECONDS; shift
  "$@"
  printf '%s %s %ds rc=0\n' "$(date -Is)" "$name" $((SECONDS - start)) >>"$klog/timings"
  say "$name: $((SECONDS - start))s"
}

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
# has for it (a load re-imports gigabytes otherwise): looked up by name through the CRI.
images_loaded() {
  local want node ref=$1
  want=$(docker image inspect -f '{{.Id}}' "$1")
  [[ "$ref" == */* ]] || ref="docker.io/library/$ref"
  for node in ${2//,/ }; do
    [[ "$(docker exec "$node" crictl inspecti -o go-template --template '{{.status.id}}' "$ref" 2>/dev/null)" == "$want" ]] \
      || return 1
  done
}

status() { k -n "$ns" get ptj example -o jsonpath="{.status.$1}"; }

workers() {
  k get nodes -l '!node-role.kubernetes.io/control-plane' \
    -o jsonpath='{range .items[*]}{.metadata.name}{" "}{end}'
}

# Images on node $2 that an earlier load left, other than image ID $3: those of repository $1, and
# those only named by digest by an import (`ctr images import --digests` adds an import-DATE@sha256
# name, which outlives the tag once a newer image takes it).
stale_images() {
  docker exec "$2" crictl images -o json | python3 -c '
import json, sys
repo, keep = sys.argv[1], sys.argv[2]
for image in json.load(sys.stdin)["images"]:
    names = (image.get("repoTags") or []) + (image.get("repoDigests") or [])
    ours = [n for n in names if n.split("@")[0].rsplit(":", 1)[0].endswith("/" + repo)]
    imported = names and all(n.split("@")[0].rsplit("/", 1)[-1].startswith("import-") for n in names)
    if image["id"] != keep and (ours or imported):
        print(image["id"])' "$1" "$3"
}

build_images() {
  # --no-print-directory: with -C, make passes -w to the sub-make that streams each image's build
  # context, whose "Entering directory" line would then lead the tar on stdout (docker: "ambiguous
  # Dockerfile source").
  MAKEFLAGS=--no-print-directory make -C "$repo" local-images
  docker build -q -f "$here/Dockerfile.example" --build-arg "TRAINER_IMAGE=$trainer_image" \
    -t "$example_image" "$here"
  s3_image="$("$here/binary-image.sh" weed)"
  kueue_image="$("$here/binary-image.sh" kueue)"
  docker images --format '{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}' \
    | grep -E "^(${operator_image%:*}|${trainer_image%:*}|${example_image%:*}|${s3_image%:*}|${kueue_image%:*}):"
}

# The example job and its checkpoints from an earlier run, gone (its pods too: the image they
# hold cannot be replaced on the nodes while they run).
reset_job() {
  if k -n "$ns" get ptj example >/dev/null 2>&1; then
    k -n "$ns" delete ptj example --wait=true --timeout=180s
  fi
  k -n "$ns" delete pod make-bucket --ignore-not-found --wait=true --timeout=120s
  k -n "$ns" wait --for=delete pod -l crucible.dev/job=example --timeout=180s 2>/dev/null || true
}

# Leases of an import that was cut off on node $1: they keep its content from containerd's
# garbage collection for 24 hours (images themselves are removed through the CRI, crictl rmi:
# removing them with ctr behind its back leaves the CRI listing images that are gone).
clean_leases() {
  docker exec "$1" sh -c '
    now=$(date +%s)
    ctr -n k8s.io leases ls | tail -n +2 | while read -r id created _; do
      [ $((now - $(date -d "$created" +%s))) -gt 600 ] && ctr -n k8s.io leases rm "$id"
    done' >/dev/null 2>&1 || true
}

load_images() {
  local node id
  # The trainer image (6.6 GB unpacked) only on the workers, where training runs: loading it into
  # the control plane too would cost another ~10 GB of disk for nothing. The operator, S3 and
  # Kueue run on the control-plane node; they are small and go everywhere.
  for image in "$operator_image" "$s3_image" "$kueue_image"; do
    images_loaded "$image" "$(k get nodes -o jsonpath='{range .items[*]}{.metadata.name},{end}')" \
      || kind load docker-image --name "$cluster" "$image"
  done
  id=$(docker image inspect -f '{{.Id}}' "$example_image")
  # An earlier example image is dropped from the workers first: each costs ~10 GB a node.
  for node in $(workers); do
    clean_leases "$node"
    for stale in $(stale_images "${example_image%:*}" "$node" "$id"); do
      # One still in use (a pod of another job, say) stays; the load then needs more room.
      docker exec "$node" crictl rmi "$stale" >/dev/null 2>&1 || echo "$node: $stale is in use; kept"
    done
  done
  local w; w=$(workers)
  if ! images_loaded "$example_image" "${w// /,}"; then
    # Not `kind load`: its uncompressed layers cost ~13 GB a node (e2e/kind/load-image.sh).
    "$here/load-image.sh" "$example_image" $w
  fi
}

# Kueue, with its own Helm chart from the Kueue module the local stack pins (e2e/stack/build.py;
# the Go module cache has it once the stack is built) and e2e/kind/kueue-values.yaml. Before the
# operator's chart: the operator watches Kueue's Workloads when their API exists at its start.
install_kueue() {
  local version chart
  version="${kueue_image#*:}"
  chart="$(go mod download -json "sigs.k8s.io/kueue@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')/charts/kueue"
  [[ -f "$chart/Chart.yaml" ]] || die "no Kueue chart at $chart"
  helm --kube-context "$ctx" upgrade --install kueue "$chart" --namespace kueue-system \
    --create-namespace --wait --timeout 300s -f "$here/kueue-values.yaml" \
    --set controllerManager.manager.image.repository="${kueue_image%:*}" \
    --set controllerManager.manager.image.tag="$version"
  # Its webhooks answer once its internal certificate is in place: a dry-run object they admit.
  wait_for 180 "Kueue's webhooks" bash -c "kubectl --context $ctx apply --dry-run=server -f - <<<'
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: crucible-webhook-probe}' >/dev/null && echo ok"
}

install_chart() {
  # A rebuilt image keeps its tag: the image ID as a pod annotation makes the Deployment roll
  # whenever the image changes (the nodes never pull, so the tag alone would not).
  helm --kube-context "$ctx" upgrade --install crucible "$repo/charts/crucible" \
    --namespace crucible-system --create-namespace --wait --timeout 180s \
    --set image.repository=crucible-operator --set "image.tag=${operator_image#*:}" \
    --set-string "operator.podAnnotations.crucible\.dev/image-id=$(docker image inspect -f '{{.Id}}' "$operator_image" | tr : -)" \
    --set-json 'operator.nodeSelector={"node-role.kubernetes.io/control-plane":""}' \
    --set-json 'operator.tolerations=[{"key":"node-role.kubernetes.io/control-plane","operator":"Exists","effect":"NoSchedule"}]'
  k -n crucible-system rollout status deployment -l app.kubernetes.io/name=crucible-operator --timeout=180s
}

start_job() {
  k create namespace "$ns" --dry-run=client -o yaml | k apply -f -
  k apply -f "$here/seaweedfs.yaml"
  k -n "$ns" rollout status deployment/seaweedfs --timeout 180s
  # The bucket, empty of the example's earlier checkpoints.
  k -n "$ns" delete pod make-bucket --ignore-not-found
  k -n "$ns" run make-bucket --image "$example_image" --restart Never \
    --overrides '{"spec":{"containers":[{"name":"make-bucket","image":"'"$example_image"'","envFrom":[{"secretRef":{"name":"s3-creds"}}],"command":["python3","-c","import boto3; b = boto3.resource(\"s3\").Bucket(\"crucible\"); b.create() if b.creation_date is None else None; b.objects.filter(Prefix=\"runs/example/\").delete()"]}]}}'
  wait_for 180 "the bucket (kubectl -n $ns logs make-bucket)" bash -c \
    "kubectl --context $ctx -n $ns get pod make-bucket -o jsonpath='{.status.phase}' | grep -x Succeeded"
  k -n "$ns" delete pod make-bucket --wait=false   # it would hold the image on its node
  k apply -f "$here/pretrainjob.yaml"
  wait_for 300 "the example job Running" bash -c \
    "kubectl --context $ctx -n $ns get ptj example -o jsonpath='{.status.phase}' | grep -x Running"
}

# The image ID a pod's container runs, from its node's container runtime (CRI ContainerStatus
# imageId: the config digest, which `docker images` shows). The pod status's imageID is a
# repository digest instead, which `docker save` + import changes.
pod_image_id() {
  local node cid
  node=$(k -n "$1" get pod "$2" -o jsonpath='{.spec.nodeName}')
  cid=$(k -n "$1" get pod "$2" -o jsonpath='{.status.containerStatuses[0].containerID}')
  docker exec "$node" crictl inspect -o go-template --template '{{.status.imageId}}' "${cid#*://}"
}

check_image_ids() {
  local pod want got
  wait_for 300 "pod example-$(status podGeneration)-0 Running" bash -c \
    "kubectl --context $ctx -n $ns get pod example-\$(kubectl --context $ctx -n $ns get ptj example -o jsonpath='{.status.podGeneration}')-0 -o jsonpath='{.status.phase}' | grep -x Running" >/dev/null
  local pairs=("$ns example-$(status podGeneration)-0 $example_image")
  for pod in $(k -n crucible-system get pod -l app.kubernetes.io/name=crucible-operator -o go-template \
      --template '{{range .items}}{{if not .metadata.deletionTimestamp}}{{.metadata.name}} {{end}}{{end}}'); do
    pairs+=("crucible-system $pod $operator_image")
  done
  for pair in "${pairs[@]}"; do
    read -r pns pod image <<<"$pair"
    want=$(docker image inspect -f '{{.Id}}' "$image")
    got=$(pod_image_id "$pns" "$pod")
    [[ "$got" == "$want" ]] || die "$pns/$pod runs image $got, but docker has $image as $want"
    echo "$pns/$pod runs $image, image ID $got (= docker images)"
  done
}

up() {
  part docker-engine "$repo/e2e/host/docker.sh"
  say "kind cluster $cluster"
  part cluster env CRUCIBLE_KIND_CLUSTER="$cluster" "$here/cluster.sh" up
  for tool in kind kubectl helm; do
    command -v "$tool" >/dev/null || die "$tool is not on PATH"
  done
  say "images"
  part app-images build_images
  part reset-job reset_job
  part load-images load_images
  say "Kueue and the chart"
  part kueue install_kueue
  part chart install_chart
  say "S3 and the example job"
  part start-job start_job
  part image-ids check_image_ids
}

chaos() {
  say "chaos (e2e/kind/chaos.sh); results in $klog/chaos-results.tsv"
  part chaos env CRUCIBLE_KIND_CLUSTER="$cluster" "$here/chaos.sh"
}

pytest_suite() {
  say "pytest against the kind cluster"
  local kubeconfig="$here/.kubeconfig"
  kind get kubeconfig --name "$cluster" > "$kubeconfig"
  local names
  names=$(workers)
  names=${names% }
  cat > "$here/.env" <<ENV
export KUBECONFIG=$kubeconfig
export CRUCIBLE_KWOK_NODE_NAMES=${names// /,}
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
  pytest) part pytest pytest_suite ;;
  down) down ;;
  all) start=$SECONDS; up; chaos; part pytest pytest_suite
       reset_job   # the cluster stays for the next run; the example job stops burning CPU
       say "kind end to end passed in $((SECONDS - start))s" ;;
  *) die "usage: $0 [up|chaos|pytest|down|all]" ;;
esac
