"""Kubeconfigs for another identity: the admin kubeconfig's server and CA with a real token."""

from __future__ import annotations

from pathlib import Path

import yaml
from kubernetes import client

from tests.support.services import Kube


def write_kubeconfig(admin: Path, token: str, path: Path) -> Path:
    """Same server and CA as the admin kubeconfig, another identity."""
    doc = yaml.safe_load(admin.read_text())
    doc["users"] = [{"name": "sa", "user": {"token": token}}]
    doc["contexts"] = [{"name": "sa", "context": {"cluster": doc["clusters"][0]["name"],
                                                 "user": "sa"}}]
    doc["current-context"] = "sa"
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


def token_kubeconfig(kube: Kube, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig holding a real (TokenRequest) token of this ServiceAccount."""
    token = client.CoreV1Api(kube.client()).create_namespaced_service_account_token(
        account, namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=3600))).status.token
    return write_kubeconfig(kube.kubeconfig, token, path)
