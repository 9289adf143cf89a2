#!/usr/bin/env bash
# The kind cluster of the end-to-end run, on a node image built here from source (no registry):
#   e2e/kind/cluster.sh [up]    build what is missing (bins.sh, base-image.sh, images.sh,
#                               node-image.sh), create the cluster unless it exists (kind's CNI
#                               disabled), install kube-router as CNI and NetworkPolicy firewall
#                               (e2e/kind/kube-router.yaml), wait until every node is Ready and
#                               CoreDNS answers; on creation, check the network; idempotent
#   e2e/kind/cluster.sh check   readiness and the network check: pod to pod across the workers,
#                               a Service by DNS name, a deny-all ingress NetworkPolicy blocks
#   e2e/kind/cluster.sh down    delete it
# Cluster: $CRUCIBLE_KIND_CLUSTER (default crucible-e2e), nodes per e2e/kind/cluster.yaml (one
# control plane, two workers); kubectl context kind-<name>, kubeconfig in ~/.kube/config and in
# e2e/kind/.kubeconfig. Timings of every step: ~/.cache/crucible/kind/logs/timings.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cluster="${CRUCIBLE_KIND_CLUSTER:-crucible-e2e}"
ctx="kind-$cluster"
k() { "$KBIN/kube-$K8S_VERSION/kubectl" --context "$ctx" "$@"; }

create() {
  # No --wait: with kind's CNI disabled (cluster.yaml) no node is Ready before kube-router runs.
  "$KIND_BIN" create cluster --name "$cluster" --config "$E2E_KIND/cluster.yaml" --image "$NODE_IMAGE"
}

# The CNI: kube-router's routing and firewall (e2e/kind/kube-router.yaml); applying it again is a
# no-op. A cluster made while kind's kindnetd was its CNI would have two: it must be recreated.
install_cni() {
  if k -n kube-system get daemonset kindnet >/dev/null 2>&1; then
    die "cluster $cluster runs kindnetd; recreate it: $0 down && $0 up"
  fi
  k apply -f "$E2E_KIND/kube-router.yaml" >/dev/null
  k -n kube-system rollout status daemonset/kube-router --timeout=300s
}

wait_ready() {
  k wait --for=condition=Ready nodes --all --timeout=300s
  k -n kube-system rollout status daemonset/kube-router --timeout=300s
  k -n kube-system rollout status daemonset/kube-proxy --timeout=300s
  k -n kube-system rollout status deployment/coredns --timeout=300s
  # From a pod (pod network, Service routing, cluster DNS): CoreDNS resolves the API server's
  # Service. The kube-proxy image (Debian, with getent) is preloaded on every node.
  k -n kube-system delete pod crucible-dns-check --ignore-not-found --wait=true >/dev/null
  k -n kube-system run crucible-dns-check --restart=Never --image "registry.k8s.io/kube-proxy:$K8S_VERSION" \
    --image-pull-policy=Never --command -- getent hosts kubernetes.default.svc.cluster.local >/dev/null
  if ! k -n kube-system wait --for=jsonpath='{.status.phase}'=Succeeded pod/crucible-dns-check --timeout=120s; then
    k -n kube-system logs crucible-dns-check >&2 || true
    die "a pod could not resolve kubernetes.default through CoreDNS"
  fi
  k -n kube-system logs crucible-dns-check
  k -n kube-system delete pod crucible-dns-check --wait=false >/dev/null
}

# The pod network and NetworkPolicy, between the two workers: client pods on one reach a server pod
# on the other by pod IP (routed between the nodes) and by its Service's DNS name (CoreDNS,
# kube-proxy); then a deny-all ingress policy must cut off the connection that worked before.
check_network() {
  local ns=crucible-netpol-check ip svc nodes
  mapfile -t nodes < <(k get nodes -l '!node-role.kubernetes.io/control-plane' \
    -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
  ((${#nodes[@]} >= 2)) || die "network check: needs two worker nodes (have: ${nodes[*]})"
  on() { printf '{"apiVersion": "v1", "spec": {"nodeName": "%s"}}' "$1"; }
  k delete namespace "$ns" --ignore-not-found --wait=true >/dev/null
  k create namespace "$ns" >/dev/null
  k -n "$ns" run server --image "registry.k8s.io/etcd:${ETCD_VERSION#v}-0" --image-pull-policy=Never \
    --overrides "$(on "${nodes[0]}")" \
    --command -- etcd --data-dir /tmp/etcd --listen-client-urls http://0.0.0.0:2379 \
    --advertise-client-urls http://127.0.0.1:2379 >/dev/null
  k -n "$ns" expose pod server --port 2379 >/dev/null
  k -n "$ns" wait --for=condition=Ready pod/server --timeout=120s >/dev/null
  ip=$(k -n "$ns" get pod server -o jsonpath='{.status.podIP}')
  svc="server.$ns.svc.cluster.local"
  reach() {  # reach HOST: a client pod on the other worker opens a TCP connection to HOST:2379
    k -n "$ns" delete pod client --ignore-not-found --wait=true >/dev/null
    k -n "$ns" run client --restart=Never --image "registry.k8s.io/kube-proxy:$K8S_VERSION" \
      --image-pull-policy=Never --overrides "$(on "${nodes[1]}")" \
      --command -- bash -c "timeout 5 bash -c 'echo > /dev/tcp/$1/2379'" >/dev/null
    local phase i
    for i in $(seq 1 60); do
      phase=$(k -n "$ns" get pod client -o jsonpath='{.status.phase}')
      [[ "$phase" == Succeeded ]] && return 0
      [[ "$phase" == Failed ]] && return 1
      sleep 1
    done
    return 1
  }
  reach "$ip" || die "network check: a pod on ${nodes[1]} cannot reach a pod on ${nodes[0]} ($ip)"
  reach "$svc" || die "network check: a pod on ${nodes[1]} cannot reach the Service $svc"
  say "network check: from ${nodes[1]}, pod $ip on ${nodes[0]} and Service $svc answer"
  k -n "$ns" apply -f - >/dev/null <<'EOF'
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-ingress}
spec: {podSelector: {}, policyTypes: [Ingress]}
EOF
  sleep 5
  if reach "$ip"; then
    say "NetworkPolicy check: NOT enforced (a deny-all ingress policy let a connection through)"
    k delete namespace "$ns" --wait=false >/dev/null
    return 1
  fi
  say "NetworkPolicy check: enforced (deny-all ingress blocks a connection that worked before)"
  k delete namespace "$ns" --wait=false >/dev/null
}

up() {
  command -v docker >/dev/null || die "docker is not on PATH"
  "$E2E_KIND/bins.sh"
  "$E2E_KIND/node-image.sh" >/dev/null
  local created=
  if ! "$KIND_BIN" get clusters 2>/dev/null | grep -qx "$cluster"; then
    say "creating kind cluster $cluster from $NODE_IMAGE"
    timed cluster-create create
    created=1
  fi
  timed cni install_cni
  timed cluster-ready wait_ready
  [[ -z "$created" ]] || timed network-check check_network
  "$KIND_BIN" get kubeconfig --name "$cluster" >"$E2E_KIND/.kubeconfig"
  k get nodes -o wide
  say "cluster $cluster is up: kubectl --context $ctx (or KUBECONFIG=$E2E_KIND/.kubeconfig)"
}

case "${1:-up}" in
  up) up ;;
  check) wait_ready && check_network ;;
  down) "$KIND_BIN" delete cluster --name "$cluster" ;;
  *) die "usage: $0 [up|check|down]" ;;
esac
