"""Fault injection at the edge of a real service: a TCP gate in front of an endpoint (the S3 server).

:class:`TcpGate` listens on its own loopback port and forwards every connection to ``target`` while
``mode == "open"``. It stands in for the network and the store's front end, so a test can take a real S3
endpoint (moto) away without losing what it holds (moto keeps objects in memory: stopping it would be a
bucket wipe, not an outage):

- ``"refuse"``: the listening socket is closed and live connections are cut: connection refused, as when
  the S3 server is stopped;
- ``"error"``: every request is answered ``503 Slow Down`` (an overloaded or failing store front end);
- ``"hang"``: connections are accepted and never answered (a store that stopped responding: timeouts);
- ``"open"``: forwarding again (the server restarted).

    gate = TcpGate(moto.port).start()
    store = S3Store(bucket, endpoint_url=gate.endpoint)
    gate.set_mode("refuse"); ...; gate.set_mode("open")
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Literal

from tests.support.services import free_port

Mode = Literal["open", "refuse", "error", "hang"]

_ERROR_RESPONSE = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: 107\r\n\r\n"
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>injected</Message></Error>\n"
)


class TcpGate:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.mode: Mode = "open"
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._stopped = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpGate:
        self._listen()
        return self

    def set_mode(self, mode: Mode) -> None:
        with self._lock:
            self.mode = mode
        if mode == "refuse":
            self._close_listener()
            self._cut_all()
        else:
            self._cut_all()  # no connection opened in another mode carries on in this one
            if self._listener is None:
                self._listen()

    def stop(self) -> None:
        self._stopped = True
        self._close_listener()
        self._cut_all()

    # -- internals ---------------------------------------------------------------------------------
    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True, name=f"gate-{self.port}").start()

    def _close_listener(self) -> None:
        sock, self._listener = self._listener, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _cut_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed
            with self._lock:
                mode = self.mode
            if mode == "error":
                threading.Thread(target=self._answer_error, args=(client,), daemon=True).start()
                continue
            if mode == "hang":
                with self._lock:
                    self._conns.add(client)  # held open, unread, until the mode changes
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _answer_error(client: socket.socket) -> None:
        with client:
            client.settimeout(5)
            try:
                data = b""
                while b"\r\n\r\n" not in data:  # the request head; a body is ignored (the connection closes)
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                client.sendall(_ERROR_RESPONSE)
            except OSError:
                return

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
