"""A fleet of SIMULATED generators: many asyncio workers in one process, each speaking the real protocol.

What one simulated generator does is what :class:`bucketrl.generator.worker.GeneratorWorker` does, over
HTTP against the real proxy, with only the GPU simulated (:mod:`bucketrl.sim.gpu`):

- adapter sync: long-polls ``GET adapters/latest?after=N``, leases the latest version, downloads its tar
  and checks its sha256 (against the proxy's header and the announcement) and that it is a PEFT adapter in the
  announced dtype (``bucketrl.bundles``, as the real worker checks it), "loads" it (``load_adapter_s``; the
  engine loads between decode steps, so it does not wait for the running call), releases the leases of
  versions no batch uses any more;
- rollouts: leases ``prompts_per_request`` prompts (long-polled by admission control, ``version`` = the
  newest loaded) while the previous call runs, samples G completions per prompt in one simulated call, hands
  the batch to its submitter (a queue of ``submit_queue_batches``, as the real worker's), which submits it as
  msgpack (token ids and logprobs packed, as the real client sends them) under one Idempotency-Key per
  batch (429: waits Retry-After; 409 stale: counted, prompts released);
- staged publish (``BUCKETRL_STAGING=1``; off by default here, on in the real worker): pulls each upload of the
  run while the trainer sends it (``GET /v1/staging``), and takes it for the announced version instead of a download;
- keeper: renews version leases at a third of their TTL and pushes metrics with ``loaded_versions`` (the
  heartbeat) every ``metrics_interval_s``.

It is written with asyncio rather than by running :class:`GeneratorWorker` because the real worker is a
set of threads plus a reward process pool per instance: hundreds of them do not fit in one machine's
processes, while hundreds of coroutines do. Rewards are random (0 or 1): scoring is not what scales here.

    BUCKETRL_PROXY_URL=... BUCKETRL_TOKEN=... BUCKETRL_RUN=sim \\
        python -m bucketrl.sim.fleet --count 64 --first 0 --report /tmp/fleet-0.json

SIGTERM: no new leases; calls in flight finish and their batches are submitted (``--grace-s``), prompts
still held and version leases are released, the report is written. Report fields: see :class:`FleetStats`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np

from bucketrl import bundles, errors
from bucketrl.settings import WorkerSettings
from bucketrl.sim.gpu import SimGpu, simulate_call
from bucketrl.wire import RunSpec
from bucketrl.wire.packed import pack_array

log = logging.getLogger("bucketrl.sim.fleet")

VERSION_WAIT_S = 20.0
PROMPT_WAIT_S = 2.0  # as the real worker's PROMPT_WAIT_S
VERSION_LEASE_TTL_S = 60.0
PROMPT_LEASE_TTL_S = 300.0
MAX_ERRORS_KEPT = 50
TRANSPORT_RETRIES = 3


@dataclass
class FleetStats:
    """What a fleet process reports (summed over its generators)."""

    generators: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # "METHOD route" -> count
    statuses: Counter[str] = field(default_factory=Counter)  # "route status" for non-2xx answers
    groups_generated: int = 0  # sampled by the engine
    groups_submitted: int = 0  # accepted (202)
    groups_duplicate: int = 0  # accepted earlier (a retry answered duplicate=true)
    groups_stale: int = 0  # refused at submit (409 stale)
    groups_rejected: int = 0  # refused otherwise
    groups_released: int = 0  # prompts given back without a group (shutdown, stale, rejected)
    prompts_leased: int = 0
    backpressure_waits: int = 0
    transport_retries: int = 0
    gpu_busy_s: float = 0.0
    loads: list[tuple[str, int, float]] = field(default_factory=list)  # (worker, version, wall time loaded)
    # (worker, version, sha256, bytes, wall time requested, wall time its last byte arrived)
    fetches: list[tuple[str, int, str, int, float, float]] = field(default_factory=list)
    wakes: list[tuple[str, int, float, float]] = field(default_factory=list)  # (worker, version, asked, answered)
    errors: list[str] = field(default_factory=list)
    # Calls that met a proxy (or link) that could not answer and were retried or left to expire: what an outage
    # costs, not a failure (``errors`` holds those).
    outages: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["requests"], out["statuses"] = dict(self.requests), dict(self.statuses)  # asdict mangles Counters
        return out

    def error(self, text: str) -> None:
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(text)

    def failed(self, text: str, exc: Exception) -> None:
        kept = self.outages if isinstance(exc, errors.Unavailable) else self.errors
        if len(kept) < MAX_ERRORS_KEPT:
            kept.append(text)


class Api:
    """The proxy routes the simulated generators use, on one shared async HTTP client; counts every request."""

    def __init__(self, settings: WorkerSettings, stats: FleetStats, connections: int) -> None:
        self.run, self.base = settings.run, f"/v1/runs/{settings.run}"
        self.stats = stats
        headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx.AsyncClient(
            verify=settings.security.verify(),
            base_url=settings.proxy_url,
            headers=headers,
            timeout=httpx.Timeout(60.0),
            limits=limits,
        )

    async def call(
        self, method: str, route: str, path: str, *, expected: tuple[int, ...] = (), **kw: Any
    ) -> httpx.Response:
        """One request; an error answer raises the matching :mod:`bucketrl.errors` class. A transport error
        (a keep-alive connection the server closed as it was reused) is retried like the real client does;
        ``expected`` error statuses are not counted as refusals."""
        self.stats.requests[f"{method} {route}"] += 1
        for attempt in range(TRANSPORT_RETRIES + 1):
            try:
                resp = await self.http.request(method, path if path.startswith("/v1/") else self.base + path, **kw)
                break
            except httpx.TransportError as exc:
                if attempt == TRANSPORT_RETRIES:
                    self.stats.statuses[f"{route} transport"] += 1
                    raise errors.Unavailable(f"proxy unreachable: {exc!r}") from exc
                self.stats.transport_retries += 1
                await asyncio.sleep(0.2 * 2**attempt)
        if resp.status_code < 400:
            return resp
        if resp.status_code not in expected:
            self.stats.statuses[f"{route} {resp.status_code}"] += 1
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        ra = resp.headers.get("Retry-After")
        raise errors.from_wire(resp.status_code, body, float(ra) if ra else None)

    async def close(self) -> None:
        await self.http.aclose()


@dataclass
class _Version:
    lease_id: str
    inflight: int = 0


@dataclass
class _Batch:
    version: int
    prompts: list[dict[str, Any]]
    body: bytes
    key: str = field(default_factory=lambda: uuid.uuid4().hex)


class SimGenerator:
    def __init__(
        self,
        worker_id: str,
        api: Api,
        spec: RunSpec,
        gpu: SimGpu,
        stats: FleetStats,
        *,
        seed: int,
        prompts_per_request: int,
        prompt_tokens: int,
        submit_queue_batches: int = 2,
        metrics_interval_s: float = 5.0,
    ) -> None:
        self.worker_id = worker_id
        self.api, self.spec, self.gpu, self.stats = api, spec, gpu, stats
        self.rng = np.random.default_rng(seed)
        self.prompts_per_request = prompts_per_request
        self.prompt_tokens = prompt_tokens
        self.metrics_interval_s = metrics_interval_s
        self.versions: dict[int, _Version] = {}
        self.staging = os.environ.get("BUCKETRL_STAGING", "0").lower() in ("1", "true")
        self.staged: dict[tuple[int, str], asyncio.Task[bytes | None]] = {}  # (version, sha256) -> its pull
        self.current = 0  # newest loaded version
        self.newest_known = 0
        self.held: set[str] = set()  # prompt ids leased and not yet settled
        self.stopping = asyncio.Event()
        self.loaded = asyncio.Event()
        self.queue: asyncio.Queue[_Batch | None] = asyncio.Queue(maxsize=submit_queue_batches)

    # -- adapter sync ----------------------------------------------------------------------------------

    async def sync_loop(self) -> None:
        delay = 0.5
        while not self.stopping.is_set():
            try:
                asked = time.time()
                resp = await self.api.call(
                    "GET",
                    "adapters/latest",
                    "/adapters/latest",
                    params={"after": self.newest_known, "wait_s": VERSION_WAIT_S},
                    timeout=VERSION_WAIT_S + 30,
                )
                if resp.status_code == 204:
                    continue
                info = resp.json()
                self.stats.wakes.append((self.worker_id, int(info["version"]), asked, time.time()))
                await self._fetch(int(info["version"]), str(info["sha256"]), info.get("dtype"))
                delay = 0.5
            except errors.BucketRLError as exc:
                self.stats.failed(f"{self.worker_id} adapter sync: {exc.code}: {exc.message[:200]}", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def staging_loop(self) -> None:
        """Pull each upload of the run while the trainer sends it (bucketrl/generator/staging.py's, in memory)."""
        after, instance = 0, ""
        while not self.stopping.is_set():
            try:
                params = {"after": after, "instance": instance, "wait_s": VERSION_WAIT_S, "run": self.api.run}
                got = (await self.api.call("GET", "staging", "/v1/staging", params=params, timeout=60)).json()
            except errors.BucketRLError:
                await asyncio.sleep(1.0)
                continue
            if not got["instance"]:  # off, or a relay's answer (it stages for the region)
                await asyncio.sleep(VERSION_WAIT_S)
                continue
            after, instance = got["seq"], got["instance"]
            for up in got["uploads"]:
                if (key := (int(up["version"]), up["sha256"])) not in self.staged:
                    self.staged[key] = asyncio.create_task(self._pull(up))

    async def _pull(self, up: dict[str, Any]) -> bytes | None:
        try:  # a failed publish ends the stream short: the retry finds it gone (404), nothing kept
            return (await self.api.call("GET", "staging/{id}", f"/v1/staging/{up['upload_id']}", timeout=60)).content
        except errors.BucketRLError:
            return None

    async def _fetch(self, announced: int, sha256: str, dtype: str | None = None) -> None:
        lease = (
            await self.api.call(
                "POST", "leases", "/leases", json={"worker_id": self.worker_id, "ttl_s": VERSION_LEASE_TTL_S}
            )
        ).json()
        version = int(lease["version"])
        try:
            requested = time.time()
            pull = self.staged.pop((version, sha256), None) if version == announced else None
            content, header = (await pull if pull is not None else None), None
            if content is None:
                resp = await self.api.call("GET", "adapters/{v}", f"/adapters/{version}")
                content, header = resp.content, resp.headers.get("X-Content-SHA256")
            downloaded = time.time()
            got = hashlib.sha256(content).hexdigest()
            want = {header or got} | ({sha256} if version == announced else set())
            if want != {got}:
                raise errors.Invalid(f"adapter v{version}: sha256 {got} != {sorted(want)}")
            shipped = bundles.check_adapter_tar(io.BytesIO(content))
            bundles.check_dtype(shipped, dtype if version == announced else None, f"adapter v{version}", "announced")
            self.stats.fetches.append((self.worker_id, version, got, len(content), requested, downloaded))
        except BaseException:
            await self._release_lease(lease["lease_id"])
            raise
        self.newest_known = max(self.newest_known, version)
        for key in [k for k in self.staged if k[0] <= version]:  # superseded pulls
            self.staged.pop(key).cancel()
        if version <= self.current:  # an older announcement overtaken by a newer load
            await self._release_lease(lease["lease_id"])
            return
        await asyncio.sleep(self.gpu.load_adapter_s)  # loaded between decode steps of the running call
        self.stats.gpu_busy_s += self.gpu.load_adapter_s
        self.versions[version] = _Version(lease["lease_id"])
        self.current = version
        self.stats.loads.append((self.worker_id, version, time.time()))
        self.loaded.set()
        await self._retire()

    async def _retire(self) -> None:
        """Release the leases of versions neither current nor used by a batch in flight."""
        for v, slot in list(self.versions.items()):
            # pop, not del: another task may have retired it while this one awaited a release
            if v != self.current and slot.inflight == 0 and self.versions.pop(v, None) is not None:
                await self._release_lease(slot.lease_id)

    async def _release_lease(self, lease_id: str) -> None:
        with contextlib.suppress(errors.BucketRLError):  # expired already or proxy away: it expires anyway
            await self.api.call("DELETE", "leases/{id}", f"/leases/{lease_id}")

    # -- rollouts ----------------------------------------------------------------------------------------

    async def _lease_prompts(self) -> list[dict[str, Any]]:
        body = {
            "worker_id": self.worker_id,
            "n": self.prompts_per_request,
            "ttl_s": PROMPT_LEASE_TTL_S,
            "version": self.current or None,
            "wait_s": PROMPT_WAIT_S,
        }
        try:
            resp = await self.api.call("POST", "prompts/lease", "/prompts/lease", json=body, timeout=PROMPT_WAIT_S + 60)
        except errors.Backpressure as exc:
            self.stats.backpressure_waits += 1
            await asyncio.sleep(min(max(1.0 if exc.retry_after is None else exc.retry_after, 0.05), 30.0))
            return []
        except errors.BucketRLError as exc:
            self.stats.failed(f"{self.worker_id} prompt lease: {exc.code}: {exc.message[:200]}", exc)
            await asyncio.sleep(1.0)
            return []
        prompts = resp.json()["prompts"]
        self.held.update(p["prompt_id"] for p in prompts)
        self.stats.prompts_leased += len(prompts)
        return prompts

    async def engine_loop(self) -> None:
        while not self.loaded.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.2)
            if self.stopping.is_set():
                return
        nxt: asyncio.Task[list[dict[str, Any]]] | None = asyncio.create_task(self._lease_prompts())
        while nxt is not None:
            prompts = await nxt
            nxt = None if self.stopping.is_set() else asyncio.create_task(self._lease_prompts())
            if not prompts:
                if nxt is None:
                    break
                continue
            if self.stopping.is_set():
                await self._release_prompts(prompts)
                break
            version = self.current
            self.versions[version].inflight += 1
            spec = self.spec
            prompt_lens = [self.prompt_tokens] * len(prompts)
            call = simulate_call(
                self.gpu,
                self.rng,
                prompt_lens,
                n=spec.group_size,
                max_new_tokens=spec.sampling.max_new_tokens,
                vocab_size=spec.vocab_size,
            )
            await asyncio.sleep(call.seconds)
            self.stats.gpu_busy_s += call.seconds
            self.stats.groups_generated += len(prompts)
            await self.queue.put(_Batch(version, prompts, self._pack(version, prompts, call.samples)))
        await self.queue.put(None)

    def _pack(self, version: int, prompts: list[dict[str, Any]], samples: list[list[Any]]) -> bytes:
        lease_id = self.versions[version].lease_id
        groups = [
            {
                "prompt_id": p["prompt_id"],
                "prompt_index": p["index"],
                "prompt_token_ids": pack_array(self.rng.integers(0, self.spec.vocab_size, self.prompt_tokens), "int"),
                "completions": [
                    {
                        # packed as the generator worker's client sends them (wire/packed.py)
                        "token_ids": pack_array(s.token_ids, "int"),
                        "logprobs": pack_array(s.logprobs, "float"),
                        "reward": float(self.rng.integers(0, 2)),
                        "finish_reason": s.finish_reason,
                    }
                    for s in group
                ],
            }
            for p, group in zip(prompts, samples, strict=True)
        ]
        batch = {
            "worker_id": self.worker_id,
            "lease_id": lease_id,
            "version": version,
            "groups": groups,
            "sampling": self.spec.sampling.model_dump(mode="json"),
        }
        return msgpack.packb(batch, use_bin_type=True)

    async def submit_loop(self) -> None:
        while (batch := await self.queue.get()) is not None:
            try:
                await self._submit(batch)
            finally:
                self.versions[batch.version].inflight -= 1
                await self._retire()

    async def _submit(self, batch: _Batch) -> None:
        n = len(batch.prompts)
        headers = {"Content-Type": "application/msgpack", "Idempotency-Key": batch.key}
        backoff = 0.5
        while True:
            try:
                resp = await self.api.call("POST", "rollouts", "/rollouts", content=batch.body, headers=headers)
            except errors.Backpressure as exc:
                self.stats.backpressure_waits += 1
                await asyncio.sleep(min(max(exc.retry_after or 1.0, 0.05), 30.0))
                continue
            except errors.Unavailable as exc:
                self.stats.failed(f"{self.worker_id} submit (retrying, same key): {exc.message[:200]}", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            except errors.Stale:
                self.stats.groups_stale += n
                await self._release_prompts(batch.prompts)
                return
            except errors.BucketRLError as exc:
                self.stats.groups_rejected += n
                self.stats.error(f"{self.worker_id} submit refused: {exc.status} {exc.code}: {exc.message[:200]}")
                await self._release_prompts(batch.prompts)
                return
            out = resp.json()
            if out.get("duplicate"):
                self.stats.groups_duplicate += n
            else:
                self.stats.groups_submitted += int(out["accepted_groups"])
            self.held.difference_update(p["prompt_id"] for p in batch.prompts)
            return

    async def _release_prompts(self, prompts: list[dict[str, Any]]) -> None:
        ids = [p["prompt_id"] for p in prompts if p["prompt_id"] in self.held]
        if not ids:
            return
        self.held.difference_update(ids)
        try:
            await self.api.call(
                "POST", "prompts/release", "/prompts/release", json={"worker_id": self.worker_id, "prompt_ids": ids}
            )
            self.stats.groups_released += len(ids)
        except errors.BucketRLError as exc:  # they expire and are issued again
            self.stats.failed(f"{self.worker_id} prompt release: {exc.code}: {exc.message[:200]}", exc)

    # -- keeper --------------------------------------------------------------------------------------------

    async def keeper_loop(self) -> None:
        last_renew = time.monotonic()
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.metrics_interval_s)
            if self.stopping.is_set():
                return
            try:
                if time.monotonic() - last_renew >= VERSION_LEASE_TTL_S / 3:
                    last_renew = time.monotonic()
                    for v, slot in list(self.versions.items()):
                        try:
                            await self.api.call(
                                "POST",
                                "leases/{id}/renew",
                                f"/leases/{slot.lease_id}/renew",
                                json={"ttl_s": 60.0},
                                expected=(410,),
                            )
                        except errors.Gone:
                            if self.versions.get(v) is slot:  # not released by a retire meanwhile: lost
                                raise
                push = {
                    "worker_id": self.worker_id,
                    "metrics": {"rollout/groups_submitted_total": float(self.stats.groups_submitted)},
                    "loaded_versions": sorted(self.versions),
                }
                await self.api.call("POST", "metrics", "/metrics", json=push)
            except errors.BucketRLError as exc:
                self.stats.failed(f"{self.worker_id} keeper: {exc.code}: {exc.message[:200]}", exc)

    # -- the whole worker ----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, grace_s: float) -> None:
        sync = asyncio.create_task(self.sync_loop())
        keeper = asyncio.create_task(self.keeper_loop())
        engine = asyncio.create_task(self.engine_loop())
        submitter = asyncio.create_task(self.submit_loop())
        staging = asyncio.create_task(self.staging_loop()) if self.staging else None
        await stop.wait()
        for task in [*self.staged.values(), *([staging] if staging is not None else [])]:
            task.cancel()
        self.stopping.set()
        try:
            await asyncio.wait_for(asyncio.gather(engine, submitter), grace_s)
        except TimeoutError:
            self.stats.error(f"{self.worker_id}: in-flight batches not submitted within {grace_s:.0f}s")
        except Exception as exc:  # a bug in this simulation: reported, never hidden
            self.stats.error(f"{self.worker_id}: {type(exc).__name__}: {exc}")
        for task in (sync, keeper, engine, submitter):
            task.cancel()
        for task, result in zip(
            (sync, keeper), await asyncio.gather(sync, keeper, engine, submitter, return_exceptions=True), strict=False
        ):
            if isinstance(result, Exception):
                self.stats.error(f"{self.worker_id} {task.get_name()}: {type(result).__name__}: {result}")
        if self.held:
            await self._release_prompts([{"prompt_id": p} for p in self.held])
        for slot in self.versions.values():
            await self._release_lease(slot.lease_id)


async def run_fleet(
    count: int,
    first: int,
    *,
    settings: WorkerSettings,
    gpu: SimGpu,
    prompts_per_request: int,
    prompt_tokens: int,
    stop: asyncio.Event,
    grace_s: float = 30.0,
    seed: int = 0,
) -> FleetStats:
    stats = FleetStats(generators=count)
    api = Api(settings, stats, connections=3 * count + 4)
    try:
        spec = RunSpec.model_validate((await api.call("GET", "runs", "")).json()["spec"])
        gens = [
            SimGenerator(
                f"simgen-{first + i}",
                api,
                spec,
                gpu,
                stats,
                seed=seed * 100_003 + first + i,
                prompts_per_request=prompts_per_request,
                prompt_tokens=prompt_tokens,
            )
            for i in range(count)
        ]
        await asyncio.gather(*(g.run(stop, grace_s) for g in gens))
    finally:
        await api.close()
    return stats


def _run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A fleet of simulated generators (BUCKETRL_* settings).")
    parser.add_argument("--count", type=int, required=True, help="simulated generators in this process")
    parser.add_argument("--first", type=int, default=0, help="index of the first (worker ids simgen-<i>)")
    parser.add_argument("--prompts-per-request", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = WorkerSettings()

    async def go() -> FleetStats:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run_fleet(
            args.count,
            args.first,
            settings=settings,
            gpu=SimGpu(),
            prompts_per_request=args.prompts_per_request,
            prompt_tokens=args.prompt_tokens,
            stop=stop,
            grace_s=args.grace_s,
            seed=args.seed,
        )

    stats = _run_async(go())
    tmp = args.report.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(stats.to_json()))
    tmp.replace(args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
