"""A real proxy for tests: ``create_app`` served by uvicorn on a free loopback port in a thread.

Real HTTP, real Redis, a real bucket; the sync :class:`bucketrl.client.ProxyClient` and any httpx client
talk to it like a worker would. ``call`` runs a coroutine on the server's own event loop (to poke the
context: a GC pass, a look at Redis) without touching its Redis connections from another loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import struct
import tarfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx
import uvicorn

from bucketrl.client import ProxyClient
from bucketrl.proxy.app import create_app
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.settings import ProxySettings
from bucketrl.wire import RunSpec
from tests.support.services import free_port

T = TypeVar("T")

# Long enough for the proxy's start-up check (placeholders and tokens under 16 characters are refused).
TOKENS = {
    "admin": "tok-admin-0123456789",
    "trainer": "tok-trainer-0123456789",
    "generator": "tok-gen-0123456789",
    "viewer": "tok-viewer-0123456789",
}
TOKENS_ENV = ",".join(f"{role}:{tok}" for role, tok in TOKENS.items())


def make_spec(**kw: Any) -> RunSpec:
    base: dict[str, Any] = {
        "base_model": "tiny-qwen2",
        "reward": {"name": "toy"},
        "dataset": {"uri": "toy:digits", "size": 64},
        "vocab_size": 64,
        "group_size": 2,
        "max_staleness": 1,
        "groups_per_step": 2,
        "queue_capacity_groups": 32,
    }
    base.update(kw)
    return RunSpec.model_validate(base)


def make_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def safetensors_bytes(payload: bytes) -> bytes:
    """A valid safetensors file holding ``payload`` (zero-padded to whole floats) as one float32 tensor (what the
    proxy's check reads: an adapter's weights are float32, bfloat16 or float16)."""
    payload += b"\0" * (-len(payload) % 4)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(payload) // 4], "data_offsets": [0, len(payload)]}})
    return struct.pack("<Q", len(header)) + header.encode() + payload


def adapter_files(tag: str, size: int = 256) -> dict[str, bytes]:
    weights = hashlib.sha256(tag.encode()).digest() * (size // 32 + 1)
    return {
        "adapter_config.json": b'{"peft_type": "LORA", "r": 8}',
        "adapter_model.safetensors": safetensors_bytes(weights[:size]),
    }


def adapter_tar(version: int, size: int = 256) -> bytes:
    return make_tar(adapter_files(f"v{version}", size))


def checkpoint_files(tag: bytes) -> dict[str, bytes]:
    """Exactly a checkpoint's files (bucketrl.bundles.CHECKPOINT_FILES); ``tag`` makes them unique."""
    files = {f"adapter/{name}": data for name, data in adapter_files(tag.decode(errors="replace")).items()}
    files["state.json"] = json.dumps({"tag": tag.decode(errors="replace")}).encode()
    for stem in ("optimizer", "rng"):
        files[f"{stem}.json"] = b"{}"
        files[f"{stem}.safetensors"] = safetensors_bytes(tag)
    return files


def checkpoint_tar(tag: bytes) -> bytes:
    return make_tar(checkpoint_files(tag))


class ProxyHarness:
    def __init__(self, redis_url: str, bucket_url: str, **settings: Any) -> None:
        self.port = free_port()
        base = {
            "redis_url": redis_url,
            "bucket_url": bucket_url,
            "tokens": TOKENS_ENV,
            "host": "127.0.0.1",
            "port": self.port,
            "gc_interval_s": 3600.0,  # tests run GC passes explicitly unless they ask for the loop
            "redis_timeout_s": 1.0,
        }
        base.update(settings)
        self.settings = ProxySettings(**base)
        self.url = f"{'https' if self.settings.tls_cert_file else 'http'}://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> ProxyHarness:
        self.app = create_app(self.settings)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            ssl_certfile=self.settings.tls_cert_file or None,
            ssl_keyfile=self.settings.tls_key_file or None,
        )
        self.server = uvicorn.Server(config)
        ready = threading.Event()

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_until_complete(self.server.serve())  # type: ignore[union-attr]
            self.loop.close()

        self.thread = threading.Thread(target=serve, daemon=True, name=f"proxy-{self.port}")
        self.thread.start()
        ready.wait(10)
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("proxy did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(15)
            if self.thread.is_alive():
                if self.loop is not None:

                    def dump() -> None:
                        for task in asyncio.all_tasks(self.loop):
                            task.print_stack(limit=6)

                    self.loop.call_soon_threadsafe(dump)
                    time.sleep(0.5)
                raise RuntimeError(f"proxy on port {self.port} did not shut down within 15 s")
        self.server = self.thread = None

    def restart(self) -> None:
        self.stop()
        self.start()

    # -- access ---------------------------------------------------------------------------------------
    @property
    def ctx(self) -> ProxyContext:
        return self.app.state.ctx

    def call(self, fn: Callable[[ProxyContext], Awaitable[T]], timeout: float = 30.0) -> T:
        """Run ``fn(ctx)`` on the server's event loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(fn(self.ctx), self.loop).result(timeout)  # type: ignore[arg-type]

    def client(self, run: str, role: str = "admin", **kw: Any) -> ProxyClient:
        kw.setdefault("retries", 0)
        return ProxyClient(self.url, run, TOKENS[role], **kw)

    def http(self, role: str | None = "admin", **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {TOKENS[role]}"} if role else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 30.0), **kw)


@contextmanager
def running(redis_url: str, bucket_url: str, **settings: Any) -> Iterator[ProxyHarness]:
    h = ProxyHarness(redis_url, bucket_url, **settings).start()
    try:
        yield h
    finally:
        h.stop()
