"""Start, find and stop the stack's processes by pid file, and wait for their health endpoints.

A pid file records the pid and the binary it ran, so a pid recycled by an unrelated process after
a crash is never signalled: `down` stops exactly what `up` started. Processes run in their own
session, so they outlive the `up` command and a Ctrl-C in the terminal that ran it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .layout import Layout, StackError


def _pid_file(layout: Layout, name: str) -> Path:
    return layout.pids / f"{name}.pid"


def running_pid(layout: Layout, name: str) -> int | None:
    """The pid of our `name` process if it is alive and still runs the binary we started."""
    path = _pid_file(layout, name)
    if not path.exists():
        return None
    try:
        pid_text, binary = path.read_text().split("\n")[:2]
        pid = int(pid_text)
        # /proc/<pid>/exe, not cmdline: cmdline reads empty for a moment after exec, and exe
        # is unreadable for zombies and kernel threads, which are "not running" for us.
        exe = os.readlink(f"/proc/{pid}/exe")
    except (ValueError, OSError):
        return None
    return pid if exe == os.path.realpath(binary) else None


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def start(layout: Layout, name: str, argv: list[str], ports: list[int],
          env: dict | None = None, port_wait_s: float = 10.0) -> subprocess.Popen:
    deadline = time.monotonic() + port_wait_s  # one we just stopped may still be closing sockets
    for port in ports:
        while not port_free(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not port_free(port):
            raise StackError(f"port {port} (needed by {name}) is in use by another process; stop "
                             "it, or shift the stack's ports with CRUCIBLE_PORT_OFFSET=<n>")
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.pids.mkdir(parents=True, exist_ok=True)
    log = open(layout.logs / f"{name}.log", "ab")
    log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {name}\n".encode())
    log.flush()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=layout.state, env=env, start_new_session=True)
    log.close()
    _pid_file(layout, name).write_text(f"{proc.pid}\n{argv[0]}\n{argv_digest(argv)}\n")
    return proc


def argv_digest(argv: list[str]) -> str:
    return hashlib.sha256("\0".join(argv).encode()).hexdigest()[:16]


def started_with(layout: Layout, name: str) -> str | None:
    """The argv digest the running `name` was started with (None if unknown)."""
    lines = _pid_file(layout, name).read_text().split("\n") if _pid_file(layout, name).exists() else []
    return lines[2] if len(lines) > 2 and lines[2] else None


def stop(layout: Layout, name: str, grace_s: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after `grace_s`. Returns whether a process was running."""
    pid = running_pid(layout, name)
    _pid_file(layout, name).unlink(missing_ok=True)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return True


def _alive(pid: int) -> bool:
    try:
        # Reap it if it is our child (a zombie still answers kill 0).
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def http_ok(url: str, *, token: str | None = None, ca: Path | None = None,
            accept: tuple[int, ...] = (200,)) -> bool:
    """True if `url` answers with one of the `accept` statuses within two seconds."""
    if ca is not None:
        ctx = ssl.create_default_context(cafile=str(ca))
    else:
        # Health checks of components that serve with their own self-signed certificates.
        ctx = ssl._create_unverified_context()
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=2, context=ctx) as resp:
            return resp.status in accept
    except urllib.error.HTTPError as err:
        return err.code in accept
    except (OSError, ValueError):
        return False


def wait_until(what: str, check, timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    detail = ""
    if log is not None and log.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-10:]
        detail = f"; last lines of {log}:\n" + "\n".join("    " + line for line in tail)
    raise StackError(f"{what} not ready after {timeout_s:.0f}s{detail}")
