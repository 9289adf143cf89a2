"""A TCP forwarder a test can cut: one client's path to the apiserver, refused on demand.

Stands in for what happens between an operator replica and the apiserver in a real cluster (a
node's network partitioned, a load balancer dropping it): `cut()` closes every forwarded
connection and the listening socket, so new connections are refused (the client sees a refused
connection, urllib3's `MaxRetryError`); `restore()` listens on the same port again. TLS passes
through untouched: the client still talks to the real apiserver.
"""

from __future__ import annotations

import socket
import threading
from contextlib import suppress

from tests.support.services import eventually


class Forwarder:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self._listen()

    # -- control --------------------------------------------------------------------------------
    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            open_ = list(self._sockets)
            self._sockets.clear()
        if listener is not None:
            with suppress(OSError):
                listener.close()
        for sock in open_:
            with suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00"
                                b"\x00\x00\x00\x00")  # linger 0: RST, not a polite FIN
                sock.close()

    def restore(self) -> None:
        eventually(lambda: self._listen() or True, 10, f"port {self.port} free to listen again")

    def close(self) -> None:
        self.cut()

    # -- plumbing -------------------------------------------------------------------------------
    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return                      # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:   # cut meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
