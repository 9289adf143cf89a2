"""The stack's services: how each one is configured, started and checked, in start order.

Everything listens on 127.0.0.1. The apiserver serves TLS with a certificate from a local CA and
authenticates an admin bearer token (group system:masters) with RBAC on, so least-privilege tests
can use real ServiceAccount tokens. The node lifecycle controller runs with a grace period of a
few seconds, and KWOK renews node Leases every second, so a node whose heartbeat stops turns
NotReady (and gets the `unreachable` taint) within about ten seconds.

Kueue runs as a local process too (see the Kueue section): its CRDs, conversion and admission
webhooks are registered by URL (https://127.0.0.1:<port>/...) with a certificate from the local CA.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import procs
from .layout import KWOK_LABEL, KWOK_MANAGED, S3_BUCKET, Layout, StackError

SERVICE_CIDR = "10.96.0.0/16"
# KWOK renews a node Lease every quarter of its duration (Layout.kwok_lease_s, default 4 s: every
# second); the node lifecycle controller's grace (silence before Ready=Unknown) must exceed the
# duration: twice it, and never under 8 s.
def node_monitor_grace(l: Layout) -> str:
    return f"{max(8, 2 * l.kwok_lease_s)}s"


DEFAULT_TOLERATION_SECONDS = 30    # apiserver default for not-ready/unreachable (upstream: 300)


# --- credentials and certificates -----------------------------------------------------------
def ensure_secrets(layout: Layout) -> dict:
    """Admin token and S3 keys, generated once per state folder (mode 0600)."""
    path = layout.state / "secrets.json"
    if path.exists():
        return json.loads(path.read_text())
    values = {
        "admin_token": secrets.token_hex(24),
        "s3_access_key": "crucible" + secrets.token_hex(6),
        "s3_secret_key": secrets.token_hex(20),
    }
    layout.state.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(json.dumps(values))
    return values


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise StackError(f"openssl {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")


def ensure_certs(layout: Layout, admin_token: str) -> None:
    certs = layout.certs
    if (certs / "apiserver.crt").exists():
        return
    certs.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "3650", "-subj", "/CN=crucible-local-ca", cwd=certs)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out",
             "apiserver.csr", "-subj", "/CN=kube-apiserver", cwd=certs)
    sans = ("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
            "DNS:kubernetes.default.svc,IP:10.96.0.1")
    (certs / "san.ext").write_text(sans + "\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "apiserver.crt", "-days", "3650", "-extfile", "san.ext",
             cwd=certs)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=certs)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=certs)
    (certs / "tokens.csv").write_text(f'{admin_token},crucible-admin,crucible-admin,"system:masters"\n')


def write_kubeconfig(layout: Layout, admin_token: str) -> None:
    server = f"https://127.0.0.1:{layout.port('kube-apiserver')}"
    layout.kubeconfig.touch(mode=0o600)
    layout.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: crucible-local
  cluster:
    server: {server}
    certificate-authority: {layout.certs / 'ca.crt'}
users:
- name: crucible-admin
  user:
    token: {admin_token}
contexts:
- name: crucible-local
  context: {{cluster: crucible-local, user: crucible-admin}}
current-context: crucible-local
""")


# --- a tiny client for the apiserver (the stack script needs no Python packages) -------------
def kube_request(layout: Layout, token: str, method: str, path: str,
                 body: dict | str | None = None, content_type: str = "application/json",
                 timeout_s: float = 10) -> tuple[int, dict]:
    """One API call; a `str` body is sent as it is (YAML for server-side apply)."""
    url = f"https://127.0.0.1:{layout.port('kube-apiserver')}{path}"
    if isinstance(body, str):
        data = body.encode()
    else:
        data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", content_type)
    ctx = ssl.create_default_context(cafile=str(layout.certs / "ca.crt"))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def node_manifest(name: str) -> dict:
    """A GPU node as a cloud GPU pool would register it (labels as NVIDIA's feature discovery)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                KWOK_LABEL: KWOK_MANAGED,
                "crucible.dev/pool": "gpu",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H200",
                "nvidia.com/gpu.count": "8",
                "topology.kubernetes.io/zone": "zone-a",
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {
            "capacity": {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8",
                         "ephemeral-storage": "1Ti"},
            "allocatable": {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8",
                            "ephemeral-storage": "1Ti"},
        },
    }


def ensure_nodes(layout: Layout, token: str) -> None:
    """Create the simulated GPU nodes, or put existing ones back under KWOK's management."""
    for name in layout.node_names:
        code, body = kube_request(layout, token, "POST", "/api/v1/nodes", node_manifest(name))
        if code == 409:
            patch = {"metadata": {"labels": {KWOK_LABEL: KWOK_MANAGED}},
                     "spec": {"unschedulable": None}}
            code, body = kube_request(layout, token, "PATCH", f"/api/v1/nodes/{name}", patch,
                                      "application/merge-patch+json")
        if code not in (200, 201):
            raise StackError(f"could not create node {name}: HTTP {code} {body.get('message')}")


def nodes_ready(layout: Layout, token: str) -> bool:
    code, body = kube_request(layout, token, "GET", "/api/v1/nodes?labelSelector=type%3Dkwok")
    if code != 200:
        return False
    ready = {n["metadata"]["name"] for n in body.get("items", [])
             if any(c["type"] == "Ready" and c["status"] == "True"
                    for c in n.get("status", {}).get("conditions", []))}
    return set(layout.node_names) <= ready


def default_service_account(layout: Layout, token: str) -> bool:
    # Pods are refused until the controller-manager has created the namespace's "default" SA.
    code, _ = kube_request(layout, token, "GET", "/api/v1/namespaces/default/serviceaccounts/default")
    return code == 200


# --- Kueue -----------------------------------------------------------------------------------
# Kueue (sigs.k8s.io/kueue) runs as a local process, not in the cluster, so everything its
# manifests point at a Service in kueue-system is pointed at https://127.0.0.1:<port> instead:
# - the webhook server listens on 127.0.0.1 with a certificate from the local CA (certs/kueue/),
#   internal certificate management is off (it wants the in-cluster Service and Secret);
# - only the admission webhooks for Kueue's own API group are registered. The shipped manifests
#   also hold webhooks for pods, Jobs, JobSets, Deployments, ...: with failurePolicy Fail those
#   would refuse every pod the other tests create whenever Kueue is down, and the stack enables
#   no job integration for them to serve;
# - the CRDs Kueue converts between v1beta1 and v1beta2 get its /convert webhook, as upstream's
#   kustomize patches do.
# Kueue then admits Workloads that a test (or Crucible's operator) creates itself; it never
# suspends or gates the suite's own pods and Jobs.
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_NAMESPACE = "kueue-system"
KUEUE_WEBHOOKS = {  # kind in the shipped manifests -> the name a real installation gives it
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
# Kueue v0.17 builds a watcher for a metrics certificate at this fixed path whenever internal
# certificate management is off, before it looks at metrics.bindAddress, and exits if the files
# are missing; no setting moves it. The stack keeps metrics off, so the pair there is a
# throwaway self-signed one that nothing ever serves or trusts.
KUEUE_METRICS_CERTS = Path("/etc/kueue/metrics/certs")
FIELD_MANAGER = "crucible-stack"
KUEUE_PODS_READY_TIMEOUT_S = 60


def kueue_config(l: Layout) -> str:
    # The default framework list would be [batch/job] (an empty list is defaulted to it). JobSet
    # is named instead because its API does not exist here: Kueue defers that controller until
    # the CRD appears (never, on this stack), so no job integration runs at all. Metrics and
    # the visibility server (which would want certificates of its own) are off; TAS and
    # PartialAdmission keep their (beta, on) defaults. waitForPodsReady is on, as production
    # clusters commonly run it (its timeout shortened from 5 min): an admitted Workload whose
    # PodsReady condition nobody sets to True is evicted after it.
    return f"""apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: {KUEUE_NAMESPACE}
manageJobsWithoutQueueName: false
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
health:
  healthProbeBindAddress: 127.0.0.1:{l.port('kueue-health')}
metrics:
  bindAddress: "0"
webhook:
  host: 127.0.0.1
  port: {l.port('kueue-webhook')}
  certDir: {l.certs / 'kueue'}
integrations:
  frameworks: ["jobset.x-k8s.io/jobset"]
waitForPodsReady:
  timeout: {KUEUE_PODS_READY_TIMEOUT_S}s
  blockAdmission: false
featureGates:
  VisibilityOnDemand: false
"""


def kueue_config_path(l: Layout) -> Path:
    # The file is named by its content, so a changed configuration changes Kueue's argv and a
    # warm `up` restarts it (the pid file records the argv it was started with).
    digest = hashlib.sha256(kueue_config(l).encode()).hexdigest()[:12]
    return l.state / "kueue" / f"config-{digest}.yaml"


def ensure_kueue_certs(layout: Layout) -> None:
    """The webhook server's certificate (for 127.0.0.1, from the local CA): certs/kueue/tls.*"""
    certs = layout.certs / "kueue"
    if not (certs / "tls.crt").exists():
        certs.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
                 "-subj", "/CN=kueue-webhook", cwd=certs)
        (certs / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", "tls.csr", "-CA", str(layout.certs / "ca.crt"),
                 "-CAkey", str(layout.certs / "ca.key"), "-CAcreateserial", "-out", "tls.crt",
                 "-days", "3650", "-extfile", "san.ext", cwd=certs)
    if (KUEUE_METRICS_CERTS / "tls.crt").exists() and (KUEUE_METRICS_CERTS / "tls.key").exists():
        return
    try:
        KUEUE_METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        if not os.access(KUEUE_METRICS_CERTS, os.W_OK):
            raise PermissionError(KUEUE_METRICS_CERTS)
    except PermissionError:
        raise StackError(f"Kueue needs a (never used) certificate in {KUEUE_METRICS_CERTS}: "
                         f"run `sudo mkdir -p {KUEUE_METRICS_CERTS} && sudo chown $USER "
                         f"{KUEUE_METRICS_CERTS}` once, then `up` again") from None
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out",
             "tls.crt", "-days", "3650", "-subj", "/CN=kueue-metrics-unused",
             cwd=KUEUE_METRICS_CERTS)


def _kueue_client_config(layout: Layout, path: str) -> dict:
    ca = base64.b64encode((layout.certs / "ca.crt").read_bytes()).decode()
    return {"url": f"https://127.0.0.1:{layout.port('kueue-webhook')}{path}", "caBundle": ca}


def _apply(layout: Layout, token: str, path: str, body: dict | str, what: str,
           dry_run: bool = False) -> dict:
    """Server-side apply (YAML or JSON body), owned by the stack's field manager."""
    query = f"?fieldManager={FIELD_MANAGER}&force=true" + ("&dryRun=All" if dry_run else "")
    code, result = kube_request(layout, token, "PATCH", path + query, body,
                                "application/apply-patch+yaml", timeout_s=60)
    if code not in (200, 201):
        raise StackError(f"could not apply {what}: HTTP {code} {result.get('message')}")
    return result


CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _install_kueue_crds(layout: Layout, token: str) -> None:
    root = layout.cache / "kueue"
    converted = set(json.loads((root / "conversion.json").read_text()))
    names = []
    for crd in sorted((root / "crds").glob("*.yaml")):
        group, plural = crd.stem.split("_", 1)  # kueue.x-k8s.io_workloads.yaml
        name = f"{plural}.{group}"
        text = crd.read_text()
        if plural in converted:
            conversion = {"strategy": "Webhook", "webhook": {
                "clientConfig": _kueue_client_config(layout, "/convert"),
                "conversionReviewVersions": ["v1"]}}
            # JSON is YAML: one flow-style line under `spec:` (controller-gen writes no
            # conversion stanza of its own).
            if "\nspec:\n" not in text or "\n  conversion:" in text:
                raise StackError(f"unexpected layout of {crd}; cannot add its conversion webhook")
            stanza = f"\nspec:\n  conversion: {json.dumps(conversion)}\n"
            text = text.replace("\nspec:\n", stanza, 1)
        _apply(layout, token, f"{CRDS}/{name}", text, f"CRD {name}")
        names.append(name)

    def established() -> bool:
        for name in names:
            code, body = kube_request(layout, token, "GET", f"{CRDS}/{name}")
            if code != 200 or not any(c["type"] == "Established" and c["status"] == "True"
                                      for c in body.get("status", {}).get("conditions") or []):
                return False
        return True
    procs.wait_until("Kueue CRDs Established", established, 60)


def _register_kueue_webhooks(layout: Layout, token: str) -> None:
    docs = [d for d in (layout.cache / "kueue" / "webhooks.yaml").read_text().split("\n---\n")
            if d.strip() and d.strip() != "---"]
    for doc in docs:
        kind = re.search(r"^kind: (\w+)$", doc, re.M)
        shipped = re.search(r"^metadata:\n  name: (\S+)$", doc, re.M)
        if not kind or not shipped or kind[1] not in KUEUE_WEBHOOKS:
            raise StackError("unexpected document in Kueue's webhook manifests: "
                             f"{doc.strip()[:80]!r}")
        kind, shipped = kind[1], shipped[1]
        collection = f"/apis/admissionregistration.k8s.io/v1/{kind.lower()}s"
        # The stack has no YAML parser (standard library only): a dry-run apply under the
        # shipped name has the apiserver parse (and default) the manifest and answer in JSON.
        parsed = _apply(layout, token, f"{collection}/{shipped}", doc, f"{kind} (dry run)",
                        dry_run=True)
        webhooks = []
        for hook in parsed.get("webhooks", []):
            groups = {g for rule in hook.get("rules", []) for g in rule.get("apiGroups", [])}
            if groups != {KUEUE_GROUP}:
                continue  # pods, Jobs, JobSets, ...: see the comment at the top of this section
            path = hook["clientConfig"]["service"]["path"]
            webhooks.append({**hook, "clientConfig": _kueue_client_config(layout, path)})
        if not webhooks:
            raise StackError(f"no {KUEUE_GROUP} webhooks found in Kueue's {kind}")
        name = KUEUE_WEBHOOKS[kind]
        _apply(layout, token, f"{collection}/{name}",
               {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
                "metadata": {"name": name}, "webhooks": webhooks}, f"{kind} {name}")


INSTALLED = "crucible.dev/kueue-installed"  # annotation on the Kueue namespace


def _kueue_install_digest(layout: Layout) -> str:
    root = layout.cache / "kueue"
    digest = hashlib.sha256()
    for path in [*sorted((root / "crds").glob("*.yaml")), root / "conversion.json",
                 root / "webhooks.yaml", layout.certs / "ca.crt"]:
        digest.update(path.read_bytes())
    digest.update(str(layout.port("kueue-webhook")).encode())
    return digest.hexdigest()[:16]


def prepare_kueue(layout: Layout, values: dict) -> None:
    """Certificates, namespace, CRDs (Established) and webhook registrations, before Kueue.

    Applying the CRDs (1.6 MB, most of it the Workload's) costs a second or two, and every test
    session runs `up`; so the namespace, which lives and dies with the cluster's etcd, records
    what was installed, and an unchanged installation is not applied again.
    """
    token = values["admin_token"]
    ensure_kueue_certs(layout)
    digest = _kueue_install_digest(layout)
    code, body = kube_request(layout, token, "GET", f"/api/v1/namespaces/{KUEUE_NAMESPACE}")
    if code == 200 and body["metadata"].get("annotations", {}).get(INSTALLED) == digest:
        return
    if code == 404:
        code, body = kube_request(layout, token, "POST", "/api/v1/namespaces",
                                  {"metadata": {"name": KUEUE_NAMESPACE}})
    if code not in (200, 201, 409):
        raise StackError(f"could not create namespace {KUEUE_NAMESPACE}: HTTP {code} "
                         f"{body.get('message')}")
    _install_kueue_crds(layout, token)
    _register_kueue_webhooks(layout, token)
    code, body = kube_request(layout, token, "PATCH", f"/api/v1/namespaces/{KUEUE_NAMESPACE}",
                              {"metadata": {"annotations": {INSTALLED: digest}}},
                              "application/merge-patch+json")
    if code != 200:
        raise StackError(f"could not annotate namespace {KUEUE_NAMESPACE}: HTTP {code} "
                         f"{body.get('message')}")


# --- service table ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Service:
    name: str
    binary: str
    ports: tuple[str, ...]                       # names in layout.PORTS; first is the main one
    argv: Callable[[Layout], list[str]]
    healthy: Callable[[Layout, dict], bool]
    timeout_s: float = 60.0
    # Runs before every start (and on every `up`, idempotently) once the NEEDS are healthy.
    prepare: Callable[[Layout, dict], None] | None = None


def _etcd(l: Layout) -> list[str]:
    client, peer = f"http://127.0.0.1:{l.port('etcd')}", f"http://127.0.0.1:{l.port('etcd-peer')}"
    return ["--name", "crucible", "--data-dir", str(l.state / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"crucible={peer}", "--listen-metrics-urls", "",
            "--unsafe-no-fsync"]  # a test stack: durability across power loss is not needed


def _apiserver(l: Layout) -> list[str]:
    c = l.certs
    return [f"--etcd-servers=http://127.0.0.1:{l.port('etcd')}",
            "--bind-address=127.0.0.1", f"--secure-port={l.port('kube-apiserver')}",
            f"--tls-cert-file={c / 'apiserver.crt'}", f"--tls-private-key-file={c / 'apiserver.key'}",
            f"--client-ca-file={c / 'ca.crt'}", f"--token-auth-file={c / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            # On in OpenShift and OKD: an ownerReference with blockOwnerDeletion needs update
            # on the owner's finalizers. On here, so every test creates children under it.
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={c / 'sa.pub'}",
            f"--service-account-signing-key-file={c / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--default-not-ready-toleration-seconds={DEFAULT_TOLERATION_SECONDS}",
            f"--default-unreachable-toleration-seconds={DEFAULT_TOLERATION_SECONDS}",
            f"--cert-dir={c / 'apiserver-generated'}"]


def _controller_common(l: Layout, port_name: str) -> list[str]:
    kc = str(l.kubeconfig)
    return [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1",
            f"--secure-port={l.port(port_name)}", "--leader-elect=false",
            f"--cert-dir={l.certs / (port_name + '-generated')}"]


def _controller_manager(l: Layout) -> list[str]:
    return _controller_common(l, "kube-controller-manager") + [
        f"--service-account-private-key-file={l.certs / 'sa.key'}",
        f"--root-ca-file={l.certs / 'ca.crt'}",
        "--use-service-account-credentials=false",
        "--node-monitor-period=1s", f"--node-monitor-grace-period={node_monitor_grace(l)}",
        "--node-startup-grace-period=20s",
        # Taint several dead nodes at once (default 0.1 node/s), and never treat a small
        # cluster's zone as "partially disrupted", which would stop evictions there.
        "--node-eviction-rate=10", "--unhealthy-zone-threshold=1"]


def _scheduler(l: Layout) -> list[str]:
    return _controller_common(l, "kube-scheduler")


def _kwok(l: Layout) -> list[str]:
    return [f"--kubeconfig={l.kubeconfig}",
            f"--manage-nodes-with-label-selector={KWOK_LABEL}={KWOK_MANAGED}",
            f"--node-lease-duration-seconds={l.kwok_lease_s}",
            f"--config={l.cache / 'kwok' / 'stages.yaml'}",
            f"--server-address=127.0.0.1:{l.port('kwok')}",
            "--cidr=10.244.0.0/16",
            "--v=WARN"]  # INFO logs every lease renewal: ~4 lines a second for 4 nodes


def _seaweedfs(l: Layout) -> list[str]:
    p = l.port
    return ["server", f"-dir={l.state / 'seaweedfs'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p('seaweedfs-master')}", f"-master.port.grpc={p('seaweedfs-master-grpc')}",
            "-master.volumeSizeLimitMB=256",
            f"-volume.port={p('seaweedfs-volume')}", f"-volume.port.grpc={p('seaweedfs-volume-grpc')}",
            "-volume.max=64",
            # SeaweedFS's default marks every volume read-only once the disk has under 1% free:
            # 2.5 GB on a 250 GB shared disk, which a test machine can reach while this stack's
            # few GB would still fit. Writes then fail with InternalError in the middle of the
            # suite; 256 MiB keeps the guard against a truly full disk.
            "-volume.minFreeSpace=256MiB",
            "-filer", f"-filer.port={p('seaweedfs-filer')}", f"-filer.port.grpc={p('seaweedfs-filer-grpc')}",
            "-s3", f"-s3.port={p('s3')}", f"-s3.port.grpc={p('s3-grpc')}",
            f"-s3.config={l.state / 'seaweedfs-s3.json'}",
            # Off: catalogs on fixed ports (8181, 9101) that a second server would collide on,
            # and usage reports to a URL outside this machine.
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]


def _prometheus(l: Layout) -> list[str]:
    return [f"--config.file={l.state / 'prometheus' / 'prometheus.yml'}",
            f"--storage.tsdb.path={l.state / 'prometheus' / 'data'}",
            f"--web.listen-address=127.0.0.1:{l.port('prometheus')}",
            "--web.enable-lifecycle", "--storage.tsdb.retention.time=2d"]


def _kueue(l: Layout) -> list[str]:
    return [f"--config={kueue_config_path(l)}", f"--kubeconfig={l.kubeconfig}"]


def _api_ok(l: Layout, s: dict, path: str, port: str, authenticated: bool = False) -> bool:
    ca = l.certs / "ca.crt" if port == "kube-apiserver" else None
    return procs.http_ok(f"https://127.0.0.1:{l.port(port)}{path}",
                         token=s["admin_token"] if authenticated else None, ca=ca)


SERVICES = [
    Service("etcd", "etcd", ("etcd", "etcd-peer"), _etcd,
            lambda l, s: procs.http_ok(f"http://127.0.0.1:{l.port('etcd')}/health")),
    Service("seaweedfs", "weed", ("s3", "s3-grpc", "seaweedfs-master", "seaweedfs-master-grpc",
                                  "seaweedfs-volume", "seaweedfs-volume-grpc", "seaweedfs-filer",
                                  "seaweedfs-filer-grpc"), _seaweedfs,
            # Any S3 answer (403 to an anonymous list) means the gateway is serving.
            lambda l, s: procs.http_ok(f"http://127.0.0.1:{l.port('s3')}/", accept=(200, 403)),
            timeout_s=90.0),
    Service("prometheus", "prometheus", ("prometheus",), _prometheus,
            lambda l, s: procs.http_ok(f"http://127.0.0.1:{l.port('prometheus')}/-/ready")),
    Service("kube-apiserver", "kube-apiserver", ("kube-apiserver",), _apiserver,
            lambda l, s: _api_ok(l, s, "/readyz", "kube-apiserver", authenticated=True),
            timeout_s=120.0),
    Service("kube-controller-manager", "kube-controller-manager", ("kube-controller-manager",),
            _controller_manager, lambda l, s: _api_ok(l, s, "/healthz", "kube-controller-manager")),
    Service("kube-scheduler", "kube-scheduler", ("kube-scheduler",), _scheduler,
            lambda l, s: _api_ok(l, s, "/healthz", "kube-scheduler")),
    Service("kwok", "kwok", ("kwok",), _kwok,
            lambda l, s: procs.http_ok(f"http://127.0.0.1:{l.port('kwok')}/healthz")),
    # Ready once its webhook server is listening (Kueue's own /readyz check).
    Service("kueue", "kueue", ("kueue-webhook", "kueue-health"), _kueue,
            lambda l, s: procs.http_ok(f"http://127.0.0.1:{l.port('kueue-health')}/readyz"),
            timeout_s=120.0, prepare=prepare_kueue),
]

# Which services must be healthy before a service starts (the rest start at once).
NEEDS = {
    "kube-apiserver": ["etcd"],
    "kube-controller-manager": ["kube-apiserver"],
    "kube-scheduler": ["kube-apiserver"],
    "kwok": ["kube-apiserver"],
    "kueue": ["kube-apiserver"],
}


def write_configs(layout: Layout, values: dict) -> None:
    s3 = {"identities": [{"name": "crucible",
                          "credentials": [{"accessKey": values["s3_access_key"],
                                           "secretKey": values["s3_secret_key"]}],
                          "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    s3_path = layout.state / "seaweedfs-s3.json"
    s3_path.touch(mode=0o600)
    s3_path.write_text(json.dumps(s3))
    kueue_path = kueue_config_path(layout)
    kueue_path.parent.mkdir(parents=True, exist_ok=True)
    for old in kueue_path.parent.glob("config-*.yaml"):
        if old != kueue_path:
            old.unlink()
    kueue_path.write_text(kueue_config(layout))
    (layout.state / "seaweedfs").mkdir(parents=True, exist_ok=True)
    (layout.prometheus_targets / "pods").mkdir(parents=True, exist_ok=True)
    layout.prometheus_rules.mkdir(parents=True, exist_ok=True)
    # Tests add scrape targets by dropping JSON files into targets/ (file_sd, re-read every
    # second) and rules by writing rules/*.yml then POSTing /-/reload.
    (layout.state / "prometheus" / "prometheus.yml").write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {layout.prometheus_rules}/*.yml
scrape_configs:
  - job_name: prometheus
    static_configs:
      - targets: ["127.0.0.1:{layout.port('prometheus')}"]
  - job_name: crucible
    # The operator's series carry each job's own `job` and `namespace` labels; keep them rather
    # than renaming them to exported_* (the chart's ServiceMonitor sets honorLabels too).
    honor_labels: true
    file_sd_configs:
      - files: ["{layout.prometheus_targets}/*.json"]
        refresh_interval: 1s
  - job_name: crucible-trainers
    # The trainers' series, as the chart's PodMonitor scrapes them: the tenant's code serves
    # them, so its labels do not win over the target's (`namespace` from the pod, `job` from
    # its crucible.dev/job label); what it exports under those names becomes exported_*.
    honor_labels: false
    sample_limit: 5000
    label_limit: 16
    metric_relabel_configs:
      - source_labels: [__name__]
        regex: crucible_operator_.*
        action: drop
    file_sd_configs:
      - files: ["{layout.prometheus_targets}/pods/*.json"]
        refresh_interval: 1s
""")


def reload_prometheus(layout: Layout) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{layout.port('prometheus')}/-/reload",
                                 method="POST")
    try:
        urllib.request.urlopen(req, timeout=10).close()
    except OSError as err:
        raise StackError(f"Prometheus did not reload its configuration: {err}") from None


def ensure_bucket(layout: Layout) -> None:
    """Create the test bucket through `weed shell` (the stack script has no S3 client)."""
    master = f"127.0.0.1:{layout.port('seaweedfs-master')}"
    filer = f"127.0.0.1:{layout.port('seaweedfs-filer')}"
    script = f"s3.bucket.create -name {S3_BUCKET}\nexit\n"
    proc = subprocess.run([str(layout.bin / "weed"), "shell", f"-master={master}",
                           f"-filer={filer}"], input=script, capture_output=True, text=True,
                          timeout=60)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "already exist" not in out:
        raise StackError(f"could not create bucket {S3_BUCKET}: {out.strip()[-300:]}")
