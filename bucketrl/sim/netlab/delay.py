"""A TCP relay that delays each direction by a set one-way delay: the lab's stand-in for ``netem delay``.

The kernel's ``netem`` qdisc is missing on these machines, so delay is emulated in userspace: the relay accepts a
connection, opens one to the target, and forwards each chunk it reads only once ``one_way_ms`` has passed since it
was read. Chunks leave in the order they came (one FIFO per direction, due times never decrease), so the byte
stream is exactly the one sent, just late. Bandwidth is not the relay's business: the link's ``tbf`` qdiscs set it.

Back-pressure: at most ``window_bytes`` per direction wait in the relay. When the receiver stops reading, the
relay's writes block, the FIFO fills, the relay stops reading, and the sender's TCP window closes, as it would
over a real link. The bound also caps one connection's throughput at ``window_bytes / one_way_delay`` (4 MiB at
50 ms: 670 Mbit/s), which is a window limit like a real TCP's, only set by hand.

What this does NOT reproduce (say so wherever a figure measured with it is quoted):

- TCP's own round trip. Each side's TCP talks to the relay over a link with ~no delay, so congestion control,
  slow start and loss recovery see a short RTT. A real 100 ms path ramps up slower after connect or loss.
- The handshake's round trip: ``connect()`` completes at once (the kernel accepts for the relay); the first reply
  still takes a full RTT. A real connect costs one RTT more (TLS: more again).
- Half-closes are forwarded, delayed like data. A reset (or a target that refuses) closes both sides at once.

    ip netns exec NS python -m bucketrl.sim.netlab.delay --listen 10.77.1.1:8080 --target 127.0.0.1:8080 \\
        --one-way-ms 50

prints ``READY <port>`` once listening (``--listen HOST:0`` picks a free port) and runs until killed, or until the
process ``--owner-pid`` (started at ``--owner-start``) is gone: a lab SIGKILLed mid-run leaves no relay behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections import deque

from bucketrl.sim.netlab.cleanup import proc_start_time

CHUNK = 64 * 1024
DEFAULT_WINDOW = 4 * 1024 * 1024


class _Fifo:
    """The bytes in flight in one direction: (due time, chunk) in arrival order, bounded in bytes."""

    def __init__(self, window_bytes: int) -> None:
        self.window = window_bytes
        self.items: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.changed = asyncio.Event()

    async def put(self, due: float, chunk: bytes) -> None:
        # One chunk over the window is still let in when the FIFO is empty, or a chunk bigger than the window
        # would wait forever.
        while self.queued and self.queued + len(chunk) > self.window:
            self.changed.clear()
            await self.changed.wait()
        self.items.append((due, chunk))
        self.queued += len(chunk)
        self.changed.set()

    async def get(self) -> tuple[float, bytes]:
        while not self.items:
            self.changed.clear()
            await self.changed.wait()
        return self.items[0]

    def done(self, chunk: bytes) -> None:
        # Only now is the chunk's space given back: it counts as in flight until written out.
        self.items.popleft()
        self.queued -= len(chunk)
        self.changed.set()


async def _read_side(reader: asyncio.StreamReader, fifo: _Fifo, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        chunk = await reader.read(CHUNK)
        # The EOF marker (b"") travels through the FIFO too, so a half-close arrives delayed, after the data.
        await fifo.put(loop.time() + delay_s, chunk)
        if not chunk:
            return


async def _write_side(writer: asyncio.StreamWriter, fifo: _Fifo) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due, chunk = await fifo.get()
        wait = due - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        if not chunk:
            fifo.done(chunk)
            if writer.can_write_eof():
                writer.write_eof()
            return
        writer.write(chunk)
        await writer.drain()
        fifo.done(chunk)


class DelayRelay:
    """Listen on ``listen``; for each connection, connect to ``target`` and forward both ways, delayed."""

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        one_way_ms: float,
        window_bytes: int = DEFAULT_WINDOW,
    ) -> None:
        self.listen = listen
        self.target = target
        self.delay_s = one_way_ms / 1000.0
        self.window_bytes = window_bytes
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1], limit=CHUNK)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(self.target[0], self.target[1], limit=CHUNK)
        except OSError:
            c_writer.transport.abort()  # the client sees a reset, as for a refused port behind a real link
            return
        up, down = _Fifo(self.window_bytes), _Fifo(self.window_bytes)
        try:
            # A task group, so a reset on one side cancels the three other pumps instead of orphaning them.
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_read_side(c_reader, up, self.delay_s))
                tg.create_task(_write_side(t_writer, up))
                tg.create_task(_read_side(t_reader, down, self.delay_s))
                tg.create_task(_write_side(c_writer, down))
        except* (ConnectionError, OSError):
            pass
        finally:
            # Either side gone: drop both at once (no delayed reset; see the module docstring).
            for w in (c_writer, t_writer):
                w.transport.abort()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _watch_owner(pid: int, start: int) -> None:
    while proc_start_time(pid) == start:
        await asyncio.sleep(0.5)


async def _main(args: argparse.Namespace) -> None:
    relay = DelayRelay(_hostport(args.listen), _hostport(args.target), args.one_way_ms, args.window_bytes)
    port = await relay.start()
    print(f"READY {port}", flush=True)
    if args.owner_pid:
        await _watch_owner(args.owner_pid, args.owner_start)
    else:
        await asyncio.Event().wait()
    await relay.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept on (PORT 0: any free port)")
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--one-way-ms", type=float, required=True, help="delay added to each direction")
    ap.add_argument("--window-bytes", type=int, default=DEFAULT_WINDOW, help="bytes in flight per direction")
    ap.add_argument("--owner-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--owner-start", type=int, default=0, help="its start time (/proc/PID/stat field 22)")
    args = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args))
    sys.exit(0)


if __name__ == "__main__":
    main()
