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
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Writes at least this big (or a gather reaching it) are sent at once instead of at the end of the pass.
WRITE_THROUGH_BYTES = 64 * 1024


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
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]


HTTP_PROTOCOL = f"{__name__}:CoalescingHttpToolsProtocol"
