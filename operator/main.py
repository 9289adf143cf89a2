"""The `crucible-operator` command: runs the PretrainJob controller, or prints its manifests.

This folder is the namespace package `crucible.operator`. It deliberately has no `__init__.py`:
with the repository root on `sys.path` (as under `python -m pytest`), a regular package named
`operator` would shadow the standard library's `operator` module, which torch and many others
import. A namespace portion never wins over a real module, so the stdlib stays reachable.

  crucible-operator run [-n NS ... | -A]   kopf run of crucible.operator.handlers
  crucible-operator release-finalizers     before an uninstall: stop it, drop its finalizers
  crucible-operator crd                    the CRD YAML (manifests/crd/)
  crucible-operator rbac                   the operator's RBAC YAML (manifests/rbac/)

One replica, or several with `--leader-election-namespace` (leader.py): only the holder of the
leader Lease reconciles. kopf's peering only pauses lower-priority operators and elects no
leader (kopf's docs, "Peering"), so the operator runs `--standalone` either way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from crucible.operator.cluster_policy import DEFAULT_FAILURE_CONDITIONS

VERSION = "0.1.0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crucible-operator",
        description="Reconcile PretrainJob resources (crucible.dev/v1alpha1) into elastic "
        "torchrun pods; watch pod and node health; resume from the latest checkpoint.",
    )
    parser.add_argument("--version", action="version", version=f"crucible-operator {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="Run the controller (credentials: in-cluster, else "
                         "KUBECONFIG).", description="Run the controller.")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="serve PretrainJobs in this namespace (repeatable; globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="serve PretrainJobs in every namespace (the default)")
    run.add_argument("--interval", type=float, default=10.0,
                     help="seconds between resync passes per job, on top of event-driven passes "
                     "(default 10)")
    run.add_argument("--workers", type=int, default=8, help="passes that run at once, each "
                     "with up to 9 API calls in flight (default 8: more only makes each wait "
                     "longer on a busy apiserver; docs/operator.md, Scale)")
    run.add_argument("--metrics-port", default="8080",
                     help="Prometheus /metrics port, or 'off' (default 8080)")
    run.add_argument("--liveness", metavar="URL", help="kopf liveness endpoint, e.g. "
                     "http://0.0.0.0:8081/healthz")
    run.add_argument("--leader-election-namespace", metavar="NS",
                     help="run as one of several replicas: only the holder of the Lease "
                     "crucible-operator-leader in NS reconciles; the others take over within "
                     "~17 s of its last renewal (default: off, a single replica)")
    run.add_argument("--max-cordons-per-minute", type=int, default=6, metavar="N",
                     help="cordon at most N failed nodes a minute across all jobs; past it a "
                     "failed node is annotated and avoided by its job but left schedulable "
                     "(many nodes failing at once is rarely the nodes). 0: never cordon "
                     "(default 6)")
    run.add_argument("--quarantine-minutes", type=float, default=60.0, metavar="M",
                     help="how long the operator's cordon of a failed node lasts; then, if the "
                     "node is healthy, it is uncordoned and on probation as long again (a "
                     "failure within it doubles the next cordon). A cordon someone else set is "
                     "never lifted. 0: the operator's cordons never end (default 60)")
    run.add_argument("--node-failure-conditions", default=DEFAULT_FAILURE_CONDITIONS,
                     metavar="TYPES",
                     help="node condition types a job's faultTolerance.nodeFailureConditions may "
                     "name, comma-separated; others are ignored. '*': any but the kubelet's "
                     "own, which the CRD refuses (a tenant could then name one that is True on "
                     f"healthy nodes). Default: {DEFAULT_FAILURE_CONDITIONS}")
    run.add_argument("--straggler-cordon-selector", default="", metavar="KEY=VALUE,...",
                     help="node labels under which a straggler report (written by the job's own "
                     "trainer code, so a tenant could forge one) may cordon its node like a "
                     "failed node, e.g. crucible.dev/straggler-cordon=allowed. Elsewhere, and "
                     "by default everywhere, the job only avoids the node and replaces its pod")
    run.add_argument("--allow-instance-metadata", action="store_true",
                     help="let job pods reach the cloud's instance-metadata endpoint "
                     "(169.254.169.254), and with it the node's IAM role; by default each job's "
                     "NetworkPolicy blocks it and the AWS SDK is told not to try "
                     "(AWS_EC2_METADATA_DISABLED): jobs get storage credentials from their "
                     "Secret or workload identity")
    run.add_argument("--allowed-priority-classes", default="", metavar="NAMES",
                     help="PriorityClasses a job's scheduling.priorityClassName, and Kueue "
                     "WorkloadPriorityClasses its kueue.x-k8s.io/priority-class label, may name, "
                     "comma-separated; a job naming another fails (NotAllowed). Default: any")
    run.add_argument("--allowed-toleration-keys", default="", metavar="KEYS",
                     help="taint keys a job's scheduling.tolerations may tolerate, "
                     "comma-separated (a toleration without a key, which tolerates every taint, "
                     "is then refused); others fail the job (NotAllowed). Default: any")
    run.add_argument("--allowed-node-selector-keys", default="", metavar="KEYS",
                     help="node label keys a job's scheduling.nodeSelector may use, "
                     "comma-separated (e.g. leave out kubernetes.io/hostname, so no job aims "
                     "at one node); others fail the job (NotAllowed). Default: any")
    run.add_argument("--max-scratch-size", default="", metavar="QUANTITY",
                     help="largest scratchSizeLimit a job may ask for (node disk), e.g. 200Gi. "
                     "Default: no limit")
    run.add_argument("--max-shm-size", default="", metavar="QUANTITY",
                     help="largest shmSizeLimit a job may ask for (node memory), e.g. 32Gi. "
                     "Default: no limit")
    run.add_argument("--metrics-scrapers", default="", metavar="JSON",
                     help="who may reach a job's metrics port through its NetworkPolicy: a JSON "
                     "list of NetworkPolicy peers, e.g. '[{\"namespaceSelector\": {\"matchLabels\": "
                     "{\"kubernetes.io/metadata.name\": \"monitoring\"}}}]' (default: every "
                     "namespace)")
    run.add_argument("--no-kueue", action="store_true", help="do not watch Kueue's objects "
                     "(where Kueue is not installed, or the operator holds no rights on them); "
                     "a job with the kueue.x-k8s.io/queue-name label then waits, saying so")
    run.add_argument("--manage-jobs-without-queue-name", action="store_true",
                     help="as Kueue's setting of that name: a job without the "
                     "kueue.x-k8s.io/queue-name label queues in its namespace's LocalQueue "
                     "named 'default', and waits (Queued, NoQueue) where there is none, instead "
                     "of running outside every quota")
    run.add_argument("-v", "--verbose", action="store_true", help="log every API call kopf makes")
    release = sub.add_parser(
        "release-finalizers", help="Before uninstalling: stop the operator, then take its "
        "finalizer off every PretrainJob (the chart's pre-delete hook runs this).",
        description="Take the operator's finalizer (crucible.dev/operator) off every "
        "PretrainJob, so that deleting one after the operator is gone does not hang. Stop the "
        "operator first (--stop-deployment), or it puts the finalizer back. Jobs and their pods "
        "stay, unmanaged.")
    where = release.add_mutually_exclusive_group()
    where.add_argument("-n", "--namespace", action="append", default=[],
                       help="only PretrainJobs in this namespace (repeatable)")
    where.add_argument("-A", "--all-namespaces", action="store_true",
                       help="PretrainJobs in every namespace (the default)")
    release.add_argument("--stop-deployment", metavar="NAMESPACE/NAME",
                         help="scale the operator's Deployment to 0 and wait for it first")
    release.add_argument("--timeout", type=float, default=120.0,
                         help="seconds to wait for the operator to stop (default 120)")
    sub.add_parser("crd", help="Print the PretrainJob CRD (generated from the spec models).")
    sub.add_parser("rbac", help="Print the operator's ServiceAccount and ClusterRole.")
    return parser


def run(args: argparse.Namespace) -> int:
    if (args.interval <= 0 or args.workers < 1 or args.max_cordons_per_minute < 0
            or args.quarantine_minutes < 0):
        print("crucible-operator run: --interval must be > 0, --workers >= 1, "
              "--max-cordons-per-minute >= 0 and --quarantine-minutes >= 0", file=sys.stderr)
        return 2
    if args.manage_jobs_without_queue_name and args.no_kueue:
        print("crucible-operator run: --manage-jobs-without-queue-name needs Kueue (drop "
              "--no-kueue)", file=sys.stderr)
        return 2
    from crucible.operator.cluster_policy import parse_label_selector, parse_peers
    from crucible.operator.tenant_limits import TenantLimits

    try:
        if args.metrics_scrapers.strip():
            parse_peers(args.metrics_scrapers)
        if args.straggler_cordon_selector.strip():
            parse_label_selector(args.straggler_cordon_selector)
        TenantLimits.from_settings(args.allowed_priority_classes, args.allowed_toleration_keys,
                                   args.allowed_node_selector_keys, args.max_scratch_size,
                                   args.max_shm_size)
    except ValueError as err:
        print(f"crucible-operator run: {err}", file=sys.stderr)
        return 2
    os.environ["CRUCIBLE_OPERATOR_INTERVAL"] = str(args.interval)
    os.environ["CRUCIBLE_OPERATOR_WORKERS"] = str(args.workers)
    os.environ["CRUCIBLE_OPERATOR_METRICS_PORT"] = str(args.metrics_port)
    os.environ["CRUCIBLE_OPERATOR_LEADER_ELECTION"] = args.leader_election_namespace or ""
    os.environ["CRUCIBLE_OPERATOR_MAX_CORDONS_PER_MINUTE"] = str(args.max_cordons_per_minute)
    os.environ["CRUCIBLE_OPERATOR_NODE_FAILURE_CONDITIONS"] = args.node_failure_conditions
    os.environ["CRUCIBLE_OPERATOR_METRICS_SCRAPERS"] = args.metrics_scrapers
    os.environ["CRUCIBLE_OPERATOR_STRAGGLER_CORDON_SELECTOR"] = args.straggler_cordon_selector
    os.environ["CRUCIBLE_OPERATOR_INSTANCE_METADATA"] = ("on" if args.allow_instance_metadata
                                                         else "off")
    os.environ["CRUCIBLE_OPERATOR_ALLOWED_PRIORITY_CLASSES"] = args.allowed_priority_classes
    os.environ["CRUCIBLE_OPERATOR_ALLOWED_TOLERATION_KEYS"] = args.allowed_toleration_keys
    os.environ["CRUCIBLE_OPERATOR_ALLOWED_NODE_SELECTOR_KEYS"] = args.allowed_node_selector_keys
    os.environ["CRUCIBLE_OPERATOR_MAX_SCRATCH_SIZE"] = args.max_scratch_size
    os.environ["CRUCIBLE_OPERATOR_MAX_SHM_SIZE"] = args.max_shm_size
    os.environ["CRUCIBLE_OPERATOR_KUEUE"] = "off" if args.no_kueue else "on"
    os.environ["CRUCIBLE_OPERATOR_NAMESPACES"] = json.dumps(args.namespace)
    os.environ["CRUCIBLE_OPERATOR_QUARANTINE_MINUTES"] = str(args.quarantine_minutes)
    os.environ["CRUCIBLE_OPERATOR_KUEUE_MANAGE_ALL"] = ("on" if args.manage_jobs_without_queue_name
                                                        else "off")

    import kopf

    from crucible.operator import handlers

    assert handlers.reconcile  # importing registers the handlers with kopf

    kopf.configure(verbose=args.verbose, log_prefix=True)
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)
    return 0


def release_finalizers(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    from crucible.operator import uninstall
    from crucible.operator.apiclient import CONNECTION_ERRORS, api_client, describe

    api = api_client(4)
    try:
        if args.stop_deployment:
            namespace, _, name = args.stop_deployment.partition("/")
            if not namespace or not name:
                print("crucible-operator release-finalizers: --stop-deployment takes "
                      "NAMESPACE/NAME", file=sys.stderr)
                return 2
            stopped = uninstall.stop_deployment(api, namespace, name, args.timeout)
            print(f"operator {args.stop_deployment}: " + ("scaled to 0" if stopped
                                                           else "not found, nothing to stop"))
        released = uninstall.release_finalizers(api, args.namespace or None)
    except (ApiException, TimeoutError, *CONNECTION_ERRORS) as err:
        print(f"crucible-operator release-finalizers: {describe(err)}", file=sys.stderr)
        return 1
    for job in released:
        print(f"released {job}")
    print(f"{len(released)} PretrainJob(s) released")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "release-finalizers":
        return release_finalizers(args)
    if args.command == "crd":
        from crucible.operator import crd

        sys.stdout.write(crd.render())
        return 0
    if args.command == "rbac":
        from crucible.operator import rbac

        sys.stdout.write(rbac.render())
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
