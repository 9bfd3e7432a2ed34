"""The proxy's Lua calls pipelined on one shared Redis connection: what one event-loop pass asks leaves in one
write, and the replies come back in order on the same connection.

Each Redis round trip through redis-py's pool is a socket write and read of its own, with the pool's checkout
around it. With 32 clients on one proxy process, several requests issue their script calls in the same pass
of the event loop; sent one by one, the sends alone were a quarter of the proxy's CPU on a loaded machine
(py-spy over ``bench/proxy_load.py``: loopback TCP sends are charged to the sender). Here a call is packed and
queued; the queue goes out as one write at the end of the pass; a reader task matches the replies to the
calls in order (Redis answers a connection's commands in the order they came).

Only non-blocking commands belong here (Lua scripts never block; a blocking read would hold up every call
behind it): ``state/lua.py`` sends its scripts through :meth:`RedisMux.execute` when the client has one. Any
failure of the shared connection (Redis restarted, a reply later than the socket timeout) fails every call
still waiting on it with the connection error and closes it; :class:`Lua` then sends that call through the
pool, as before (every proxy write tolerates a repeat: the pool's own retry already re-sends), and the next
call opens a new shared connection, no sooner than :data:`REOPEN_AFTER_S` after a failure.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from redis import exceptions as redis_exc

log = logging.getLogger("bucketrl.proxy")

# After the shared connection failed, calls go through the pool for this long before it is opened again.
REOPEN_AFTER_S = 1.0


class RedisMux:
    """One pipelined connection, made by ``pool``'s connection class and settings (auth, db, TLS, timeouts)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: Any = None
        self._opening: asyncio.Task[Any] | None = None
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._reader: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._failed_at = -REOPEN_AFTER_S

    @property
    def available(self) -> bool:
        return time.monotonic() - self._failed_at >= REOPEN_AFTER_S

    async def execute(self, *args: Any) -> Any:
        """Send one command on the shared connection; its reply (an error reply raises, as redis-py does)."""
        conn = self._conn if self._conn is not None and self._conn.is_connected else await self._open()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._out.extend(conn.pack_command(*args))
        self._waiting.append(fut)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        self._wake.set()
        return await fut

    async def _open(self) -> Any:
        # The connect runs as a task of its own that every caller awaits through a shield: a caller cancelled
        # mid-connect (its client went away) must not fail the others waiting on the same connect.
        if self._opening is None:
            self._opening = asyncio.get_running_loop().create_task(self._connect(), name="bucketrl-redis-mux-connect")
            self._opening.add_done_callback(_retrieve)
        return await asyncio.shield(self._opening)

    async def _connect(self) -> Any:
        try:
            conn = self._pool.connection_class(**self._pool.connection_kwargs)
            await conn.connect()
        except BaseException:
            self._failed_at = time.monotonic()
            raise
        finally:
            self._opening = None
        self._conn = conn
        self._reader = asyncio.create_task(self._read(conn), name="bucketrl-redis-mux-reader")
        return conn

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        conn = self._conn
        if not out or conn is None or conn._writer is None:
            return
        try:
            conn._writer.writelines(out)
        except Exception as exc:  # the reader sees the broken stream too and fails the calls
            log.warning("redis mux: write failed: %r", exc)

    async def _read(self, conn: Any) -> None:
        try:
            while True:
                while not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                    if self._conn is not conn:
                        return
                try:
                    reply = await conn.read_response()
                except redis_exc.ResponseError as err:  # an error reply: this call's answer, the stream is intact
                    reply = err
                fut = self._waiting.popleft()
                if fut.done():  # its caller went away (cancelled); the reply is still consumed in order
                    continue
                if isinstance(reply, BaseException):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
        except asyncio.CancelledError as exc:  # aclose(): it disconnects
            self._fail(conn, exc)
            raise
        except BaseException as exc:
            self._fail(conn, exc)
            await conn.disconnect(nowait=True)

    def _fail(self, conn: Any, exc: BaseException) -> None:
        if self._conn is conn:
            self._conn = None
            self._failed_at = time.monotonic()
        error = (
            exc
            if isinstance(exc, (redis_exc.ConnectionError, redis_exc.TimeoutError))
            else redis_exc.ConnectionError(f"redis mux: {exc!r}")
        )
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(error)
        self._out = []

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if self._reader is not None:
            self._reader.cancel()
        if conn is not None:
            await conn.disconnect(nowait=True)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a failed connect's exception as seen: its callers raised it, or all of them went away."""
    if not task.cancelled():
        task.exception()
