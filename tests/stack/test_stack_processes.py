"""`e2e/stack.sh down` stops exactly what `up` started: pid files never signal a stranger."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "e2e"))

from stack import procs  # noqa: E402
from stack.layout import PORTS, Layout, StackError  # noqa: E402
from tests.support.private_s3 import OFFSETS  # noqa: E402


@pytest.fixture
def layout(tmp_path) -> Layout:
    layout = Layout(cache=tmp_path / "cache", state=tmp_path / "state", port_offset=0, kwok_nodes=2)
    layout.state.mkdir(parents=True)
    return layout


def test_start_then_stop_by_pid_file(layout):
    proc = procs.start(layout, "sleeper", ["/bin/sleep", "300"], ports=[])
    assert procs.running_pid(layout, "sleeper") == proc.pid
    assert procs.stop(layout, "sleeper") is True
    proc.wait(timeout=10)  # stop() already reaped it (it is our child here): it is gone
    assert not os.path.exists(f"/proc/{proc.pid}/exe")
    assert procs.running_pid(layout, "sleeper") is None
    assert procs.stop(layout, "sleeper") is False  # idempotent


def test_recycled_pid_is_never_signalled(layout):
    # A stale pid file whose pid now belongs to an unrelated process (here: a process running a
    # different binary) must be treated as "not running" and left alone.
    stranger = subprocess.Popen(["/bin/cat"], stdin=subprocess.PIPE)
    try:
        layout.pids.mkdir(parents=True, exist_ok=True)
        (layout.pids / "etcd.pid").write_text(f"{stranger.pid}\n/some/where/etcd\n")
        assert procs.running_pid(layout, "etcd") is None
        assert procs.stop(layout, "etcd") is False
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_port_in_use_is_one_clear_error(layout):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(StackError, match=rf"port {port} \(needed by web\) is in use"):
            procs.start(layout, "web", ["/bin/sleep", "1"], ports=[port], port_wait_s=0.5)


def test_every_port_is_below_the_ephemeral_range():
    # A server restarted on a port in the ephemeral range can find it taken by some outgoing
    # connection's local end; the private S3 that chaos tests kill and restart sits at an offset.
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert max(PORTS.values()) + max(OFFSETS) < low, (max(PORTS.values()), max(OFFSETS), low)
    # Each pytest worker's private S3 has ports of its own, none of them the shared stack's.
    blocks = [{p + offset for p in PORTS.values()} for offset in [0, *OFFSETS]]
    assert sum(map(len, blocks)) == len(set().union(*blocks))
    assert min(PORTS.values()) >= 1024  # never a privileged port


def test_stack_script_reports_missing_toolchain_in_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CRUCIBLE_CACHE": str(tmp_path / "c")}
    if os.path.exists("/usr/bin/go"):
        pytest.fail("this test assumes go is not in /usr/bin; adjust the PATH it uses")
    out = subprocess.run([str(REPO / "e2e" / "stack.sh"), "build", "kwok"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().endswith("Go module proxy)")
    assert "Traceback" not in out.stderr


@pytest.mark.stack
def test_the_printed_env_is_an_environment_the_script_accepts(stack_env):
    """eval "$(e2e/stack.sh env)", then any verb: the env names the nodes beside their count."""
    script = REPO / "e2e" / "stack.sh"
    out = subprocess.run(["bash", "-c", f'eval "$({script} env)" && {script} status'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "not an integer" not in out.stderr
    assert stack_env["CRUCIBLE_KWOK_NODES"] == str(len(stack_env["CRUCIBLE_KWOK_NODE_NAMES"].split(",")))


def test_the_s3_store_stays_writable_on_a_big_disk_with_little_free(layout):
    # SeaweedFS's default guard is a share of the disk (1%): on a shared 250 GB disk with 2.4 GB
    # free every volume turned read-only and S3 writes failed mid-suite with InternalError. The
    # guard must be an absolute size, small beside what the suite writes but not zero.
    from stack import services
    svc = next(s for s in services.SERVICES if s.name == "seaweedfs")
    flags = dict(a.lstrip("-").split("=", 1) for a in svc.argv(layout) if "=" in a)
    assert "volume.minFreeSpacePercent" not in flags
    guard = flags.get("volume.minFreeSpace", "1")
    number, unit = guard.rstrip("KMGTiB"), guard[len(guard.rstrip("KMGTiB")):]
    assert unit, f"volume.minFreeSpace={guard} is a percentage of the disk, not a size"
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert 64 * 2**20 <= float(number) * scale <= 1 * 2**30, guard
