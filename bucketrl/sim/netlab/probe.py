"""Small TCP probes to run inside lab namespaces: what the lab's tests measure with, and a quick check by hand.

    python -m bucketrl.sim.netlab.probe serve --listen 127.0.0.1:0     # prints READY <port>; echo + bulk
    python -m bucketrl.sim.netlab.probe rtt --addr 10.77.1.1:PORT --count 10
    python -m bucketrl.sim.netlab.probe bulk --addr 10.77.1.1:PORT --bytes 4000000
    python -m bucketrl.sim.netlab.probe upload --addr 10.77.1.1:PORT --bytes 4000000
    python -m bucketrl.sim.netlab.probe outage --addr 10.77.1.1:PORT    # waits for a line on stdin, see below

Each client prints one JSON line. The server speaks lines: ``BULK <n>`` makes it send n bytes and close, any
other line is echoed back; ``SINK <n>`` makes it read n bytes, then answer ``OK``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import sys
import time
from typing import Any

_BLOCK = b"x" * 65536


async def _serve_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            if line.startswith(b"BULK "):
                left = int(line.split()[1])
                while left > 0:
                    writer.write(_BLOCK[: min(left, len(_BLOCK))])
                    left -= len(_BLOCK)
                    await writer.drain()  # back-pressure: never more than the socket's buffer ahead
                break
            if line.startswith(b"SINK "):
                await reader.readexactly(int(line.split()[1]))
                writer.write(b"OK\n")
                await writer.drain()
                continue
            writer.write(line)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _serve(host: str, port: int) -> None:
    server = await asyncio.start_server(_serve_conn, host, port)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def _connect(addr: tuple[str, int], timeout_s: float) -> socket.socket:
    s = socket.create_connection(addr, timeout=timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle: a ping must leave at once
    return s


def _ping(s: socket.socket) -> float:
    t0 = time.perf_counter()
    s.sendall(b"ping\n")
    got = b""
    while not got.endswith(b"\n"):
        chunk = s.recv(64)
        if not chunk:
            raise ConnectionError("closed mid-ping")
        got += chunk
    return time.perf_counter() - t0


def rtt(addr: tuple[str, int], count: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with _connect(addr, 10.0) as s:
        connect_s = time.perf_counter() - t0
        rtts = [_ping(s) * 1000 for _ in range(count)]
    return {"connect_ms": connect_s * 1000, "rtt_ms": rtts, "median_ms": statistics.median(rtts)}


def bulk(addr: tuple[str, int], nbytes: int) -> dict[str, Any]:
    with _connect(addr, 10.0) as s:
        t_req = time.perf_counter()
        s.sendall(f"BULK {nbytes}\n".encode())
        first = s.recv(1 << 20)
        t_first = time.perf_counter()
        got = len(first)
        while chunk := s.recv(1 << 20):
            got += len(chunk)
        t_last = time.perf_counter()
    # The rate counts from the first byte on: the request's round trip is the link's delay, not its bandwidth.
    span = max(t_last - t_first, 1e-9)
    return {
        "bytes": got,
        "first_byte_s": t_first - t_req,
        "transfer_s": span,
        "mbit": (got - len(first)) * 8 / span / 1e6,
    }


def upload(addr: tuple[str, int], nbytes: int) -> dict[str, Any]:
    with _connect(addr, 10.0) as s:
        # The OK comes one round trip after the last byte is through: measure that round trip first and take it off.
        rtt_s = _ping(s)
        t0 = time.perf_counter()
        s.sendall(f"SINK {nbytes}\n".encode())
        for i in range(0, nbytes, len(_BLOCK)):
            s.sendall(_BLOCK[: min(len(_BLOCK), nbytes - i)])
        got = b""
        while not got.endswith(b"\n"):
            chunk = s.recv(64)
            if not chunk:
                raise ConnectionError("closed before OK")
            got += chunk
        span = max(time.perf_counter() - t0 - rtt_s, 1e-9)
    return {"bytes": nbytes, "rtt_s": rtt_s, "transfer_s": span, "mbit": nbytes * 8 / span / 1e6}


def outage(addr: tuple[str, int], connect_timeout_s: float, stall_limit_s: float) -> dict[str, Any]:
    """Connect and ping; print CONNECTED; on a line from stdin (sent once the link is dropped): ping again on the
    old connection, try a fresh connect meanwhile, and time how long the old connection's ping stalled; then show
    that a fresh connection works."""
    out: dict[str, Any] = {}
    with _connect(addr, 10.0) as s:
        out["before_ms"] = _ping(s) * 1000
        print("CONNECTED", flush=True)
        sys.stdin.readline()
        t0 = time.perf_counter()
        s.sendall(b"ping\n")
        try:
            with _connect(addr, connect_timeout_s):
                out["fresh_connect"] = "ok"
        except OSError as e:  # TimeoutError is one
            out["fresh_connect"] = type(e).__name__ + (f" errno={e.errno}" if e.errno else "")
        out["fresh_connect_after_s"] = time.perf_counter() - t0
        s.settimeout(stall_limit_s)
        got = b""
        while not got.endswith(b"\n"):
            chunk = s.recv(64)
            if not chunk:
                raise ConnectionError("closed during the outage")
            got += chunk
        out["stall_s"] = time.perf_counter() - t0
        out["same_connection_after_ms"] = _ping(s) * 1000
    with _connect(addr, 10.0) as s2:
        out["new_connection_after_ms"] = _ping(s2) * 1000
    return out


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="TCP probes for the netlab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--listen", default="127.0.0.1:0")
    p = sub.add_parser("rtt")
    p.add_argument("--addr", required=True)
    p.add_argument("--count", type=int, default=10)
    p = sub.add_parser("bulk")
    p.add_argument("--addr", required=True)
    p.add_argument("--bytes", type=int, default=4_000_000)
    p = sub.add_parser("upload")
    p.add_argument("--addr", required=True)
    p.add_argument("--bytes", type=int, default=4_000_000)
    p = sub.add_parser("outage")
    p.add_argument("--addr", required=True)
    p.add_argument("--connect-timeout", type=float, default=0.5)
    p.add_argument("--stall-limit", type=float, default=20.0)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        host, port = _hostport(args.listen)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(host, port))
        return
    addr = _hostport(args.addr)
    if args.cmd == "rtt":
        res = rtt(addr, args.count)
    elif args.cmd == "bulk":
        res = bulk(addr, args.bytes)
    elif args.cmd == "upload":
        res = upload(addr, args.bytes)
    else:
        res = outage(addr, args.connect_timeout, args.stall_limit)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
