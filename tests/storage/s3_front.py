"""A loopback HTTP front for the S3 test server (moto), so the S3 backend can be tested in both addressing styles
with the endpoints real stores document. Nothing it touches leaves loopback.

- **Virtual-hosted names** (``http://<bucket>.localhost:<port>/key``). RFC 6761 reserves ``.localhost`` for
  loopback, and systemd-resolved and browsers resolve every ``*.localhost`` name to 127.0.0.1, but this machine's
  resolver (glibc: files, then DNS) knows only ``localhost`` itself, and /etc/hosts is not ours to change. So the
  client is given this front as its HTTP proxy (botocore honours ``HTTP_PROXY`` as any S3 client behind a proxy
  does): the request arrives in absolute form, ``GET http://<bucket>.localhost:<port>/key``, its ``Host`` header
  untouched, and the front does the one thing the missing resolver rule would, connecting to loopback. moto then
  reads the bucket from the ``Host`` header, as S3 does. A host outside ``.localhost`` is refused (403).
- **An endpoint with a path** (``http://127.0.0.1:<port>/<namespace>``, as a Hugging Face Storage Bucket's gateway
  ``https://s3.hf.co/<namespace>``): the front takes the namespace off the path before moto sees it, as the
  gateway does. moto does not check SigV4 signatures, so the shortened path still passes; the real gateway signs
  over the whole path, which the client computes the same way either way.

Each request is recorded (method, Host header, path as received, the Authorization header's credential scope),
so a test can assert what actually went over the wire. Every exchange is one request per connection (the front
asks moto for ``Connection: close``), which keeps the relay byte-for-byte.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from tests.support.services import free_port


@dataclass(frozen=True)
class Seen:
    method: str
    host: str
    path: str
    scope: str  # "<date>/<region>/s3/aws4_request" from the SigV4 Authorization header, "" when unsigned


class S3Front:
    def __init__(self, upstream_port: int, *, namespace: str = "") -> None:
        self.upstream_port, self.namespace = upstream_port, namespace.strip("/")
        self.port = free_port()
        self.seen: list[Seen] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        request_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        method, target, version = request_line.split(" ", 2)
        headers = [
            line for line in lines if line.split(":", 1)[0].strip().lower() not in ("connection", "proxy-connection")
        ]
        host = next((h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("host:")), "")
        if target.startswith("http://"):  # absolute form: we are the client's proxy
            parts = urlsplit(target)
            name = parts.hostname or ""
            if name != "localhost" and not name.endswith(".localhost"):
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            path = parts.path + (f"?{parts.query}" if parts.query else "")
        else:
            path = target
        received = path
        if self.namespace:
            prefix = f"/{self.namespace}"
            if path != prefix and not path.startswith((prefix + "/", prefix + "?")):
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            path = path[len(prefix) :] or "/"
            if path.startswith("?"):
                path = "/" + path
        auth = next((h for h in headers if h.lower().startswith("authorization:")), "")
        m = re.search(r"Credential=[^/]+/([^,]+)", auth)
        self.seen.append(Seen(method, host, received, m.group(1) if m else ""))
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        out_head = "\r\n".join([f"{method} {path} {version}", *headers, "Connection: close", "", ""])
        up_writer.write(out_head.encode("latin-1"))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while chunk := await src.read(1 << 16):
                    dst.write(chunk)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass

        upload = asyncio.ensure_future(pipe(reader, up_writer))
        await pipe(up_reader, writer)  # the answer, until moto closes (Connection: close)
        upload.cancel()
        for w in (up_writer, writer):
            w.close()

    def start(self) -> S3Front:
        ready = threading.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            ready.set()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="s3-front", daemon=True)
        self._thread.start()
        assert ready.wait(10), "the S3 front did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> S3Front:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
