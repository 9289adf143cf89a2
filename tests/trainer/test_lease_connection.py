"""The trainer's progress Lease writer when the apiserver cannot be reached.

No stack: the kubeconfig names a port where nothing listens (connection refused), which is what
an apiserver restart or a control-plane blip looks like from a trainer pod.
"""

from __future__ import annotations

import socket
import time

from crucible.trainer.lease import ProgressLease


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]     # closed again on leaving: connections are refused


def test_the_lease_writer_survives_an_unreachable_apiserver(tmp_path, monkeypatch, caplog):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:{_closed_port()}",
                                 insecure-skip-tls-verify: true}}}}]
users: [{{name: u, user: {{token: "not-a-secret"}}}}]
contexts: [{{name: c, context: {{cluster: c, user: u}}}}]
current-context: c
""")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    lease = ProgressLease("ns", "gpt", holder="gpt-0-0", interval_s=0.2)
    try:
        lease.update(step=1, tokens=1024, loss=3.0)
        lease.flush()       # urllib3's MaxRetryError is not an OSError: it must not escape
        time.sleep(1.0)     # several of the thread's own flushes, each refused
        assert lease._thread.is_alive(), "one refused connection ended the progress reports"
    finally:
        lease.close()
    refused = [r for r in caplog.records if "not updated" in r.getMessage()]
    assert len(refused) >= 3
    assert all("not-a-secret" not in r.getMessage() for r in caplog.records)
