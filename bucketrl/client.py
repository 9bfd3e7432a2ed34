"""The HTTP client workers use to talk to the proxy (the only thing a worker talks to).

One method per route of the REST contract, typed with :mod:`bucketrl.wire` models. Error bodies are
turned back into :mod:`bucketrl.errors` classes at exactly one place (:meth:`ProxyClient._request`), so
worker code catches ``Backpressure``, ``Stale``, ``Fenced``... and never looks at status codes.

Transient failures (connection refused, timeouts, any 5xx: a proxy restarting, Redis or the bucket down)
are retried with exponential backoff that waits at least the answer's ``Retry-After``: up to ``retries``
times, or, for a worker (``outage=``:class:`Outage`), for as long as its outage budget lasts (default 10
minutes, BUCKETRL_OUTAGE_BUDGET_S), logging once when the outage starts and once when it ends. Every route
a worker retries is idempotent on the proxy. 429 is returned to the caller as ``Backpressure`` so it can
account the wait as ``rollout/backpressure_s``.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import IO, Any, TypeVar

import httpx
import msgpack
from pydantic import BaseModel

from bucketrl import errors
from bucketrl.client_download import Sink, from_bucket
from bucketrl.client_workers import WorkerOpsClient
from bucketrl.tls import CA_FILE_ENV, TransportSecurity, verification_failure
from bucketrl.wire import (
    AckRequest,
    AckResponse,
    AdapterVersionInfo,
    CheckpointInfo,
    ClaimRequest,
    ClaimResponse,
    EvalLease,
    EvalLeaseRequest,
    EvalResult,
    EvalSubmit,
    EvalSubmitResponse,
    EvalVersionResult,
    MetricsPush,
    PromptLease,
    PromptLeaseRequest,
    PromptReleaseRequest,
    RolloutBatch,
    RunInfo,
    RunSpec,
    RunStatus,
    SubmitResponse,
    TrainerRegistration,
    VersionLease,
    VersionLeaseRequest,
    packed,
)
from bucketrl.wire.datasets import DatasetInfo
from bucketrl.wire.metrics import Renewed
from bucketrl.wire.trainer import TrainerRegisterRequest

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("bucketrl.client")

MAX_BACKOFF_S = 10.0  # between two attempts during an outage (unless Retry-After asks for longer)
MAX_RETRY_AFTER_S = 60.0  # a larger Retry-After is capped: the proxy may be back sooner than it guessed
PRIMARY_RETRY_S = 60.0  # on a fallback URL, try the first one (a region's relay) again this often


class Outage:
    """One worker's view of proxy outages, shared by all its clients (threads).

    An outage starts at the first transient failure of any request and ends at the next success of any
    request. It is logged once at each end; a request gives up (raises the last error) once the outage has
    lasted ``budget_s``.
    """

    STOP_GRACE_S = 30.0  # budget left to a stopping worker (its last checkpoint), however long the full one

    def __init__(self, budget_s: float, who: str = "worker") -> None:
        self.budget_s = budget_s
        self.who = who
        self.since: float | None = None
        self.outages = 0
        self.hard_end: float | None = None  # monotonic end of a preemption notice: no retry outlives it
        self._lock = threading.RLock()  # re-entrant: ``stopping`` runs in signal handlers
        # Wakes the retry waits in progress when the budget shrinks. A Condition, not an Event: a set Event would
        # make every later wait return at once (a busy retry loop for the rest of the stop grace).
        self._changed = threading.Condition()

    def stopping(self, notice_s: float | None = None) -> None:
        """The worker is shutting down: cut the budget to :attr:`STOP_GRACE_S` (a SIGTERM during an outage
        must not wait out ten minutes), and to ``notice_s`` from now under a preemption notice (the machine is
        gone at its end: a retry past it helps nobody and delays the exit), waking every retry wait to re-check."""
        with self._lock:
            self.budget_s = min(self.budget_s, self.STOP_GRACE_S)
            if notice_s is not None:
                end = time.monotonic() + notice_s
                self.hard_end = end if self.hard_end is None else min(self.hard_end, end)
        with self._changed:
            self._changed.notify_all()

    def wait(self, seconds: float) -> None:
        with self._changed:
            self._changed.wait(seconds)

    def spent(self) -> bool:
        """An outage is going on and has lasted the whole budget (or outlived a notice)."""
        since = self.since
        return since is not None and self._left(since, time.monotonic()) <= 0

    def _left(self, since: float, now: float) -> float:
        left = since + self.budget_s - now
        return left if self.hard_end is None else min(left, self.hard_end - now)

    def failed(self, err: errors.BucketRLError) -> float:
        """Record a transient failure; returns the seconds left of the budget (<= 0: give up)."""
        now = time.monotonic()
        with self._lock:
            if self.since is None:
                self.since = now
                self.outages += 1
                log.warning(
                    "%s: proxy unavailable (%s %s); retrying for up to %.0fs (BUCKETRL_OUTAGE_BUDGET_S)",
                    self.who,
                    err.code,
                    err.message[:200],
                    self.budget_s,
                )
            return self._left(self.since, now)

    def recovered(self) -> None:
        if self.since is None:  # the common case: no lock on the hot path
            return
        with self._lock:
            if self.since is not None:
                log.warning("%s: proxy available again after %.1fs", self.who, time.monotonic() - self.since)
                self.since = None


def _transient(err: errors.BucketRLError) -> bool:
    """Worth retrying: the proxy or what is behind it is down or restarting (never a 4xx, never a 429)."""
    return err.status >= 500 and err.retryable


TAR = "application/x-tar"
MSGPACK = "application/msgpack"


class ProxyClient(WorkerOpsClient):
    """Typed client for one run on one proxy."""

    def __init__(
        self,
        base_url: str,
        run: str,
        token: str = "",
        *,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
        outage: Outage | None = None,
        security: TransportSecurity | None = None,
    ) -> None:
        """``retries``: attempts after the first, for a client without ``outage``; with one, transient failures
        are retried until its budget is spent instead. ``base_url``: one URL, or several comma-separated (a
        regional relay, then the home proxy): a connection refused moves to the next, and the first is tried
        again every :data:`PRIMARY_RETRY_S`. ``security`` (default: ``BUCKETRL_CA_FILE``, ``BUCKETRL_INSECURE_HTTP``)
        refuses plain HTTP off loopback (``ValueError``) and verifies HTTPS; a ``transport`` brings its own."""
        security = security or TransportSecurity.from_env()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.run = run
        self.retries = retries
        self.backoff_s = backoff_s
        self.outage = outage
        self.presigned = False  # adapters straight from the bucket when the proxy presigns (client_download.py)
        self.epoch: int | None = None
        self._push_session, self._push_seq = uuid.uuid4().hex, itertools.count(1)
        self._urls = [u.strip().rstrip("/") for u in base_url.split(",") if u.strip()] or [base_url]
        for url in self._urls:
            security.check(url)
        self._url_i, self._switched_at = 0, 0.0
        self._http = httpx.Client(
            base_url=self._urls[0], headers=headers, timeout=timeout_s, transport=transport, verify=security.verify()
        )

    # -- plumbing ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next_url(self, exc: httpx.TransportError) -> None:
        """A connect error (nothing listening, no route): the next URL, if there is one, for the next attempt."""
        if len(self._urls) > 1 and isinstance(exc, httpx.ConnectError):
            was, self._url_i = self._urls[self._url_i], (self._url_i + 1) % len(self._urls)
            self._switched_at = time.monotonic()
            log.warning("%s unreachable (%r): switching to %s", was, exc, self._urls[self._url_i])
            self._http.base_url = httpx.URL(self._urls[self._url_i])

    def _back_to_first(self) -> None:
        if self._url_i and time.monotonic() - self._switched_at >= PRIMARY_RETRY_S:
            self._url_i, self._http.base_url = 0, httpx.URL(self._urls[0])

    def _path(self, suffix: str = "") -> str:
        return f"/v1/runs/{self.run}{suffix}"

    def _fence(self, headers: dict[str, str] | None = None) -> dict[str, str]:
        out = dict(headers or {})
        if self.epoch is not None:
            out["X-Trainer-Epoch"] = str(self.epoch)
        return out

    def _request(
        self,
        method: str,
        url: str,
        *,
        retry: bool = True,
        extra_timeout_s: float = 0.0,
        sink: Sink | None = None,
        **kw: Any,
    ) -> httpx.Response:
        """Send one request; translate error bodies into bucketrl errors; retry transient failures.

        ``sink``: a successful answer's body streams into it (each attempt starts it over) instead of memory."""
        if extra_timeout_s:
            kw["timeout"] = self._http.timeout.read + extra_timeout_s if self._http.timeout.read else None
        attempt = 0
        while True:
            resp, err = self._attempt(method, url, kw, sink)
            if err is None:
                assert resp is not None  # _attempt answers a response or an error (mypy cannot pair them up)
                return resp
            if not (retry and _transient(err)):
                raise err
            if self.outage is not None:
                left = self.outage.failed(err)
                if left <= 0:
                    raise err
            else:
                left = float("inf")
                if attempt >= self.retries:
                    raise err
            # The exponent is capped: a long outage makes thousands of attempts (2**1024 overflows a float).
            backoff = min(MAX_BACKOFF_S, self.backoff_s * 2 ** min(attempt, 20)) * (0.5 + random.random())
            wait = max(0.0, min(max(backoff, min(err.retry_after or 0.0, MAX_RETRY_AFTER_S)), left))
            if self.outage is not None:
                self.outage.wait(wait)
            else:
                time.sleep(wait)
            attempt += 1

    def _attempt(
        self, method: str, url: str, kw: dict[str, Any], sink: Sink | None = None
    ) -> tuple[httpx.Response, None] | tuple[None, errors.BucketRLError]:
        """One request: the response on success, else the error it amounts to."""
        self._back_to_first()
        try:
            resp = self._http.request(method, url, **kw) if sink is None else self._stream(method, url, kw, sink)
        except httpx.TransportError as exc:  # a body cut short mid-stream too (h11 checks Content-Length)
            reason = verification_failure(exc)
            if reason is not None:  # not an outage: retrying cannot make an untrusted certificate trusted
                where = self._http.base_url
                msg = f"TLS: the certificate of {where} failed verification ({reason}); give its CA with {CA_FILE_ENV}"
                return None, errors.Unavailable(msg, retryable=False)
            self._next_url(exc)
            return None, errors.Unavailable(f"proxy unreachable: {exc!r}")
        if resp.status_code < 400:
            if self.outage is not None:
                self.outage.recovered()
            return resp, None
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        return None, errors.from_wire(resp.status_code, body, retry_after_of(resp))

    def _stream(self, method: str, url: str, kw: dict[str, Any], sink: Sink) -> httpx.Response:
        with self._http.stream(method, url, **kw) as resp:
            if resp.status_code >= 400:
                resp.read()  # an error body: small JSON
                return resp
            sink.restart()
            for chunk in resp.iter_bytes():
                sink.write(chunk)
        return resp

    def _json(self, method: str, url: str, model: type[M], body: BaseModel | None = None, **kw: Any) -> M:
        if body is not None:
            kw["content"] = body.model_dump_json(by_alias=True)
            kw.setdefault("headers", {})["Content-Type"] = "application/json"
        resp = self._request(method, url, **kw)
        if resp.headers.get("content-type", "").startswith(MSGPACK):  # asked for with Accept (claims)
            return model.model_validate(msgpack.unpackb(resp.content, raw=False))
        return model.model_validate(resp.json())

    # -- runs and trainer fencing ------------------------------------------------------------------

    def put_run(self, spec: RunSpec) -> RunInfo:
        return self._json("PUT", self._path(), RunInfo, spec)

    def get_run(self, *, retry: bool = True) -> RunInfo:
        """``retry=False``: one attempt, for a caller that polls in its own loop and must hear a stop at once."""
        return self._json("GET", self._path(), RunInfo, retry=retry)

    def register_trainer(self, worker_id: str, *, request_id: str | None = None) -> TrainerRegistration:
        """``request_id`` (default: a fresh one per call) rides on every retry: a retry gets the epoch its first
        attempt took, never a newer one that fences this very trainer."""
        reg = self._json(
            "POST",
            self._path("/trainer"),
            TrainerRegistration,
            TrainerRegisterRequest(worker_id=worker_id, request_id=request_id or uuid.uuid4().hex),
        )
        self.epoch = reg.epoch
        return reg

    # -- adapters -----------------------------------------------------------------------------------

    def publish_adapter(self, version: int, tar_bytes: bytes) -> AdapterVersionInfo:
        headers = self._fence({"Content-Type": TAR, "X-Content-SHA256": hashlib.sha256(tar_bytes).hexdigest()})
        return self._json(
            "PUT", self._path(f"/adapters/{version}"), AdapterVersionInfo, content=tar_bytes, headers=headers
        )

    def wait_for_version(self, after: int, wait_s: float = 30.0) -> AdapterVersionInfo | None:
        """Long-poll for a version newer than ``after``; None when nothing newer appeared in time."""
        resp = self._request(
            "GET", self._path("/adapters/latest"), params={"after": after, "wait_s": wait_s}, extra_timeout_s=wait_s
        )
        if resp.status_code == 204:
            return None
        return AdapterVersionInfo.model_validate(resp.json())

    def download_adapter(self, version: int) -> bytes:
        """The adapter tar in memory (small adapters, tools); a worker streams it to disk with
        :meth:`download_adapter_to`."""
        buf = io.BytesIO()
        self.download_adapter_to(version, buf)
        return buf.getvalue()

    def download_adapter_to(self, version: int, out: IO[bytes], *, fresh: bool = False) -> str:
        """Stream the adapter tar into ``out`` (seekable; a retried attempt starts it over), one chunk in memory at
        a time. Returns its sha256, checked against the proxy's header (``Invalid``, retryable: a corrupted
        transfer, if not). ``fresh``: a cache on the way (a relay) checks its copy first (the retry after that)."""
        sink, headers = Sink(out), {"Cache-Control": "no-cache"} if fresh else {}
        if self.presigned:
            headers["X-Bucketrl-Presign"] = "1"
        resp = self._request("GET", self._path(f"/adapters/{version}"), sink=sink, headers=headers)
        if resp.status_code == 307:  # the tar straight from the bucket; no token goes there
            from_bucket(resp.headers["location"], sink, self._http.timeout)
        want, got = resp.headers.get("X-Content-SHA256"), sink.sha.hexdigest()
        if want and want != got:
            raise errors.Invalid(f"adapter v{version}: sha256 {got} != advertised {want}", retryable=True)
        return got

    # -- leases -------------------------------------------------------------------------------------

    def lease_version(
        self, worker_id: str, version: int | None = None, ttl_s: float = 60.0, *, request_id: str | None = None
    ) -> VersionLease:
        """``request_id`` (default: a fresh one per call) rides on every retry of this call: a retry whose first
        attempt's answer was lost gets that attempt's lease, not a second one left to expire."""
        req = VersionLeaseRequest(
            worker_id=worker_id, version=version, ttl_s=ttl_s, request_id=request_id or uuid.uuid4().hex
        )
        return self._json("POST", self._path("/leases"), VersionLease, req)

    def renew_lease(self, lease_id: str, ttl_s: float = 60.0) -> VersionLease:
        return self._json(
            "POST",
            self._path(f"/leases/{lease_id}/renew"),
            VersionLease,
            content=json.dumps({"ttl_s": ttl_s}),
            headers={"Content-Type": "application/json"},
        )

    def release_lease(self, lease_id: str) -> None:
        self._request("DELETE", self._path(f"/leases/{lease_id}"))

    def lease_prompts(
        self,
        worker_id: str,
        n: int,
        ttl_s: float = 300.0,
        *,
        version: int | None = None,
        wait_s: float = 0.0,
        request_id: str | None = None,
    ) -> PromptLease:
        """Raises ``Backpressure`` (with ``retry_after``) when the pipeline already holds enough work.

        ``version``: the version the caller samples with (admission control keeps its groups within
        max_staleness); ``wait_s``: long-poll for admission that long before the 429 (then Retry-After 0)."""
        return self._json(
            "POST",
            self._path("/prompts/lease"),
            PromptLease,
            PromptLeaseRequest(
                worker_id=worker_id, n=n, ttl_s=ttl_s, version=version, wait_s=wait_s, request_id=request_id
            ),
            extra_timeout_s=wait_s,
        )

    def renew_prompts(self, worker_id: str, prompt_ids: list[str], ttl_s: float = 300.0) -> PromptLease:
        return self._json(
            "POST",
            self._path("/prompts/renew"),
            PromptLease,
            PromptReleaseRequest(worker_id=worker_id, prompt_ids=prompt_ids, ttl_s=ttl_s),
        )

    def release_prompts(self, worker_id: str, prompt_ids: list[str]) -> None:
        body = PromptReleaseRequest(worker_id=worker_id, prompt_ids=prompt_ids)
        self._request(
            "POST",
            self._path("/prompts/release"),
            content=body.model_dump_json(),
            headers={"Content-Type": "application/json"},
        )

    # -- dataset (dataset.uri = "bucket:dataset.jsonl") -------------------------------------------------

    def upload_dataset(self, data: bytes) -> DatasetInfo:
        """Upload the run's JSONL dataset (trainer; once: the same bytes again are fine, others ``Conflict``)."""
        return self._json(
            "PUT", self._path("/dataset"), DatasetInfo, content=data, headers={"Content-Type": "application/x-ndjson"}
        )

    def download_dataset(self) -> bytes:
        """The run's JSONL dataset; its sha256 is checked against the proxy's header (``Invalid`` if not)."""
        resp = self._request("GET", self._path("/dataset"))
        want = resp.headers.get("X-Content-SHA256")
        if want and want != hashlib.sha256(resp.content).hexdigest():
            raise errors.Invalid("dataset: sha256 mismatch", retryable=True)
        return resp.content

    # -- rollouts -----------------------------------------------------------------------------------

    def submit_rollouts(self, batch: RolloutBatch, idempotency_key: str, *, use_msgpack: bool = True) -> SubmitResponse:
        """Submit complete groups. Raises ``Backpressure`` (429), ``Stale`` (409) or ``Invalid`` (422).

        Retrying with the same ``idempotency_key`` after a lost answer is always safe. ``batch.next_prompts``:
        the answer's ``prompts`` leases prompts too (None from an older proxy, or when not leased).
        """
        if use_msgpack:
            content = packed.packb(batch)  # token ids and logprobs as typed bytes (wire/packed.py)
            ctype = MSGPACK
        else:
            content = batch.model_dump_json().encode()
            ctype = "application/json"
        return self._json(
            "POST",
            self._path("/rollouts"),
            SubmitResponse,
            content=content,
            headers={"Content-Type": ctype, "Idempotency-Key": idempotency_key},
        )

    def claim(
        self,
        consumer: str,
        max_groups: int,
        wait_s: float = 0.0,
        min_version: int | None = None,
        *,
        train_version: int | None = None,
        sync_every: int = 1,
        request_id: str | None = None,
        release: list[str] | None = None,
        hold_rebuilt: bool = False,
        ack: list[str] | None = None,
    ) -> ClaimResponse:
        """``min_version``: drop (and count) groups older than it too, besides ``latest - max_staleness``.
        ``train_version`` / ``sync_every``: the trainer's pace, for the proxy's admission control.
        ``request_id``: the same on every retry of one claim (a replay answers the same deliveries);
        ``release``: delivery ids given back untrained; ``hold_rebuilt``: hand over re-queued groups below the
        floor flagged ``rebuilt_stale`` instead of dropping them (the caller acks or releases each); ``ack``:
        delivery ids to acknowledge first, in the same request (a proxy that does not answer ``acked`` ignored
        them: they are acked on their own then, after the claim)."""
        resp = self._json(
            "POST",
            self._path("/rollouts/claim"),
            ClaimResponse,
            ClaimRequest(
                consumer=consumer,
                max_groups=max_groups,
                wait_s=wait_s,
                min_version=min_version,
                train_version=train_version,
                sync_every=sync_every,
                request_id=request_id,
                release=release or [],
                hold_rebuilt=hold_rebuilt,
                ack=ack or [],
            ),
            # msgpack with packed arrays: a fraction of the JSON's size and of its decoding (wire/packed.py).
            headers=self._fence({"Accept": f"{MSGPACK}, application/json;q=0.5"}),
            extra_timeout_s=wait_s,
        )
        if ack and resp.acked is None:  # an older proxy
            resp.acked = self.ack(ack)
        return resp

    def ack(self, delivery_ids: list[str]) -> int:
        return self._json(
            "POST",
            self._path("/rollouts/ack"),
            AckResponse,
            AckRequest(delivery_ids=delivery_ids),
            headers=self._fence(),
        ).acked

    # -- checkpoints --------------------------------------------------------------------------------

    def put_checkpoint(self, step: int, tar_bytes: bytes) -> CheckpointInfo:
        headers = self._fence({"Content-Type": TAR, "X-Content-SHA256": hashlib.sha256(tar_bytes).hexdigest()})
        return self._json("PUT", self._path(f"/checkpoints/{step}"), CheckpointInfo, content=tar_bytes, headers=headers)

    def latest_checkpoint(self) -> CheckpointInfo | None:
        try:
            return self._json("GET", self._path("/checkpoints/latest"), CheckpointInfo)
        except errors.NotFound:
            return None

    def download_checkpoint(self, step: int) -> bytes:
        resp = self._request("GET", self._path(f"/checkpoints/{step}"))
        want = resp.headers.get("X-Content-SHA256")
        if want and want != hashlib.sha256(resp.content).hexdigest():
            raise errors.Invalid(f"checkpoint step {step}: sha256 mismatch", retryable=True)
        return resp.content

    # -- observability ------------------------------------------------------------------------------

    def push_metrics(self, push: MetricsPush) -> Renewed | None:
        """Numbered (this client's session, next seq) unless the caller did: its retries are recorded once, and
        one that arrives after a newer push is not recorded at all. Returns what ``push.renew`` renewed; None
        without it, or from an older proxy (which ignored it: renew on the renew routes then)."""
        if push.seq is None:
            push = push.model_copy(update={"session": self._push_session, "seq": next(self._push_seq)})
        resp = self._request(
            "POST", self._path("/metrics"), content=push.model_dump_json(), headers={"Content-Type": "application/json"}
        )
        if resp.status_code != 200 or not resp.content:
            return None
        return Renewed.model_validate(resp.json())

    def status(self) -> RunStatus:
        return self._json("GET", self._path("/status"), RunStatus)

    # -- evaluation during training ------------------------------------------------------------------

    def lease_eval(
        self, worker_id: str, versions: list[int], n: int, ttl_s: float = 120.0, *, request_id: str | None = None
    ) -> EvalLease:
        """Eval prompts of one of ``versions`` (the caller's loaded ones); empty when there is nothing to do.
        ``request_id`` (default: a fresh one per call) makes a retry get the first attempt's prompts."""
        req = EvalLeaseRequest(
            worker_id=worker_id, versions=versions, n=n, ttl_s=ttl_s, request_id=request_id or uuid.uuid4().hex
        )
        return self._json("POST", self._path("/eval/lease"), EvalLease, req)

    def submit_eval(self, worker_id: str, results: list[EvalResult]) -> EvalSubmitResponse:
        req = EvalSubmit(worker_id=worker_id, results=results)
        return self._json("POST", self._path("/eval/submit"), EvalSubmitResponse, req)

    def eval_results(self) -> list[EvalVersionResult]:
        resp = self._request("GET", self._path("/eval"))
        return [EvalVersionResult.model_validate(x) for x in resp.json()]

    def iter_versions(self, after: int = 0, wait_s: float = 30.0) -> Iterator[AdapterVersionInfo]:
        """Yield every newly published version, forever (long-poll loop)."""
        while True:
            info = self.wait_for_version(after, wait_s)
            if info is not None:
                after = info.version
                yield info


def retry_after_of(resp: httpx.Response) -> float | None:
    """An answer's ``Retry-After`` in seconds (>= 0), None when absent or not a number."""
    raw = resp.headers.get("Retry-After")
    try:
        return max(0.0, float(raw)) if raw else None
    except ValueError:  # an HTTP-date (not sent by the proxy): treat as absent
        return None
