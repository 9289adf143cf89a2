"""The Helm chart (charts/crucible): `helm` itself, the chart rendered, and an installed release.

- `helm(*args)`: the stack's helm, failing with its stderr unless `check=False`;
- `render(values, ...)`: `helm template` of the chart, parsed; `by_kind` picks documents;
- `Release`: what the ship tests' `release` fixture installed.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.repo import REPO
from tests.support.tools import tool

CHART = REPO / "charts" / "crucible"


def helm(*args: str, kubeconfig: Path | None = None, check: bool = True,
         timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {})}
    proc = subprocess.run([tool("helm"), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def render(values: dict | None = None, *, release: str = "crucible",
           namespace: str = "crucible-system", include_crds: bool = False) -> list[dict]:
    """`helm template` with these values; the documents, parsed."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    with tempfile.TemporaryDirectory() as tmp:
        if values:
            path = Path(tmp) / "values.yaml"
            path.write_text(yaml.safe_dump(values))
            args += ["--values", str(path)]
        out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@dataclass
class Release:
    name: str
    namespace: str          # where the operator runs
    jobs_namespace: str     # the one namespace it serves
    operator_account: str
    operator_kubeconfig: Path
    manifest: list[dict]    # what helm installed (helm get manifest)
