"""uvicorn's httptools protocol, with each response leaving in one send instead of two.

uvicorn writes a response's status line and headers, then its body, as two ``transport.write`` calls, so
every answer costs two socket sends (two TCP segments: ``TCP_NODELAY`` is on) and wakes the client twice.
On a loopback-heavy deployment (clients, proxy and Redis sharing a few cores) those sends are a visible
share of the proxy's CPU per request. :class:`CoalescingHttpToolsProtocol` hands the protocol a transport
that gathers the writes made in one event-loop pass and sends them together at the end of the pass. Large
writes (streamed adapters and checkpoints) go out at once, in order, so nothing big is ever held and
uvicorn's flow control sees the real transport's buffer.

``bucketrl proxy`` serves with it (``cli.py`` passes ``http=HTTP_PROTOCOL``) whenever httptools is installed (it
comes with ``uvicorn[standard]``); without httptools uvicorn's own choice stands.

Slow clients: uvicorn closes idle keep-alive connections, but nothing bounds how long a client may take to send
a request's HEADERS (1,000 connections trickling header bytes stayed open for 20 s, each holding a socket and
a protocol object). The protocol closes a connection whose request line and headers are not complete within
:data:`HEADER_TIMEOUT_S` of its opening or of the previous response (``BUCKETRL_HEADER_TIMEOUT_S``). Bodies
are not timed here: a large upload legitimately takes long, and its reader is bounded by the body limits.
The number of connections per process is bounded by uvicorn's ``limit_concurrency`` (``cli.py``,
``BUCKETRL_MAX_CONNECTIONS``): beyond it a request is answered 503 at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Writes at least this big (or a gather reaching it) are sent at once instead of at the end of the pass.
WRITE_THROUGH_BYTES = 64 * 1024
# Seconds a client has to send a request's line and headers (set from the settings by create_app(serving=True)).
HEADER_TIMEOUT_S = 10.0


class CoalescingTransport:
    """Wraps a transport: small writes of one loop pass leave as one ``write``; everything else delegates."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._scheduled = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= WRITE_THROUGH_BYTES:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush_scheduled)

    def _flush_scheduled(self) -> None:
        self._scheduled = False
        self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()  # a response written just before close (Connection: close) still leaves first
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this keep-alive connection gets the same bound

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


HTTP_PROTOCOL = f"{__name__}:CoalescingHttpToolsProtocol"
