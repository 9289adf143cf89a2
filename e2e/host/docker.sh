#!/usr/bin/env bash
# A Docker engine on this host, for `make images` and the kind end-to-end run (e2e/kind/run.sh).
#   e2e/host/docker.sh          start one if `docker info` fails, then check it (idempotent)
#   e2e/host/docker.sh check    only the checks: `docker info` and a `docker run --privileged`
# Made for a Debian 12 host without systemd as PID 1 (a container or a sandbox), run as root:
#  1. installs Debian's docker.io (dockerd, containerd, runc) with apt-get when dockerd is missing;
#     a docker CLI already on PATH (e.g. /usr/local/bin/docker) is kept, Debian's is the fallback;
#  2. writes /etc/docker/daemon.json (merged into an existing one with jq): storage driver
#     overlay2, the default data-root (/var/lib/docker);
#  3. only when this host's capability bounding set lacks CAP_SYS_RESOURCE (CapBnd bit 24 of
#     /proc/self/status; some sandboxes drop it), registers a runc wrapper as the default runtime
#     that removes CAP_SYS_RESOURCE from the container's capability sets before it execs runc.
#     Without it `docker run --privileged` (which kind's nodes need) fails with "unable to apply
#     caps: operation not permitted": a process cannot be given a capability its bounding set has
#     not. The only effect: privileged containers here lack CAP_SYS_RESOURCE, as the host does;
#  4. starts dockerd in the background (its own containerd), waits until it answers;
#  5. checks `docker run --privileged` on a tiny image made from this host's /bin/sh
#     (crucible-check/sh:1; no registry is needed, none may be reachable).
# Logs: ~/.cache/crucible/docker/ (dockerd.log, apt.log). Stop the engine with
# `kill $(cat /var/run/docker.pid)`; nothing here stops it.
set -euo pipefail
cache="${CRUCIBLE_CACHE:-$HOME/.cache/crucible}"
logdir="$cache/docker"
mkdir -p "$logdir"
shim=/usr/local/libexec/crucible/runc-without-sys-resource
daemon_json=/etc/docker/daemon.json
check_image=crucible-check/sh:1
say() { printf 'docker.sh: %s\n' "$*"; }
die() { printf 'docker.sh: %s\n' "$*" >&2; exit 1; }

# CAP_SYS_RESOURCE is capability 24.
host_lacks_sys_resource() {
  local bnd
  bnd=$(sed -n 's/^CapBnd:[[:space:]]*//p' /proc/self/status)
  (( ((16#$bnd >> 24) & 1) == 0 ))
}

pick_cli() {
  # Keep whichever docker CLI talks to this daemon; Debian's is the fallback.
  local cli
  for cli in "$(command -v docker 2>/dev/null || true)" /usr/bin/docker; do
    [[ -n "$cli" && -x "$cli" ]] && "$cli" version >/dev/null 2>&1 && { echo "$cli"; return; }
  done
  command -v docker 2>/dev/null || echo /usr/bin/docker
}

install_engine() {
  if command -v dockerd >/dev/null && command -v containerd >/dev/null \
     && command -v runc >/dev/null; then
    return
  fi
  [[ $(id -u) == 0 ]] || die "dockerd is missing and this is not root: install docker.io"
  say "installing Debian's docker.io (log: $logdir/apt.log)"
  {
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      docker.io containerd runc iptables jq
  } >>"$logdir/apt.log" 2>&1 || die "apt-get failed, see $logdir/apt.log"
}

install_shim() {
  local runc
  runc=$(command -v runc)
  mkdir -p "$(dirname "$shim")"
  cat >"$shim.tmp" <<EOF
#!/bin/sh
# Written by crucible's e2e/host/docker.sh, registered in $daemon_json as the default runtime:
# this host's capability bounding set lacks CAP_SYS_RESOURCE, so runc cannot grant it and
# privileged containers (docker run/exec --privileged) would fail to start. Drop it from the OCI
# spec (config.json of the bundle, or an exec's --process file), then run runc unchanged.
bundle=. spec=
prev=
for arg in "\$@"; do
  case \$prev in --bundle|-b) bundle=\$arg ;; --process|-p) spec=\$arg ;; esac
  case \$arg in --bundle=*) bundle=\${arg#--bundle=} ;; --process=*) spec=\${arg#--process=} ;;
    create|run) [ -n "\$spec" ] || spec=CONFIG ;; esac
  prev=\$arg
done
[ "\$spec" = CONFIG ] && spec=\$bundle/config.json
if [ -n "\$spec" ] && [ -f "\$spec" ]; then
  jq '(if .process then .process.capabilities else .capabilities end) |=
      (if . then with_entries(.value |= map(select(. != "CAP_SYS_RESOURCE"))) else . end)' \\
    "\$spec" >"\$spec.crucible-tmp" && mv "\$spec.crucible-tmp" "\$spec"
fi
exec $runc "\$@"
EOF
  chmod 755 "$shim.tmp"
  mv "$shim.tmp" "$shim"
}

write_daemon_json() {
  local want current
  if host_lacks_sys_resource; then
    say "this host's capability bounding set lacks CAP_SYS_RESOURCE (CapBnd bit 24 is 0):"
    say "  installing the runc wrapper $shim as dockerd's default runtime, so that"
    say "  --privileged containers start (without CAP_SYS_RESOURCE, like the host)"
    install_shim
    want=$(jq -n --arg shim "$shim" '{"storage-driver": "overlay2",
      "runtimes": {"crucible-runc": {"path": $shim}}, "default-runtime": "crucible-runc"}')
  else
    say "CAP_SYS_RESOURCE is in this host's bounding set: no runtime wrapper needed"
    want='{"storage-driver": "overlay2"}'
  fi
  mkdir -p "$(dirname "$daemon_json")"
  current=$(cat "$daemon_json" 2>/dev/null || echo '{}')
  jq -S -n --argjson a "$current" --argjson b "$want" '$a * $b' >"$daemon_json.tmp"
  mv "$daemon_json.tmp" "$daemon_json"
}

start_daemon() {
  local pid
  if [[ -f /var/run/docker.pid ]] && kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
    say "dockerd (pid $(cat /var/run/docker.pid)) is running but does not answer yet"
  else
    say "starting dockerd (log: $logdir/dockerd.log)"
    setsid nohup dockerd >>"$logdir/dockerd.log" 2>&1 </dev/null &
    pid=$!
    disown "$pid" 2>/dev/null || true
  fi
  for _ in $(seq 1 60); do
    "$cli" info >/dev/null 2>&1 && return
    sleep 1
  done
  tail -n 30 "$logdir/dockerd.log" >&2 || true
  die "dockerd did not answer within 60s, see $logdir/dockerd.log"
}

# A tiny image from this host's /bin/sh and the libraries it links: no registry needed.
check_image_exists() {
  "$cli" image inspect "$check_image" >/dev/null 2>&1 && return
  local root lib
  root=$(mktemp -d)
  mkdir -p "$root/bin"
  cp -L /bin/sh "$root/bin/sh"
  for lib in $(ldd /bin/sh | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
  tar -C "$root" -c . | "$cli" import - "$check_image" >/dev/null
  rm -rf "$root"
}

check() {
  "$cli" info >/dev/null 2>&1 || die "docker info fails"
  check_image_exists
  local caps
  # shellcheck disable=SC2016
  caps=$("$cli" run --rm --privileged --network none "$check_image" /bin/sh -c \
    'while read -r k v; do [ "$k" = CapEff: ] && echo "$v"; done </proc/self/status; exit 0') \
    || die "docker run --privileged fails (see $logdir/dockerd.log)"
  say "docker run --privileged works (container CapEff $caps)"
  say "engine: $("$cli" version -f '{{.Server.Version}}') ($(
    "$cli" info -f '{{.Driver}}, runtime {{.DefaultRuntime}}, cgroup v{{.CgroupVersion}}'))"
}

cli=$(pick_cli)
if [[ "${1:-}" != check ]] && ! "$cli" info >/dev/null 2>&1; then
  install_engine
  cli=$(pick_cli)
  write_daemon_json
  start_daemon
fi
say "docker CLI: $cli ($("$cli" version -f '{{.Client.Version}}' 2>/dev/null || echo '?'))"
check
