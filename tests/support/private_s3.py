"""A SeaweedFS S3 server of a test's own (the stack's binary, other ports, a temp folder), for
chaos tests that stop and restart the server without disturbing the shared stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "e2e"))

from stack import procs, services  # noqa: E402
from stack.layout import PORTS, Layout  # noqa: E402


# Beside the shared stack's ports, still below the ephemeral range; each pytest-xdist worker
# (PYTEST_XDIST_WORKER = gw0, gw1, ...; a crashed worker's replacement takes the next number) gets
# an offset of its own, chosen so that none of its ports is one of the shared stack's.
MAX_WORKERS = 16


def _offsets() -> list[int]:
    taken, found, offset = set(PORTS.values()), [], 200
    while len(found) < MAX_WORKERS:
        ports = {p + offset for p in PORTS.values()}
        if not ports & taken:
            found.append(offset)
            taken |= ports
        offset += 50
    return found


OFFSETS = _offsets()


def worker_offset() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw") or 0)
    if index >= MAX_WORKERS:
        raise RuntimeError(f"pytest-xdist worker {worker}: the private S3 has ports for "
                           f"{MAX_WORKERS} workers; run pytest with fewer (-n)")
    return OFFSETS[index]


@dataclass
class PrivateS3:
    layout: Layout
    values: dict
    proc: subprocess.Popen | None = None

    @classmethod
    def create(cls, folder: Path, port_offset: int | None = None) -> "PrivateS3":
        cache = Path(os.environ.get("CRUCIBLE_CACHE", Path.home() / ".cache" / "crucible"))
        layout = Layout(cache=cache, state=folder, kwok_nodes=2,
                        port_offset=worker_offset() if port_offset is None else port_offset)
        folder.mkdir(parents=True, exist_ok=True)
        values = services.ensure_secrets(layout)
        services.write_configs(layout, values)
        return cls(layout, values)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.layout.port('s3')}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint,
                "AWS_ACCESS_KEY_ID": self.values["s3_access_key"],
                "AWS_SECRET_ACCESS_KEY": self.values["s3_secret_key"],
                "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> None:
        svc = next(s for s in services.SERVICES if s.name == "seaweedfs")
        argv = [str(self.layout.bin / svc.binary), *svc.argv(self.layout)]
        self.proc = procs.start(self.layout, "seaweedfs", argv,
                                [self.layout.port(p) for p in svc.ports])
        procs.wait_until("private S3", lambda: svc.healthy(self.layout, self.values), 90,
                         self.layout.logs / "seaweedfs.log")
        services.ensure_bucket(self.layout)

    def freeze(self) -> None:
        """A store that hangs rather than refuses: connections are accepted (by the kernel) and
        never answered, until `thaw`."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # a frozen server cannot be reaped otherwise
            self.proc.send_signal(signal.SIGKILL)  # an outage, not a clean shutdown
            self.proc.wait(timeout=30)
        self.proc = None
