"""The real backends of a simulated deployment (:mod:`bucketrl.sim.cluster` runs scenarios on them):
``redis-server`` (AOF on, as in production), ``bucketrl proxy --workers W`` and a moto S3 server behind
:mod:`bucketrl.sim.s3front`; and the CPU time of their processes, from ``/proc``."""

from __future__ import annotations

import contextlib
import os
import ssl
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from bucketrl.up.ports import free_port
from bucketrl.up.processes import Service, port_open, redis_server_binary, wait_until

if TYPE_CHECKING:
    from bucketrl.sim.pki import Pki

# 16+ characters: the proxy refuses shorter tokens at start.
TOKENS = {
    "admin": "sim-admin-0123456789abcdef",
    "trainer": "sim-trainer-0123456789abcdef",
    "generator": "sim-gen-0123456789abcdef",
    "viewer": "sim-view-0123456789abcdef",
    "relay": "sim-relay-0123456789abcdef",  # a regional relay's staging token (bench/wan.py --staging on)
}
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def cpu_seconds(pid: int, children: bool = False) -> float:
    """user+system CPU time of a process (and, with ``children``, of its live descendants)."""
    total = 0.0
    for p in [pid, *(child_pids(pid) if children else [])]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                out += [int(child), *child_pids(int(child))]
    return out


class SimBackends:
    """Redis, moto behind the slow S3 front, and the proxy: started once, shared by the scenarios (one run
    each). Every process is ended by its own pid."""

    def __init__(
        self,
        workdir: Path,
        *,
        proxy_workers: int = 1,
        s3_latency_ms: float = 20.0,
        s3_jitter_ms: float = 10.0,
        tls: Pki | None = None,
        proxy_log_level: str = "warning",
    ) -> None:
        self.dir = workdir
        self.proxy_log_level = proxy_log_level  # "info": its per-publish timings (bench/publish_path.py)
        self.tls = tls  # the proxy serves HTTPS with its certificate; workers verify it with its CA
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proxy_workers = proxy_workers
        self.s3_latency_ms, self.s3_jitter_ms = s3_latency_ms, s3_jitter_ms
        self.services: list[Service] = []
        self.redis_port = free_port()
        self.moto_port = free_port()
        self.front_port = free_port()
        self.proxy_port = free_port()
        self.bucket = f"sim-{os.getpid()}-{int(time.time() * 1000) % 10**8}"

    @property
    def proxy_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.proxy_port}"

    @property
    def client_env(self) -> dict[str, str]:
        """What a worker needs to trust the proxy (``BUCKETRL_CA_FILE``) when it serves HTTPS."""
        return {"BUCKETRL_CA_FILE": str(self.tls.ca)} if self.tls else {}

    def start_service(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Service:
        svc = Service(name, argv, self.dir / "logs" / f"{name}.log", env=env or {}).start()
        self.services.append(svc)
        return svc

    def _wait_port(self, port: int, svc: Service, what: str) -> None:
        wait_until(lambda: port_open(port), 60, what, svc)

    def __enter__(self) -> SimBackends:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        py = sys.executable
        (self.dir / "redis").mkdir(exist_ok=True)
        self.redis = self.start_service(
            "redis",
            [
                redis_server_binary(),
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir / "redis"),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--protected-mode",
                "no",
            ],
        )
        self.moto = self.start_service("moto", [py, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)])
        self.front = self.start_service(
            "s3front",
            [
                py,
                "-m",
                "bucketrl.sim.s3front",
                "--upstream",
                f"http://127.0.0.1:{self.moto_port}",
                "--port",
                str(self.front_port),
                "--latency-ms",
                str(self.s3_latency_ms),
                "--jitter-ms",
                str(self.s3_jitter_ms),
            ],
        )
        self._wait_port(self.redis_port, self.redis, "redis")
        self._wait_port(self.moto_port, self.moto, "moto")
        self._wait_port(self.front_port, self.front, "the S3 front")
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto_port}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        s3.create_bucket(Bucket=self.bucket)
        env = self._proxy_env()
        self.proxy = self.start_service(
            "proxy",
            [
                py,
                "-m",
                "bucketrl.cli",
                "proxy",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.proxy_port),
                "--log-level",
                self.proxy_log_level,
                "--workers",
                str(self.proxy_workers),
            ],
            env,
        )
        self._wait_port(self.proxy_port, self.proxy, "the proxy")
        wait_until(self._ready, 60, "proxy /readyz", self.proxy)

    def _proxy_env(self) -> dict[str, str]:
        env = {
            **AWS_ENV,
            "BUCKETRL_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "BUCKETRL_BUCKET_URL": f"s3://{self.bucket}/bucketrl",
            "BUCKETRL_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.front_port}",
            "BUCKETRL_TOKENS": ",".join(f"{r}:{t}" for r, t in TOKENS.items()),
        }
        if self.tls:  # HTTPS with the given certificate (bench/wan.py --tls)
            env.update({"BUCKETRL_TLS_CERT_FILE": str(self.tls.cert), "BUCKETRL_TLS_KEY_FILE": str(self.tls.key)})
        return env

    def _ready(self) -> bool:
        try:
            verify = ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else True
            return httpx.get(f"{self.proxy_url}/readyz", timeout=2.0, verify=verify).status_code == 200
        except httpx.HTTPError:
            return False

    def proxy_cpu_s(self) -> float:
        return cpu_seconds(self.proxy.pid or 0, children=True)

    def s3_counts(self) -> dict[str, int]:
        return httpx.get(f"http://127.0.0.1:{self.front_port}/_front/stats", timeout=10).json()

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop(timeout_s=20)
