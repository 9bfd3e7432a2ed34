"""Spot notices heard from the cloud itself (issue 33): a worker watches its cloud's preemption notice and drains
itself with the time the cloud gave it, through the same path as SIGTERM or a proxy drain (issue 25).

``BUCKETRL_SPOT_NOTICE`` picks the cloud (``aws``, ``gcp``, ``azure``), ``off``, or ``auto`` (the default), which
recognises the cloud from the machine's own identity, the DMI files under ``BUCKETRL_DMI_DIR``, never by sending a
request: a laptop, an on-premises server or any machine no cloud identifies watches nothing and contacts no
metadata address (a test suite run on a cloud VM sets ``off``).

What each cloud documents, and what the watcher does with it:

- **AWS** (EC2 IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` gives a session
  token; ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token`` answers 404 until an
  interruption is scheduled, then ``{"action": "terminate"|"stop"|"hibernate", "time": "<UTC ISO 8601>"}``, two
  minutes ahead. AWS recommends checking every 5 s; the notice is ``time - now``.
- **GCP** (Compute Engine metadata server): ``GET /computeMetadata/v1/instance/preempted`` with
  ``Metadata-Flavor: Google`` answers ``TRUE`` or ``FALSE``; with ``wait_for_change=true&last_etag=E`` the request
  hangs until the value changes (``last_etag``: a change between two requests is not missed). A preempted VM gets
  30 s before it is stopped.
- **Azure** (Scheduled Events): ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``
  lists events; a ``Preempt`` event naming this VM (``Resources``, matched against
  ``/metadata/instance/compute/name``) happens at ``NotBefore`` (at least 30 s ahead) or when acknowledged with
  ``POST {"StartRequests": [{"EventId": ...}]}``. The watcher acknowledges only once the drain is done
  (:meth:`SpotWatch.done`), so the worker keeps the whole notice.

The base URL of the metadata service is ``BUCKETRL_SPOT_METADATA_URL`` (empty: the cloud's own). Requests to it go
straight out, never through an HTTP proxy of the environment (``trust_env=False``): a link-local service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import ClassVar

import httpx

log = logging.getLogger("bucketrl.spot_notice")

MODES = ("auto", "aws", "gcp", "azure", "off")
DEFAULT_DMI_DIR = "/sys/class/dmi/id"
# The DMI files the identity is read from (missing or unreadable: empty).
DMI_FILES = ("sys_vendor", "product_name", "bios_vendor", "bios_version", "chassis_asset_tag")
# Every Azure VM carries this SMBIOS chassis asset tag (Hyper-V outside Azure has the same vendor and product).
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
# After a failed request (the service restarting, a refused connection), wait this long before the next.
RETRY_S = 2.0

OnNotice = Callable[[float, str], None]


def read_dmi(dmi_dir: str | Path) -> dict[str, str]:
    """The machine's identity: each of :data:`DMI_FILES`, stripped ('' where absent)."""
    out: dict[str, str] = {}
    for name in DMI_FILES:
        try:
            out[name] = (Path(dmi_dir) / name).read_text(errors="replace").strip()
        except OSError:
            out[name] = ""
    return out


def detect_cloud(dmi_dir: str | Path = DEFAULT_DMI_DIR) -> str | None:
    """``aws``, ``gcp`` or ``azure`` when the DMI identity names that cloud; None otherwise. Reads files only."""
    dmi = read_dmi(dmi_dir)
    if dmi["chassis_asset_tag"] == AZURE_ASSET_TAG:
        return "azure"
    if dmi["product_name"] == "Google Compute Engine" or "Google" in (dmi["sys_vendor"], dmi["bios_vendor"]):
        return "gcp"
    # Nitro instances name themselves "Amazon EC2"; the older Xen ones carry "amazon" in the BIOS version.
    if "Amazon EC2" in (dmi["sys_vendor"], dmi["bios_vendor"]) or "amazon" in dmi["bios_version"].lower():
        return "aws"
    return None


def resolve(mode: str, dmi_dir: str | Path = DEFAULT_DMI_DIR) -> str | None:
    """The cloud to watch for ``BUCKETRL_SPOT_NOTICE=mode``; None: watch nothing."""
    if mode not in MODES:
        raise ValueError(f"BUCKETRL_SPOT_NOTICE must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return None
    return detect_cloud(dmi_dir) if mode == "auto" else mode


def _seconds_until(when: datetime) -> float:
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


class SpotWatch:
    """A daemon thread that calls ``on_notice(notice_s, why)`` once when the cloud announces the reclaim.

    Subclasses say how one cloud announces it (:meth:`poll`); ``pause_s`` is the wait between two polls (0 where
    the request itself waits for a change). Ends when ``stop`` is set (the worker is stopping anyway)."""

    cloud: ClassVar[str] = ""
    default_base_url: ClassVar[str] = ""

    def __init__(self, base_url: str, on_notice: OnNotice, stop: threading.Event, *, poll_s: float = 2.0) -> None:
        self.base_url = (base_url or self.default_base_url).rstrip("/")
        self.on_notice, self.stop, self.poll_s = on_notice, stop, poll_s
        self.pause_s = poll_s
        self.heard: float | None = None  # the notice's length, once heard
        self._failing = False
        self.setup()

    def setup(self) -> None:
        """A cloud's own state (a session token, an etag)."""

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name=f"spot-notice-{self.cloud}", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        log.info("watching for %s spot notices at %s", self.cloud, self.base_url)
        with httpx.Client(base_url=self.base_url, trust_env=False, timeout=httpx.Timeout(10.0)) as http:
            while not self.stop.is_set():
                try:
                    got = self.poll(http)
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    if not self._failing:  # once per outage
                        log.warning("%s metadata service: %r; retrying every %.0fs", self.cloud, exc, RETRY_S)
                    self._failing = True
                    self.stop.wait(RETRY_S)
                    continue
                self._failing = False
                if got is not None:
                    self.heard = got[0]
                    self.on_notice(*got)
                    return
                if self.pause_s:
                    self.stop.wait(self.pause_s)

    def poll(self, http: httpx.Client) -> tuple[float, str] | None:
        """One look at the service: ``(notice_s, why)`` once a reclaim is announced, else None."""
        raise NotImplementedError

    def done(self) -> None:
        """The drain is over (the worker is about to exit): tell the cloud where it asks to be told."""


class AwsWatch(SpotWatch):
    cloud, default_base_url = "aws", "http://169.254.169.254"
    TOKEN_TTL_S = 21600  # IMDSv2's longest session

    def setup(self) -> None:
        self._token: str | None = None
        self._token_until = 0.0

    def _session_token(self, http: httpx.Client) -> str:
        if self._token is None or time.monotonic() > self._token_until:
            r = http.put("/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
            r.raise_for_status()
            self._token, self._token_until = r.text.strip(), time.monotonic() + self.TOKEN_TTL_S - 60
        return self._token

    def poll(self, http: httpx.Client) -> tuple[float, str] | None:
        token = self._session_token(http)
        r = http.get("/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token})
        if r.status_code == 401:  # the token expired or the service restarted: a new one next time
            self._token = None
            return None
        if r.status_code == 404:  # nothing scheduled
            return None
        r.raise_for_status()
        doc = r.json()
        when = datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00"))
        return _seconds_until(when), f"aws spot {doc['action']} at {doc['time']}"


class GcpWatch(SpotWatch):
    cloud, default_base_url = "gcp", "http://metadata.google.internal"
    NOTICE_S = 30.0  # a preempted VM is stopped 30 s after the flag turns TRUE
    WAIT_S = 60  # each hanging GET's timeout_sec; the stop is checked between two

    def setup(self) -> None:
        self.pause_s = 0.0  # the request itself waits
        self._etag: str | None = None

    def poll(self, http: httpx.Client) -> tuple[float, str] | None:
        params = {} if self._etag is None else {"wait_for_change": "true", "last_etag": self._etag}
        if params:
            params["timeout_sec"] = str(self.WAIT_S)
        r = http.get(
            "/computeMetadata/v1/instance/preempted",
            params=params,
            headers={"Metadata-Flavor": "Google"},
            timeout=httpx.Timeout(10.0, read=self.WAIT_S + 10.0),
        )
        r.raise_for_status()
        if r.headers.get("Metadata-Flavor") != "Google":  # whatever answered is not Google's metadata server
            raise ValueError(f"{self.base_url} answered without 'Metadata-Flavor: Google'")
        self._etag = r.headers.get("ETag")
        return (self.NOTICE_S, "gcp preempted") if r.text.strip().upper() == "TRUE" else None


class AzureWatch(SpotWatch):
    cloud, default_base_url = "azure", "http://169.254.169.254"
    API_VERSION = "2020-07-01"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata": "true"}

    def setup(self) -> None:
        self._vm: str | None = None
        self.event_id: str | None = None
        self.acknowledged = False

    def poll(self, http: httpx.Client) -> tuple[float, str] | None:
        if self._vm is None:
            params = {"api-version": "2021-02-01", "format": "text"}
            r = http.get("/metadata/instance/compute/name", params=params, headers=self.HEADERS)
            r.raise_for_status()
            self._vm = r.text.strip()
        # The first request of a VM enables the service and may take up to two minutes to answer.
        r = http.get(
            "/metadata/scheduledevents",
            params={"api-version": self.API_VERSION},
            headers=self.HEADERS,
            timeout=httpx.Timeout(10.0, read=150.0),
        )
        r.raise_for_status()
        for event in r.json().get("Events", []):
            if event.get("EventType") == "Preempt" and self._vm in event.get("Resources", []):
                self.event_id = str(event["EventId"])
                not_before = event.get("NotBefore") or ""  # empty once the event has started
                notice_s = _seconds_until(parsedate_to_datetime(not_before)) if not_before else 0.0
                return notice_s, f"azure Preempt {self.event_id} not before {not_before or 'now'}"
        return None

    def done(self) -> None:
        if self.event_id is None or self.acknowledged:
            return
        body = {"StartRequests": [{"EventId": self.event_id}]}
        try:
            r = httpx.post(
                f"{self.base_url}/metadata/scheduledevents",
                params={"api-version": self.API_VERSION},
                headers=self.HEADERS,
                json=body,
                timeout=5.0,
                trust_env=False,
            )
            r.raise_for_status()
            self.acknowledged = True
            log.info("acknowledged the Preempt event %s: the drain is done", self.event_id)
        except httpx.HTTPError as exc:  # the VM goes at NotBefore anyway
            log.warning("could not acknowledge the Preempt event %s: %r", self.event_id, exc)


WATCHES: dict[str, type[SpotWatch]] = {"aws": AwsWatch, "gcp": GcpWatch, "azure": AzureWatch}


def start_watch(
    mode: str, on_notice: OnNotice, stop: threading.Event, *, base_url: str = "", dmi_dir: str = "", poll_s: float = 2.0
) -> SpotWatch | None:
    """Start watching the cloud ``mode`` resolves to (its thread running); None, and nothing sent, for none."""
    cloud = resolve(mode, dmi_dir or DEFAULT_DMI_DIR)
    if cloud is None:
        if mode == "auto":
            log.info("spot notices: no cloud recognised from %s; watching none", dmi_dir or DEFAULT_DMI_DIR)
        return None
    watch = WATCHES[cloud](base_url, on_notice, stop, poll_s=poll_s)
    watch.start()
    return watch
