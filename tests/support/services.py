"""Thin handles on the real services of the test stack, built from its env file.

Each handle only knows addresses and credentials plus the few helpers tests share (a fresh
namespace, killing a node's heartbeat, a boto3 client, adding a Prometheus scrape target); the
tests themselves talk to the services through the official clients.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def read_env_file(path: Path | None = None, text: str | None = None) -> dict[str, str]:
    """Parse `export KEY=VALUE` lines as written by `e2e/stack.sh env`."""
    text = path.read_text() if path is not None else text or ""
    env = {}
    for line in text.splitlines():
        line = line.strip().removeprefix("export ").strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            env[key] = value
    return env


def eventually(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.25) -> T:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as err:  # noqa: BLE001 - kept and reported if the deadline passes
            last_error = err
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}"
                         + (f" (last error: {last_error!r})" if last_error else ""))


@dataclass
class Kube:
    kubeconfig: Path
    nodes: list[str]
    kwok_label: str

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Kube":
        return cls(Path(env["KUBECONFIG"]), env["CRUCIBLE_KWOK_NODE_NAMES"].split(","),
                   env["CRUCIBLE_KWOK_LABEL"])

    def client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.client())

    def create_namespace(self, hint: str) -> str:
        from kubernetes import client

        stem = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-")[:40].strip("-")
        name = f"t-{stem}-{secrets.token_hex(3)}"
        core = self.core()
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        # Pods are refused until the controller-manager has created the "default" SA.
        eventually(lambda: core.read_namespaced_service_account("default", name), 30,
                   f"ServiceAccount default in {name}")
        return name

    def delete_stale_test_namespaces(self, older_than_s: float = 900) -> list[str]:
        """Delete the namespaces of an earlier test run that was killed before its clean-up.

        Their pods would keep holding the simulated GPUs. Only namespaces older than any test
        can live (pytest's timeout is 600 s) are touched, so a run beside this one loses nothing.
        """
        now = datetime.now(timezone.utc)
        stale = [ns.metadata.name for ns in self.core().list_namespace().items
                 if ns.metadata.name.startswith("t-") and ns.metadata.deletion_timestamp is None
                 and (now - ns.metadata.creation_timestamp).total_seconds() > older_than_s]
        for name in stale:
            self.delete_namespace(name)
        return stale

    def delete_namespace(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core().delete_namespace(name)
        except ApiException as err:
            if err.status != 404:
                raise

    def set_node_alive(self, node: str, alive: bool) -> None:
        """Stop (or resume) a node's heartbeat by moving it out of KWOK's label selector."""
        value = "managed" if alive else "dead"
        self.core().patch_node(node, {"metadata": {"labels": {self.kwok_label: value}}})

    def node_healthy(self, node: str) -> bool:
        """Ready, and free of the taints the node lifecycle controller adds to a lost node (they
        outlive the heartbeat's return by a few seconds, and a pod can't schedule until then)."""
        found = self.core().read_node(node)
        ready = next((c for c in found.status.conditions or [] if c.type == "Ready"), None)
        return ready is not None and ready.status == "True" and not any(
            t.key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
            for t in found.spec.taints or [])

    def wait_nodes_healthy(self, nodes: list[str] | None = None, timeout_s: float = 90) -> None:
        for node in nodes or self.nodes:
            eventually(lambda: self.node_healthy(node), timeout_s, f"{node} Ready and untainted")


@dataclass
class S3:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "S3":
        return cls(env["CRUCIBLE_S3_ENDPOINT"], env["CRUCIBLE_S3_BUCKET"],
                   env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                   env.get("AWS_DEFAULT_REGION", "us-east-1"))

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region,
                            config=Config(s3={"addressing_style": "path"},
                                          retries={"max_attempts": 3}))


@dataclass
class Prometheus:
    url: str
    targets_dir: Path

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Prometheus":
        return cls(env["CRUCIBLE_PROMETHEUS_URL"], Path(env["CRUCIBLE_PROMETHEUS_TARGETS_DIR"]))

    def add_target(self, name: str, address: str, labels: dict[str, str] | None = None, *,
                   pod: bool = False) -> Path:
        """Scrape `address` (host:port) from now on; file_sd picks it up within a second.
        `pod`: as the chart's PodMonitor scrapes a trainer (its own labels do not win)."""
        path = self.targets_dir / ("pods" if pod else "") / f"{name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [address], "labels": labels or {}}]))
        tmp.rename(path)  # Prometheus must never read a half-written file
        return path

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"PromQL {expr!r} failed: {body}")
        return body["data"]["result"]
