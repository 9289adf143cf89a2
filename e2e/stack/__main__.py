"""Local stack for Crucible's tests: real Kubernetes control plane, KWOK GPU nodes, S3, Prometheus,
Kueue.

  up         build what is missing (cached), start what is not running, wait until healthy;
             a cold start (etcd not running) begins with an empty cluster
  down       stop exactly what `up` started (by pid file); --purge also deletes the state
  status     one line per service: pid, port, health
  env        print the env file (KUBECONFIG, S3 endpoint and keys, Prometheus URL, ...)
  build      only build the binaries into the cache
  node-down  NAME: stop a node's heartbeat (KWOK lets go of it; the node controller notices)
  node-up    NAME: give the node back to KWOK

Problems the user can fix are printed as one line (exit 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from . import build, procs, services
from .layout import KWOK_DEAD, KWOK_LABEL, KWOK_MANAGED, S3_BUCKET, Layout, StackError


def _binary(layout: Layout, svc: services.Service) -> str:
    return str(layout.bin / svc.binary)


def cmd_up(layout: Layout, args) -> None:
    started = time.monotonic()
    build.build_all(layout)
    if not shutil.which("openssl"):
        raise StackError("`openssl` is not on PATH: it generates the local CA and certificates")
    values = services.ensure_secrets(layout)
    services.ensure_certs(layout, values["admin_token"])
    services.write_kubeconfig(layout, values["admin_token"])
    services.write_configs(layout, values)
    if procs.running_pid(layout, "etcd") is None and (layout.state / "etcd").exists():
        # A cold start begins with an empty cluster. Whatever the last run left in etcd (the
        # namespaces and pods of a test run that was killed half-way) would otherwise come back
        # and hold the simulated GPUs, and every test that needs one would wait in vain.
        shutil.rmtree(layout.state / "etcd")
        print("etcd was not running: starting with an empty cluster", file=sys.stderr)

    by_name = {svc.name: svc for svc in services.SERVICES}
    pending = [svc.name for svc in services.SERVICES]
    started_now = {}  # name -> Popen of what this `up` started (its exit is seen via poll)
    while pending:
        # Start every service whose prerequisites are healthy, then wait for that wave.
        wave = [n for n in pending if all(dep not in pending for dep in services.NEEDS.get(n, []))]
        for name in wave:
            svc = by_name[name]
            if svc.prepare is not None:
                svc.prepare(layout, values)
            argv = [_binary(layout, svc), *svc.argv(layout)]
            if (procs.running_pid(layout, name) is not None
                    and procs.started_with(layout, name) != procs.argv_digest(argv)):
                print(f"restarting {name}: its flags changed", file=sys.stderr)
                procs.stop(layout, name)
            if procs.running_pid(layout, name) is None:
                started_now[name] = procs.start(layout, name, argv,
                                                [layout.port(p) for p in svc.ports])
        for name in wave:
            svc, proc = by_name[name], started_now.get(name)
            exited = (lambda: proc.poll() is not None) if proc else (lambda: False)
            procs.wait_until(name, lambda: svc.healthy(layout, values) or exited(),
                             svc.timeout_s, layout.logs / f"{name}.log")
            if exited():
                tail = (layout.logs / f"{name}.log").read_text(errors="replace").splitlines()[-10:]
                raise StackError(f"{name} exited during start-up; last lines of its log:\n"
                                 + "\n".join("    " + line for line in tail))
            pending.remove(name)

    services.reload_prometheus(layout)  # picks up a changed prometheus.yml; cheap otherwise
    token = values["admin_token"]
    services.ensure_nodes(layout, token)
    procs.wait_until("KWOK nodes Ready", lambda: services.nodes_ready(layout, token), 60)
    procs.wait_until("default ServiceAccount",
                     lambda: services.default_service_account(layout, token), 60)
    services.ensure_bucket(layout)
    write_env(layout, values)
    print(f"stack up in {time.monotonic() - started:.1f}s; env: {layout.env_file}")


def write_env(layout: Layout, values: dict) -> None:
    env = {
        "KUBECONFIG": layout.kubeconfig,
        # The count under the name `up` reads, the names under another: what `env` prints is
        # an environment this script accepts (eval "$(e2e/stack.sh env)", then node-down).
        "CRUCIBLE_KWOK_NODES": str(layout.kwok_nodes),
        "CRUCIBLE_KWOK_NODE_NAMES": ",".join(layout.node_names),
        "CRUCIBLE_KWOK_LABEL": KWOK_LABEL,
        "CRUCIBLE_S3_ENDPOINT": f"http://127.0.0.1:{layout.port('s3')}",
        "CRUCIBLE_S3_BUCKET": S3_BUCKET,
        "AWS_ACCESS_KEY_ID": values["s3_access_key"],
        "AWS_SECRET_ACCESS_KEY": values["s3_secret_key"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "CRUCIBLE_PROMETHEUS_URL": f"http://127.0.0.1:{layout.port('prometheus')}",
        "CRUCIBLE_PROMETHEUS_TARGETS_DIR": layout.prometheus_targets,
        "CRUCIBLE_PROMETHEUS_RULES_DIR": layout.prometheus_rules,
        "CRUCIBLE_BIN": layout.bin,
        # Kueue admits Workloads (kueue.x-k8s.io/v1beta2) through the KUBECONFIG above.
        "CRUCIBLE_KUEUE_NAMESPACE": services.KUEUE_NAMESPACE,
        "CRUCIBLE_KUEUE_READYZ_URL": f"http://127.0.0.1:{layout.port('kueue-health')}/readyz",
    }
    layout.env_file.touch(mode=0o600)
    layout.env_file.write_text("".join(f"export {k}={v}\n" for k, v in env.items()))


def cmd_down(layout: Layout, args) -> None:
    stopped = [svc.name for svc in reversed(services.SERVICES) if procs.stop(layout, svc.name)]
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    if args.purge and layout.state.exists():
        shutil.rmtree(layout.state)
        print(f"removed {layout.state}")


def cmd_status(layout: Layout, args) -> int:
    values = services.ensure_secrets(layout) if layout.state.exists() else None
    healthy_all = True
    print(f"{'SERVICE':<26}{'PID':>8}  {'PORT':>6}  STATE")
    for svc in services.SERVICES:
        pid = procs.running_pid(layout, svc.name)
        healthy = bool(pid and values and svc.healthy(layout, values))
        healthy_all &= healthy
        state = "healthy" if healthy else ("unhealthy" if pid else "stopped")
        print(f"{svc.name:<26}{pid or '-':>8}  {layout.port(svc.ports[0]):>6}  {state}")
    return 0 if healthy_all else 1


def cmd_env(layout: Layout, args) -> None:
    if not layout.env_file.exists():
        raise StackError(f"no env file at {layout.env_file}: run `e2e/stack.sh up` first")
    sys.stdout.write(layout.env_file.read_text())


def _label_node(layout: Layout, name: str, value: str) -> None:
    values = services.ensure_secrets(layout)
    code, body = services.kube_request(layout, values["admin_token"], "PATCH",
                                       f"/api/v1/nodes/{name}",
                                       {"metadata": {"labels": {KWOK_LABEL: value}}},
                                       "application/merge-patch+json")
    if code != 200:
        raise StackError(f"could not relabel node {name}: HTTP {code} {body.get('message')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/stack.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up")
    sub.add_parser("down").add_argument("--purge", action="store_true",
                                        help="also delete certificates, etcd data and logs")
    sub.add_parser("status")
    sub.add_parser("env")
    sub.add_parser("build").add_argument("targets", nargs="*",
                                         help=f"any of {[t.name for t in build.TARGETS]}")
    for name in ("node-down", "node-up"):
        sub.add_parser(name).add_argument("node")
    args = parser.parse_args(argv)
    try:
        layout = Layout.from_env()
        if args.command == "up":
            cmd_up(layout, args)
        elif args.command == "down":
            cmd_down(layout, args)
        elif args.command == "status":
            return cmd_status(layout, args)
        elif args.command == "env":
            cmd_env(layout, args)
        elif args.command == "build":
            build.build_all(layout, args.targets or None)
        elif args.command == "node-down":
            _label_node(layout, args.node, KWOK_DEAD)
        elif args.command == "node-up":
            _label_node(layout, args.node, KWOK_MANAGED)
    except StackError as err:
        print(f"stack {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stack {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
