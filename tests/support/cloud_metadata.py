"""EMULATIONS of the three clouds' instance metadata services, on loopback, for the spot-notice tests (issue 33).

A cloud's metadata service is the one edge that is not available here (and tests must never send a request to
169.254.169.254 or metadata.google.internal), so each is emulated from its public documentation: the same paths,
headers, token exchange and JSON shapes, and the same refusals of a request that lacks them. Only what the
spot-notice watchers touch is emulated:

- AWS IMDSv2: ``PUT /latest/api/token`` (``X-aws-ec2-metadata-token-ttl-seconds`` 1-21600, else 400) answers a
  session token; ``GET /latest/meta-data/spot/instance-action`` needs ``X-aws-ec2-metadata-token`` (401 without a
  valid one, as on an instance that requires IMDSv2), answers 404 until an interruption is scheduled, then
  ``{"action": "terminate", "time": "YYYY-MM-DDTHH:MM:SSZ"}``.
- GCP: ``GET /computeMetadata/v1/instance/preempted`` needs ``Metadata-Flavor: Google`` (403 without), answers
  ``TRUE``/``FALSE`` with ``Metadata-Flavor: Google`` and an ``ETag``; ``wait_for_change=true`` hangs until the
  value differs from ``last_etag`` (at once if it already does) or ``timeout_sec`` passes.
- Azure: ``/metadata/...`` needs ``Metadata: true`` and an ``api-version`` (400 without);
  ``GET /metadata/instance/compute/name?format=text`` answers the VM's name; ``GET /metadata/scheduledevents``
  answers ``{"DocumentIncarnation", "Events": [{"EventId", "EventType", "ResourceType", "Resources",
  "EventStatus", "NotBefore" (RFC 1123), "Description", "EventSource", "DurationInSeconds"}]}``;
  ``POST /metadata/scheduledevents`` with ``{"StartRequests": [{"EventId"}]}`` starts the event (recorded).

Served by aiohttp in a thread of the test process; the workers under test reach it over real HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

from aiohttp import web

from tests.support.services import free_port


class CloudMetadata:
    """One cloud's metadata service: ``announce(notice_s)`` schedules the reclaim ``notice_s`` from now."""

    def __init__(self, cloud: str, vm_name: str = "bucketrl-spot-0") -> None:
        assert cloud in ("aws", "gcp", "azure"), cloud
        self.cloud, self.vm_name = cloud, vm_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request served
        self.announced_at: float | None = None  # monotonic, when the notice became visible
        self.acks: list[tuple[float, dict[str, Any]]] = []  # Azure StartRequests bodies, with their arrival time
        self.on_ack: Callable[[], Any] | None = None  # called in the handler, before it answers
        self.ack_snapshot: Any = None
        self._tokens: set[str] = set()
        self._action: dict[str, str] | None = None
        self._preempted = False
        self._events: list[dict[str, Any]] = []
        self._incarnation = 1
        self._changed: asyncio.Event | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- the test's side ---------------------------------------------------------------------------------------
    def announce(self, notice_s: float, *, resources: list[str] | None = None, event_type: str = "Preempt") -> None:
        """Make the reclaim visible, as the cloud does ``notice_s`` before it (thread-safe)."""
        assert self._loop is not None
        done = threading.Event()

        def apply() -> None:
            at = datetime.now(UTC) + timedelta(seconds=notice_s)
            if self.cloud == "aws":
                self._action = {"action": "terminate", "time": at.strftime("%Y-%m-%dT%H:%M:%SZ")}
            elif self.cloud == "gcp":
                self._preempted = True
            else:
                self._events.append(self._event(at, resources or [self.vm_name], event_type))
                self._incarnation += 1
            if resources is None and event_type == "Preempt":
                self.announced_at = time.monotonic()
            assert self._changed is not None
            self._changed.set()
            self._changed = asyncio.Event()
            done.set()

        self._loop.call_soon_threadsafe(apply)
        assert done.wait(5), "the emulator's loop did not run"

    @staticmethod
    def _event(at: datetime, resources: list[str], event_type: str) -> dict[str, Any]:
        return {
            "EventId": str(uuid.uuid4()).upper(),
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": resources,
            "EventStatus": "Scheduled",
            "NotBefore": format_datetime(at.replace(microsecond=0), usegmt=True),
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }

    # -- AWS ----------------------------------------------------------------------------------------------------
    async def _aws_token(self, request: web.Request) -> web.Response:
        ttl = request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return web.Response(status=400)
        token = secrets.token_urlsafe(40)
        self._tokens.add(token)
        return web.Response(text=token, headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    async def _aws_instance_action(self, request: web.Request) -> web.Response:
        if request.headers.get("X-aws-ec2-metadata-token") not in self._tokens:
            return web.Response(status=401)
        if self._action is None:
            return web.Response(status=404, text="Not Found")
        return web.json_response(self._action)

    # -- GCP ----------------------------------------------------------------------------------------------------
    def _gcp_answer(self) -> web.Response:
        value = "TRUE" if self._preempted else "FALSE"
        etag = hashlib.sha256(value.encode()).hexdigest()[:16]
        headers = {"Metadata-Flavor": "Google", "ETag": etag, "Content-Type": "application/text"}
        return web.Response(text=value, headers=headers)

    async def _gcp_preempted(self, request: web.Request) -> web.Response:
        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(status=403, text="Missing Metadata-Flavor:Google header.")
        if request.query.get("wait_for_change") == "true":
            deadline = time.monotonic() + float(request.query.get("timeout_sec", "300"))
            while self._gcp_answer().headers["ETag"] == request.query.get("last_etag") and not self._closing:
                assert self._changed is not None
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    break
        return self._gcp_answer()

    # -- Azure --------------------------------------------------------------------------------------------------
    @staticmethod
    def _azure_refused(request: web.Request) -> web.Response | None:
        if request.headers.get("Metadata") != "true":
            return web.json_response({"error": "Bad request. Required metadata header not specified"}, status=400)
        if "api-version" not in request.query:
            return web.json_response({"error": "Bad request. api-version was not specified"}, status=400)
        return None

    async def _azure_name(self, request: web.Request) -> web.Response:
        return self._azure_refused(request) or web.Response(text=self.vm_name)

    async def _azure_events(self, request: web.Request) -> web.Response:
        if (refused := self._azure_refused(request)) is not None:
            return refused
        if request.method == "POST":
            body = await request.json()
            ids = [s["EventId"] for s in body["StartRequests"]]
            if self.on_ack is not None:
                self.ack_snapshot = self.on_ack()
            self.acks.append((time.monotonic(), body))
            for event in self._events:
                if event["EventId"] in ids:
                    event["EventStatus"], event["NotBefore"] = "Started", ""
            return web.Response(status=200)
        return web.json_response({"DocumentIncarnation": self._incarnation, "Events": self._events})

    # -- serving ------------------------------------------------------------------------------------------------
    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        return await handler(request)

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        if self.cloud == "aws":
            app.router.add_put("/latest/api/token", self._aws_token)
            app.router.add_get("/latest/meta-data/spot/instance-action", self._aws_instance_action)
        elif self.cloud == "gcp":
            app.router.add_get("/computeMetadata/v1/instance/preempted", self._gcp_preempted)
        else:
            app.router.add_get("/metadata/instance/compute/name", self._azure_name)
            app.router.add_route("*", "/metadata/scheduledevents", self._azure_events)
        return app

    def start(self) -> CloudMetadata:
        ready = threading.Event()

        async def serve() -> None:
            self._changed = asyncio.Event()
            self._runner = web.AppRunner(self._app(), access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            ready.set()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name=f"{self.cloud}-metadata", daemon=True)
        self._thread.start()
        assert ready.wait(10), "the metadata emulator did not start"
        return self

    def stop(self) -> None:
        if self._loop is None or self._runner is None:
            return

        def close() -> None:  # hanging GETs answer now, or the server's clean-up would wait them out
            self._closing = True
            if self._changed is not None:
                self._changed.set()

        self._loop.call_soon_threadsafe(close)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> CloudMetadata:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
