"""Loopback ports handed out so that no two processes on one machine can be given the same number.

Binding port 0, closing the socket and passing the number on (what ``free_port`` used to do) leaves a window in
which any other process, another ``bucketrl up``, a parallel test worker, or the kernel choosing an ephemeral port
for an outgoing connection, can take the same number before the child that was meant to listen on it starts.

Two rules close that window:

- Ports are handed out only *below* the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), so
  the kernel never gives one of them to a ``bind(0)`` or an outgoing connection.
- Inside that range, a process owns *blocks* of ports through an advisory ``flock`` on one file per block (one file
  descriptor a block, not one a port) and hands out each port of its blocks once. The kernel drops the lock when
  the owner exits, however it exits, so a killed owner's blocks come back by themselves.

A port that something outside this scheme already listens on is skipped (a test ``bind``), so a stray server on a
number in the range is not handed out either.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import threading
from pathlib import Path

BLOCK = 64
# Below 10000 lie the ports that well-known services listen on by default.
LOW = 10000
_DEFAULT_EPHEMERAL_START = 32768


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


def _lock_dir() -> Path:
    # One directory per user: a lock file another user created could not be opened for writing.
    base = os.environ.get("BUCKETRL_PORT_LOCK_DIR") or os.path.join(
        tempfile.gettempdir(), f"bucketrl-ports-{os.getuid()}"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


class PortAllocator:
    """Hands out each port of the blocks this process has locked, once."""

    def __init__(self, low: int = LOW, high: int | None = None) -> None:
        self.low = low
        self.high = high if high is not None else _ephemeral_start()
        if self.high - self.low < BLOCK:
            raise RuntimeError(
                f"no room for loopback ports below the ephemeral range (start {self.high}): "
                "widen net.ipv4.ip_local_port_range's lower bound"
            )
        self._mutex = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._blocks: list[int] = []  # the lock files' descriptors, held for the life of the process
        self._pending: list[int] = []
        self._pid = os.getpid()
        # Start where another process is unlikely to be looking, so owners rarely try each other's locks.
        self._next_block = (os.getpid() * 7919) % ((self.high - self.low) // BLOCK)

    def _claim_block(self) -> None:
        nblocks = (self.high - self.low) // BLOCK
        folder = _lock_dir()
        for _ in range(nblocks):
            index = self._next_block
            self._next_block = (self._next_block + 1) % nblocks
            start = self.low + index * BLOCK
            fd = os.open(folder / f"{start}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._blocks.append(fd)
            self._pending = list(range(start + BLOCK - 1, start - 1, -1))
            return
        raise RuntimeError(f"every block of loopback ports in {self.low}-{self.high} is held by another process")

    def take(self) -> int:
        with self._mutex:
            if os.getpid() != self._pid:
                # A forked child shares its parent's locks, and with them the parent's numbers: claim its own blocks.
                self._reset()
            while True:
                if not self._pending:
                    self._claim_block()
                port = self._pending.pop()
                if _bindable(port):
                    return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_allocator: PortAllocator | None = None
_allocator_mutex = threading.Lock()


def free_port() -> int:
    """A loopback port nobody listens on and no other process on this machine will be handed (see the module)."""
    global _allocator
    with _allocator_mutex:
        if _allocator is None:
            _allocator = PortAllocator()
        allocator = _allocator
    return allocator.take()
