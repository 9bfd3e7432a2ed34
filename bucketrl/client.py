"""The HTTP client workers use to talk to the proxy (the only thing a worker talks to).

One method per route of the REST contract, typed with :mod:`bucketrl.wire` models. Error bodies are
turned back into :mod:`bucketrl.errors` classes at exactly one place (:meth:`ProxyClient._request`), so
worker code catches ``Backpressure``, ``Stale``, ``Fenced``... and never looks at status codes.

Transport failures (connection refused, timeouts) and retryable errors (503) are retried with
exponential backoff up to ``retries`` times; 429 is returned to the caller as ``Backpressure`` so it
can account the wait as ``rollout/backpressure_s``.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import httpx
import msgpack
from pydantic import BaseModel

from bucketrl import errors
from bucketrl.wire import (
    AckRequest,
    AckResponse,
    AdapterVersionInfo,
    CheckpointInfo,
    ClaimRequest,
    ClaimResponse,
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
)
from bucketrl.wire.datasets import DatasetInfo

M = TypeVar("M", bound=BaseModel)

TAR = "application/x-tar"


class ProxyClient:
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
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.run = run
        self.retries = retries
        self.backoff_s = backoff_s
        self.epoch: int | None = None
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )

    # -- plumbing ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _path(self, suffix: str = "") -> str:
        return f"/v1/runs/{self.run}{suffix}"

    def _fence(self, headers: dict[str, str] | None = None) -> dict[str, str]:
        out = dict(headers or {})
        if self.epoch is not None:
            out["X-Trainer-Epoch"] = str(self.epoch)
        return out

    def _request(
        self, method: str, url: str, *, retry: bool = True, extra_timeout_s: float = 0.0, **kw: Any
    ) -> httpx.Response:
        """Send one request; translate error bodies into bucketrl errors; retry transient failures."""
        attempts = self.retries + 1 if retry else 1
        if extra_timeout_s:
            kw["timeout"] = self._http.timeout.read + extra_timeout_s if self._http.timeout.read else None
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                resp = self._http.request(method, url, **kw)
            except httpx.TransportError as exc:
                last = errors.Unavailable(f"proxy unreachable: {exc!r}")
            else:
                if resp.status_code < 400:
                    return resp
                try:
                    body = resp.json()
                except ValueError:
                    body = resp.text
                ra = resp.headers.get("Retry-After")
                err = errors.from_wire(resp.status_code, body, float(ra) if ra else None)
                if not (err.retryable and isinstance(err, errors.Unavailable)):
                    raise err
                last = err
            if attempt + 1 < attempts:
                time.sleep(min(5.0, self.backoff_s * 2**attempt) * (0.5 + random.random()))
        assert last is not None
        raise last

    def _json(self, method: str, url: str, model: type[M], body: BaseModel | None = None, **kw: Any) -> M:
        if body is not None:
            kw["content"] = body.model_dump_json(by_alias=True)
            kw.setdefault("headers", {})["Content-Type"] = "application/json"
        return model.model_validate(self._request(method, url, **kw).json())

    # -- runs and trainer fencing ------------------------------------------------------------------

    def put_run(self, spec: RunSpec) -> RunInfo:
        return self._json("PUT", self._path(), RunInfo, spec)

    def get_run(self) -> RunInfo:
        return self._json("GET", self._path(), RunInfo)

    def register_trainer(self, worker_id: str) -> TrainerRegistration:
        reg = self._json(
            "POST",
            self._path("/trainer"),
            TrainerRegistration,
            content=json.dumps({"worker_id": worker_id}),
            headers={"Content-Type": "application/json"},
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
        """The adapter tar; its sha256 is checked against the proxy's header (``Invalid`` if not)."""
        resp = self._request("GET", self._path(f"/adapters/{version}"))
        want = resp.headers.get("X-Content-SHA256")
        got = hashlib.sha256(resp.content).hexdigest()
        if want and want != got:
            raise errors.Invalid(f"adapter v{version}: sha256 {got} != advertised {want}", retryable=True)
        return resp.content

    # -- leases -------------------------------------------------------------------------------------

    def lease_version(self, worker_id: str, version: int | None = None, ttl_s: float = 60.0) -> VersionLease:
        return self._json(
            "POST",
            self._path("/leases"),
            VersionLease,
            VersionLeaseRequest(worker_id=worker_id, version=version, ttl_s=ttl_s),
        )

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
        self, worker_id: str, n: int, ttl_s: float = 300.0, *, version: int | None = None, wait_s: float = 0.0
    ) -> PromptLease:
        """Raises ``Backpressure`` (with ``retry_after``) when the pipeline already holds enough work.

        ``version``: the version the caller samples with (admission control keeps its groups within
        max_staleness); ``wait_s``: long-poll for admission that long before the 429 (then Retry-After 0)."""
        return self._json(
            "POST",
            self._path("/prompts/lease"),
            PromptLease,
            PromptLeaseRequest(worker_id=worker_id, n=n, ttl_s=ttl_s, version=version, wait_s=wait_s),
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

        Retrying with the same ``idempotency_key`` after a lost answer is always safe.
        """
        if use_msgpack:
            content = msgpack.packb(batch.model_dump(mode="json"), use_bin_type=True)
            ctype = "application/msgpack"
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
    ) -> ClaimResponse:
        """``min_version``: drop (and count) groups older than it too, besides ``latest - max_staleness``.
        ``train_version`` / ``sync_every``: the trainer's pace, for the proxy's admission control."""
        return self._json(
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
            ),
            headers=self._fence(),
            extra_timeout_s=wait_s,
        )

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

    def push_metrics(self, push: MetricsPush) -> None:
        self._request(
            "POST", self._path("/metrics"), content=push.model_dump_json(), headers={"Content-Type": "application/json"}
        )

    def status(self) -> RunStatus:
        return self._json("GET", self._path("/status"), RunStatus)

    def iter_versions(self, after: int = 0, wait_s: float = 30.0) -> Iterator[AdapterVersionInfo]:
        """Yield every newly published version, forever (long-poll loop)."""
        while True:
            info = self.wait_for_version(after, wait_s)
            if info is not None:
                after = info.version
                yield info
