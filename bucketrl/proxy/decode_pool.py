"""One child process per proxy process that decodes large request bodies, so the GIL stays with the event loop.

Why a process and not a thread: pydantic parses JSON into its own tree and validates without releasing the
GIL, so a worker thread decoding a 32 MB rollout batch still stopped the event loop for up to ~150 ms at a
time. In the child, parsing and validation cost the proxy process nothing but writing the bytes to a pipe;
what comes back is the validated model, pickled. Unpickling is several times cheaper than validating (~0.13 s
against ~1 s for 33 MB of JSON here) and runs in a worker thread, in steps the loop can interleave with
(each model's ``__setstate__`` is Python code, where the GIL changes hands).

Pickle is safe here: the bytes are made by this module's own child from a model it has just validated. Nothing
a client sent, and nothing read from the bucket, is ever unpickled.

Memory, per body, in the proxy process: the raw body (written to the pipe from its own buffer, not copied), the
pickled model (~0.45x a JSON body) and the model. The decoding peak itself (~6x the body for a well-formed
batch, ~35x for hostile lists of short strings) is the child's. One body at a time goes to the child; after
each, the child hands what it freed back to the system (``malloc_trim``), and a child whose RSS still passed
:data:`RECYCLE_RSS_BYTES` is replaced, so one huge body does not keep its peak resident.

The child is ``python -c`` started with ``subprocess`` (not multiprocessing: its spawn re-imports the parent's
``__main__``, which broke an unguarded script, and needs ``/dev/shm`` for its locks), on first use or at a
serving proxy's start (:func:`warm`). It gets the parent's ``sys.path`` and reads frames from stdin, answering
on stdout; it exits when stdin closes (the proxy exited or replaced it). A child that dies mid-decode (killed
for memory) fails that request with 422; the next large body starts a new child.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

from bucketrl import errors

log = logging.getLogger("bucketrl.proxy")

T = TypeVar("T")

# A child whose RSS passed this after a decode exits and is replaced (its allocator may keep a peak resident).
RECYCLE_RSS_BYTES = 512 * 1024 * 1024

_HEADER = struct.Struct("<QQ")  # call: (pickled call length, raw body length); answer: (pickle length, recycle)
_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from bucketrl.proxy.decode_pool import child_main; child_main()"
)


class _Child:
    """The decoder process and its pipes; one call at a time (``lock``)."""

    def __init__(self) -> None:
        paths = [p for p in sys.path if isinstance(p, str)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, json.dumps(paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.owner = os.getpid()  # a forked copy of this object belongs to the parent, not to the fork
        self.lock = threading.Lock()

    def call(self, fn: Callable[..., T], raw: bytes | bytearray, args: tuple[Any, ...]) -> tuple[T, bool]:
        """``fn(raw, *args)`` in the child (blocking; run in a thread): its result and whether to recycle."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        head = pickle.dumps((fn, args, RECYCLE_RSS_BYTES), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(_HEADER.pack(len(head), len(raw)))
            self.proc.stdin.write(head)
            self.proc.stdin.write(raw)  # from the body's own buffer: no copy
            self.proc.stdin.flush()
            n, recycle = _HEADER.unpack(_read_exactly(self.proc.stdout, _HEADER.size))
            answer = _read_exactly(self.proc.stdout, n)
        except (OSError, EOFError, ValueError):
            raise _Died from None
        kind, value = pickle.loads(answer)
        del answer
        if kind == "err":
            raise value
        return value, bool(recycle)

    def close(self) -> None:
        """Close stdin (the child exits at EOF) and reap it in the background."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        threading.Thread(target=self._reap, name="bucketrl-decoder-reap", daemon=True).start()

    def _reap(self) -> None:
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Died(Exception):
    pass


def _read_exactly(stream: IO[bytes], n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            raise EOFError("decoder pipe closed")
        got += k
    return buf


_lock = threading.Lock()
_child: _Child | None = None


def _get() -> _Child:
    global _child
    with _lock:
        if _child is None or _child.owner != os.getpid() or _child.proc.poll() is not None:
            _child = _Child()
        return _child


def _discard(child: _Child) -> None:
    global _child
    with _lock:
        if _child is child:
            _child = None
    child.close()


def warm() -> None:
    """Start the child now (a serving proxy at start-up) rather than on the first large body."""
    _get()


def shutdown() -> None:
    global _child
    with _lock:
        child, _child = _child, None
    if child is not None:
        child.close()


def child_pid() -> int | None:
    """The decoder child's pid (None when none is running)."""
    child = _child
    return None if child is None or child.proc.poll() is not None else child.proc.pid


def _call(fn: Callable[..., T], raw: bytes | bytearray, args: tuple[Any, ...]) -> T:
    child = _get()
    with child.lock:
        try:
            out, recycle = child.call(fn, raw, args)
        except _Died:
            _discard(child)
            log.warning("the body decoder process died decoding a body; a new one starts on the next large body")
            raise errors.Invalid(
                "body: the decoder process died decoding it (too large or too deeply nested)"
            ) from None
    if recycle:
        _discard(child)  # the next large body starts a fresh child
    return out


async def run(fn: Callable[..., T], raw: bytes | bytearray, *args: Any) -> T:
    """``fn(raw, *args)`` in the decoder child; ``fn`` must be importable by name, ``args`` picklable. Its
    exception, if it raises, is raised here."""
    return await asyncio.to_thread(_call, fn, raw, args)


# -- the child ---------------------------------------------------------------------------------------------


def child_main() -> None:
    """The child's loop: read a call and its body, answer ``(kind, value)`` and whether it should be replaced;
    exit at EOF."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a print anywhere must not corrupt the answer stream
    while True:
        try:
            n_head, n_raw = _HEADER.unpack(_read_exactly(stdin, _HEADER.size))
            fn, args, recycle_rss = pickle.loads(_read_exactly(stdin, n_head))  # from the proxy, never a client
            raw = _read_exactly(stdin, n_raw)
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", fn(raw, *args))
        except MemoryError:
            answer = ("err", errors.Invalid("body: too large to decode in this proxy's memory"))
        except Exception as exc:  # the parent re-raises it (errors.Invalid for a bad body)
            answer = ("err", exc)
        del raw
        try:
            out = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable exception: its text
            err = errors.Invalid(f"body: {type(exc).__name__}: {str(exc)[:500]}")
            out = pickle.dumps(("err", err), protocol=pickle.HIGHEST_PROTOCOL)
        del answer
        _trim()  # what the decode freed goes back to the system, not kept for the next body
        stdout.write(_HEADER.pack(len(out), int(_rss() > recycle_rss)))
        stdout.write(out)
        stdout.flush()
        del out


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # glibc's; elsewhere there is nothing to call
        ctypes.CDLL(None).malloc_trim(0)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
