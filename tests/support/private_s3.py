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
from stack.layout import Layout  # noqa: E402


PORT_OFFSET = 200  # beside the shared stack's ports, still below the ephemeral range


@dataclass
class PrivateS3:
    layout: Layout
    values: dict
    proc: subprocess.Popen | None = None

    @classmethod
    def create(cls, folder: Path, port_offset: int = PORT_OFFSET) -> "PrivateS3":
        cache = Path(os.environ.get("CRUCIBLE_CACHE", Path.home() / ".cache" / "crucible"))
        layout = Layout(cache=cache, state=folder, port_offset=port_offset, kwok_nodes=2)
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

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # an outage, not a clean shutdown
            self.proc.wait(timeout=30)
        self.proc = None
