"""Build (once) every binary the local stack runs, from the Go module proxy and Debian's packages.

Nothing here downloads a release binary or a container image:
- kube-apiserver, kube-controller-manager, kube-scheduler and etcd are compiled from the wrapper
  module in e2e/gobuild/kube (k8s.io/kubernetes pins its staging modules to local paths, which
  only a wrapper's `replace` can undo: `go install pkg@version` refuses a module whose go.mod
  has replace directives; e2e/gobuild/kube/go.mod pins each one to its published version);
- KWOK and helm install straight from the proxy (`go install pkg@version`), and KWOK's stage
  definitions are copied out of its module zip, because KWOK v0.8.0 ships no built-in stages;
- Kueue (Apache-2.0) installs from the proxy the same way; its CRDs and webhook manifests are
  copied out of its module zip (services.py installs them, rewritten for a local process);
- SeaweedFS's `weed` (Apache-2.0) is compiled from e2e/gobuild/seaweedfs, whose replace directive
  `go install` would refuse;
- Prometheus and promtool come out of Debian's `prometheus` package, unpacked without installing
  it (installing would try to start a system service).

Each target writes a stamp holding its pinned version; a target rebuilds only when its outputs are
missing or its pin changed, so a warm `up` does no building at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .layout import GOBUILD, Layout, StackError

KUBERNETES = "v1.36.3"
ETCD = "v3.6.8"  # what k8s.io/apiserver v0.36.3 requires; a newer etcd would change its client libs
KWOK = "v0.8.0"
HELM = "v3.21.4"
KUEUE = "v0.17.0"
SEAWEEDFS = "v0.0.0-20261109003541-7506e5f91cd6"
PROMETHEUS_DEB = "2.42.0+ds-5+deb12u1"

# The stage files (under the KWOK module's kustomize/stage/) the stack loads: nodes come up Ready
# and heartbeat through their Lease; pods bound to a managed node become Running, pods owned by a
# Job complete, deleted pods go away; the chaos stages fail a pod's container or report a node
# NotReady on request (by label, see the files).
KWOK_STAGES = [
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "node/chaos/node-not-ready.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
]


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, log: Path) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise StackError(f"`{' '.join(cmd[:3])} …` failed (exit {proc.returncode}); "
                         f"full log: {log}\n" + "\n".join("    " + line for line in tail))


def _go_env(layout: Layout) -> dict:
    if not shutil.which("go"):
        raise StackError("`go` is not on PATH: install Go ≥ 1.26 (the stack compiles Kubernetes, "
                         "etcd, KWOK, helm, Kueue and SeaweedFS from the Go module proxy)")
    env = dict(os.environ, CGO_ENABLED="0", GOBIN=str(layout.bin))
    env.setdefault("GOTOOLCHAIN", "local")  # every pinned module declares go ≤ 1.26.6
    return env


def _gomodcache(env: dict) -> Path:
    out = subprocess.run(["go", "env", "GOMODCACHE"], env=env, capture_output=True, text=True)
    return Path(out.stdout.strip())


def build_kube(layout: Layout, log: Path) -> None:
    env = _go_env(layout)
    ver = "k8s.io/component-base/version"
    minor = KUBERNETES.split(".")[1]
    # Stamp the version: unstamped builds report v0.0.0-master, which confuses version checks.
    ldflags = f"-s -w -X {ver}.gitVersion={KUBERNETES} -X {ver}.gitMajor=1 -X {ver}.gitMinor={minor}"
    cmds = [f"k8s.io/kubernetes/cmd/{c}" for c in
            ("kube-apiserver", "kube-controller-manager", "kube-scheduler")]
    _run(["go", "build", "-trimpath", "-ldflags", ldflags, "-o", f"{layout.bin}/", *cmds],
         cwd=GOBUILD / "kube", env=env, log=log)
    # -o names the file: Go would otherwise call the etcd main package "v3" or "server".
    _run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(layout.bin / "etcd"),
          "go.etcd.io/etcd/server/v3"], cwd=GOBUILD / "kube", env=env, log=log)


def build_kwok(layout: Layout, log: Path) -> None:
    env = _go_env(layout)
    _run(["go", "install", "-trimpath", "-ldflags", "-s -w", f"sigs.k8s.io/kwok/cmd/kwok@{KWOK}"],
         env=env, log=log)
    stage_root = _gomodcache(env) / f"sigs.k8s.io/kwok@{KWOK}" / "kustomize" / "stage"
    docs = [(stage_root / rel).read_text().strip() for rel in KWOK_STAGES]
    (layout.cache / "kwok").mkdir(parents=True, exist_ok=True)
    (layout.cache / "kwok" / "stages.yaml").write_text("\n---\n".join(docs) + "\n")


def build_kueue(layout: Layout, log: Path) -> None:
    env = _go_env(layout)
    # Stamp the version Kueue logs at start-up (unstamped it says v0.0.0-main).
    ldflags = f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE}"
    _run(["go", "install", "-trimpath", "-ldflags", ldflags,
          f"sigs.k8s.io/kueue/cmd/kueue@{KUEUE}"], env=env, log=log)
    components = _gomodcache(env) / f"sigs.k8s.io/kueue@{KUEUE}" / "config" / "components"
    dest = layout.cache / "kueue"
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "crds").mkdir(parents=True)
    for crd in sorted((components / "crd" / "bases").glob("*.yaml")):
        shutil.copyfile(crd, dest / "crds" / crd.name)  # copyfile: not the cache's read-only mode
    shutil.copyfile(components / "webhook" / "manifests.yaml", dest / "webhooks.yaml")
    # The CRDs whose versions Kueue converts (/convert on its webhook server): kustomize patches
    # them in upstream; services.py adds the same stanza, pointed at the local process.
    kustomization = (components / "crd" / "kustomization.yaml").read_text()
    converted = re.findall(r"^- path: patches/webhook_in_([a-z]+)\.yaml$", kustomization, re.M)
    if not converted:
        raise StackError(f"no conversion patches found in Kueue {KUEUE}'s CRD kustomization")
    (dest / "conversion.json").write_text(json.dumps(converted) + "\n")


def build_helm(layout: Layout, log: Path) -> None:
    env = _go_env(layout)
    minor = KUBERNETES.split(".")[1]
    # Stamp the version, and make offline `helm template` assume our Kubernetes rather than 1.20.
    ldflags = (f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM} "
               f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor}")
    _run(["go", "install", "-trimpath", "-ldflags", ldflags, f"helm.sh/helm/v3/cmd/helm@{HELM}"],
         env=env, log=log)


def build_seaweedfs(layout: Layout, log: Path) -> None:
    _run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(layout.bin / "weed"),
          "github.com/seaweedfs/seaweedfs/weed"], cwd=GOBUILD / "seaweedfs", env=_go_env(layout),
         log=log)


def build_prometheus(layout: Layout, log: Path) -> None:
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise StackError("apt-get/dpkg-deb not found: Prometheus comes from Debian's "
                         "`prometheus` package; run on Debian or put prometheus/promtool in "
                         f"{layout.bin}")
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        pinned = ["apt-get", "download", f"prometheus={PROMETHEUS_DEB}"]
        if subprocess.run(pinned, cwd=tmpdir, capture_output=True).returncode != 0:
            # Debian replaces a point release's package when a security update lands; take the
            # current one from the same release rather than fail, and say so in the log.
            with open(log, "a") as out:
                out.write(f"prometheus={PROMETHEUS_DEB} not served; taking the current package\n")
            if os.geteuid() == 0:
                _run(["apt-get", "update", "-qq"], log=log)
            _run(["apt-get", "download", "prometheus"], cwd=tmpdir, log=log)
        deb = next(tmpdir.glob("prometheus_*.deb"))
        _run(["dpkg-deb", "-x", str(deb), str(tmpdir / "root")], log=log)
        for name in ("prometheus", "promtool"):
            shutil.copy2(tmpdir / "root" / "usr" / "bin" / name, layout.bin / name)


@dataclass(frozen=True)
class Target:
    name: str
    pin: str
    outputs: tuple[str, ...]
    build: Callable[[Layout, Path], None]


TARGETS = [
    Target("kube", f"{KUBERNETES} etcd {ETCD}",
           ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd"), build_kube),
    Target("kwok", KWOK, ("kwok",), build_kwok),
    Target("helm", HELM, ("helm",), build_helm),
    # The manifests sit beside bin/, in the cache's kueue/ folder; naming one here rebuilds the
    # target if that folder goes missing.
    Target("kueue", KUEUE, ("kueue", "../kueue/conversion.json"), build_kueue),
    Target("seaweedfs", SEAWEEDFS, ("weed",), build_seaweedfs),
    Target("prometheus", PROMETHEUS_DEB, ("prometheus", "promtool"), build_prometheus),
]


def _stamp(layout: Layout, target: Target) -> Path:
    return layout.bin / f".{target.name}.pin"


def is_built(layout: Layout, target: Target) -> bool:
    stamp = _stamp(layout, target)
    return (stamp.exists() and stamp.read_text() == target.pin
            and all((layout.bin / out).exists() for out in target.outputs))


def build_all(layout: Layout, only: list[str] | None = None) -> None:
    layout.bin.mkdir(parents=True, exist_ok=True)
    (layout.cache / "logs").mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        if only and target.name not in only:
            continue
        if is_built(layout, target):
            continue
        log = layout.cache / "logs" / f"build-{target.name}.log"
        print(f"building {target.name} ({target.pin}); log: {log}", file=sys.stderr, flush=True)
        started = time.monotonic()
        target.build(layout, log)
        _stamp(layout, target).write_text(target.pin)
        print(f"built {target.name} in {time.monotonic() - started:.0f}s", file=sys.stderr,
              flush=True)
