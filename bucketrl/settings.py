"""Settings every worker shares. Each service adds its own class (``bucketrl.<service>.settings``).

All settings come from ``BUCKETRL_*`` environment variables (pydantic-settings). Settings objects are
built by entry points, never at import time.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bucketrl import errors
from bucketrl.client import Outage, ProxyClient
from bucketrl.cost import detect_gpu_class
from bucketrl.spot_notice import DEFAULT_DMI_DIR, OnNotice, SpotWatch, start_watch
from bucketrl.tls import TransportSecurity
from bucketrl.wire import MetricsPush
from bucketrl.wire.common import ID_PATTERN
from bucketrl.wire.cost import GPU_CLASS_PATTERN

if TYPE_CHECKING:
    from bucketrl.client import Outage, ProxyClient


class WorkerSettings(BaseSettings):
    """What a trainer or generator needs: the proxy's address, its own token and the run id."""

    model_config = SettingsConfigDict(env_prefix="BUCKETRL_", extra="ignore")

    proxy_url: str = Field(
        "http://127.0.0.1:8000",
        description="Base URL of the proxy (BUCKETRL_PROXY_URL); several comma-separated are tried in turn when one "
        "cannot be reached (a regional relay first, the home proxy as its fallback).",
    )
    token: str = Field("", description="This worker's bearer token (BUCKETRL_TOKEN); empty = no auth header.")
    run: str = Field("demo", pattern=ID_PATTERN, description="Run id (BUCKETRL_RUN).")
    worker_id: str = Field("", description="Stable worker id; default: hostname-pid (BUCKETRL_WORKER_ID).")
    http_timeout_s: float = Field(30.0, gt=0, description="Per-request HTTP timeout (BUCKETRL_HTTP_TIMEOUT_S).")
    outage_budget_s: float = Field(
        600.0,
        ge=0,
        description="BUCKETRL_OUTAGE_BUDGET_S: ride out a proxy outage (unreachable, 5xx: a restart, Redis or the "
        "bucket down) this long, retrying with backoff that honours Retry-After; then give up (exit 1).",
    )

    gpu_class: str = Field(
        "",
        pattern=r"^$|" + GPU_CLASS_PATTERN[1:],
        description="BUCKETRL_GPU_CLASS: what this worker runs on (h100, a10g, cpu, ...; docs/cost.md); empty: "
        "detected (nvidia-smi's first GPU, cpu without one).",
    )
    usd_per_hour: float | None = Field(
        None,
        ge=0.0,
        le=10_000.0,
        allow_inf_nan=False,
        description="BUCKETRL_USD_PER_HOUR: what an hour of this worker costs; unset: the proxy's price of its GPU "
        "class (public list prices, estimates, unless BUCKETRL_PRICES says otherwise).",
    )

    def declared_gpu_class(self) -> str:
        """The GPU class the worker's metrics pushes declare (with ``usd_per_hour``)."""

        return self.gpu_class or detect_gpu_class()

    ca_file: str = Field(
        "",
        description="BUCKETRL_CA_FILE: PEM file of the CA(s) the proxy's HTTPS certificate is verified against; "
        "empty = the system store.",
    )
    insecure_http: bool = Field(
        False,
        description="BUCKETRL_INSECURE_HTTP: allow a plain http:// proxy URL to a non-loopback host (bearer tokens "
        "cross the network unencrypted): only inside one private network, on purpose.",
    )

    presigned_adapters: bool = Field(
        False,
        description="BUCKETRL_PRESIGNED_ADAPTERS: ask for adapter downloads straight from an S3 bucket (a presigned "
        "URL the proxy hands out when BUCKETRL_PRESIGN_ADAPTERS_S is set; no bucket keys on the worker).",
    )

    spot_notice: Literal["auto", "aws", "gcp", "azure", "off"] = Field(
        "auto",
        description="BUCKETRL_SPOT_NOTICE: watch this cloud's preemption notice and drain with the time it gives "
        "(AWS IMDSv2 spot/instance-action, GCP instance/preempted, Azure Scheduled Events Preempt; "
        "bucketrl/spot_notice.py); 'auto' recognises the cloud from the DMI files (no request sent) and watches "
        "nothing where none is recognised; 'off' watches nothing.",
    )
    spot_metadata_url: str = Field(
        "",
        description="BUCKETRL_SPOT_METADATA_URL: base URL of the cloud's metadata service; empty = the cloud's own "
        "(http://169.254.169.254 on AWS and Azure, http://metadata.google.internal on GCP).",
    )
    spot_poll_s: float = Field(
        2.0,
        gt=0.0,
        le=60.0,
        description="BUCKETRL_SPOT_POLL_S: seconds between two looks at an AWS or Azure notice (GCP's request "
        "waits for the change itself).",
    )
    dmi_dir: str = Field(
        DEFAULT_DMI_DIR,
        description="BUCKETRL_DMI_DIR: where BUCKETRL_SPOT_NOTICE=auto reads the machine's identity (sys_vendor, "
        "product_name, bios_vendor, bios_version, chassis_asset_tag).",
    )

    def spot_watch(self, on_notice: OnNotice, stop: threading.Event) -> SpotWatch | None:
        """Start this worker's spot-notice watcher (None: no cloud to watch, nothing sent)."""
        return start_watch(
            self.spot_notice,
            on_notice,
            stop,
            base_url=self.spot_metadata_url,
            dmi_dir=self.dmi_dir,
            poll_s=self.spot_poll_s,
        )

    @field_validator("spot_notice", mode="before")
    @classmethod
    def _spot_notice(cls, v: object) -> object:
        if v not in ("auto", "aws", "gcp", "azure", "off"):
            raise ValueError(f"BUCKETRL_SPOT_NOTICE must be auto, aws, gcp, azure or off, got {v!r}")
        return v

    @field_validator("spot_metadata_url")
    @classmethod
    def _metadata_url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"BUCKETRL_SPOT_METADATA_URL must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    @property
    def security(self) -> TransportSecurity:
        return TransportSecurity(ca_file=self.ca_file, insecure_http=self.insecure_http)

    @model_validator(mode="after")
    def _transport_security(self) -> WorkerSettings:
        # At start, not at the first request: a worker pointed at http://<remote> exits naming the URL and setting.
        for url in self.proxy_url.split(","):
            if url.strip():
                self.security.check(url.strip())
        return self

    def proxy_client(self, outage: Outage) -> ProxyClient:
        """A client for this worker that retries through proxy outages as ``outage`` (shared by the worker's
        clients: one log line per outage, one budget) allows."""

        client = ProxyClient(
            self.proxy_url, self.run, self.token, timeout_s=self.http_timeout_s, outage=outage, security=self.security
        )
        client.presigned = self.presigned_adapters
        return client

    def phase_client(self) -> ProxyClient:
        """A client that tries once, briefly: for phase and note pushes, which must never hold up a start or an
        exit (a configuration error reported while the proxy is down)."""

        return ProxyClient(self.proxy_url, self.run, self.token, timeout_s=5.0, retries=0, security=self.security)

    def push_phase(self, worker_id: str, phase: str, notes: dict[str, str] | None = None) -> None:
        """Tell the proxy what a worker is doing (status, dashboard, live view); best effort, never raises."""

        try:
            with self.phase_client() as client:
                client.push_metrics(MetricsPush(worker_id=worker_id, phase=phase, notes=notes or {}))
        except errors.BucketRLError as exc:
            logging.getLogger("bucketrl").debug("phase push failed: %s", exc.message)

    def outage(self, who: str) -> Outage:

        return Outage(self.outage_budget_s, who)

    @field_validator("proxy_url")
    @classmethod
    def _url(cls, v: str) -> str:
        urls = [u.strip().rstrip("/") for u in v.split(",") if u.strip()]
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad or not urls:
            raise ValueError(f"BUCKETRL_PROXY_URL must be URLs starting with http:// or https://, got {v!r}")
        return ",".join(urls)

    def resolved_worker_id(self, role: str) -> str:
        if self.worker_id:
            return self.worker_id

        host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:60]
        return f"{role}-{host}-{os.getpid()}"


def warn_if_proxy_url_unset(command: str, settings: WorkerSettings) -> None:
    """A worker started without BUCKETRL_PROXY_URL (or --proxy-url) says which address it is trying."""

    default = WorkerSettings.model_fields["proxy_url"].default
    if "BUCKETRL_PROXY_URL" not in os.environ and settings.proxy_url == default:
        print(
            f"bucketrl {command}: BUCKETRL_PROXY_URL is unset (and no --proxy-url): trying {settings.proxy_url}",
            file=sys.stderr,
        )
