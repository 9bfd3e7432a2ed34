"""Fault injection into a real ``bucketrl up`` (issue 10): the supervisor runs in its own process exactly as the
CLI runs it (:func:`bucketrl.up.launcher.run_up`), and the test hits its services from outside, by the pids
``<dir>/services.json`` records, the way an OOM killer, a node drain or an operator would.

:class:`UpProcess` starts and watches the run; :class:`Chaos` injects faults and times each recovery (from the
end of the fault to the trainer's next step, read from its audit log); :func:`reopen` brings the run's Redis
(append-only file) and proxy back after ``up`` exited, so the final state can be checked from the outside.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.storage import open_store
from bucketrl.up.cluster import LocalCluster
from bucketrl.up.config import UpConfig
from bucketrl.wire import RunStatus
from tests.e2e.helpers import E2E_LR, adapter_manifest
from tests.support.services import free_port

_RUNNER = (
    "import sys\n"
    "from rich.console import Console\n"
    "from bucketrl.up.config import UpConfig\n"
    "from bucketrl.up.launcher import run_up\n"
    "cfg = UpConfig.model_validate_json(open(sys.argv[1]).read())\n"
    "sys.exit(run_up(cfg, console=Console(width=160), live=False))\n"
)
STEP_LINE = re.compile(r"step (\d+)/\d+ loss \S+ reward (\S+)")
# A generator's line as a call goes on under a newer version (partial rollouts: bucketrl/generator/partial_rollouts.py).
CONTINUING = re.compile(r"continuing \d+ of \d+ completion\(s\) of prompts \[([^\]]*)\] under v(\d+)")
# How soon a wait sees what it waits for (a recovery, a step): the trainer keeps stepping while the test reacts, so
# a slower poll spends more of the run's steps between faults.
POLL_S = 0.2


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


class UpProcess:
    """``bucketrl up`` with ``cfg`` (an :class:`UpConfig`) in a child process; its output goes to ``up.out``."""

    def __init__(self, tmp_path: Path, **cfg: Any) -> None:
        cfg.setdefault("lr", E2E_LR)
        cfg.setdefault("redis_fsync", "always")  # a SIGKILLed Redis loses nothing it acknowledged
        cfg.setdefault("port", free_port())
        cfg.setdefault("dir", tmp_path / "run")
        self.cfg = UpConfig(**cfg)
        self.dir = self.cfg.run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg_path = tmp_path / "up.json"
        self.cfg_path.write_text(self.cfg.model_dump_json())
        self.out = tmp_path / "up.out"
        self.proc: subprocess.Popen[bytes] | None = None
        self.proxy_url = f"http://127.0.0.1:{self.cfg.port}"
        self._viewer: ProxyClient | None = None

    def start(self) -> UpProcess:
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(self.cfg_path)], stdout=out, stderr=out)
        return self

    def stop(self) -> None:
        """Ctrl-C (it stops its services), then SIGKILL if it hangs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if self._viewer is not None:
            self._viewer.close()

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def pid(self, service: str) -> int:
        """The pid of the last start of ``service`` (0 before ``up`` started it)."""
        try:
            return int(json.loads((self.dir / "services.json").read_text()).get(service, 0))
        except (FileNotFoundError, ValueError):
            return 0

    def redis_port(self) -> int:
        """From the service log's start line (redis-server rewrites its own command line)."""
        starts = re.findall(r"start redis: .* --port (\d+)", (self.logs / "redis.log").read_text(errors="replace"))
        return int(starts[-1])

    def viewer(self) -> ProxyClient:
        if self._viewer is None:
            tokens = dict(line.split(":", 1) for line in (self.dir / "tokens").read_text().split())
            # No retries: a poll during an outage should come back at once and be tried again later.
            self._viewer = ProxyClient(self.proxy_url, self.cfg.run, tokens["viewer"], retries=0, timeout_s=5)
        return self._viewer

    def status(self) -> RunStatus | None:
        if not (self.dir / "tokens").exists():
            return None
        try:
            return self.viewer().status()
        except (errors.BucketRLError, ValueError):
            return None

    def audit(self) -> list[dict[str, Any]]:
        path = self.logs / "trainer-audit.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def ended(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


@dataclass
class Fault:
    kind: str
    step: int  # the trainer's step when it was injected
    injected: float  # monotonic
    ended: float | None = None  # when the fault was over (the signal sent, the outage lifted)
    back: Callable[[], Any] | None = None  # true once what the fault hit runs again
    min_epoch: int | None = None  # a trainer kill is recovered by a step of a newer trainer
    back_wall: float | None = None
    recovered: float | None = None  # the first trainer step completed once the fault was over and back

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None or self.ended is None else self.recovered - self.ended


@dataclass
class Chaos:
    """Injects faults into an :class:`UpProcess` and checks the invariants that can be seen while it runs."""

    up: UpProcess
    faults: list[Fault] = field(default_factory=list)
    pending: list[Fault] = field(default_factory=list)
    leased_checks: int = 0
    # Per kill_mid_continuation: the prompts the killed call was continuing, and whether the kill came before its
    # batch was submitted.
    continuations_killed: list[tuple[set[str], bool]] = field(default_factory=list)
    _store: Any = None

    def __post_init__(self) -> None:
        self._store = open_store(self.up.cfg.bucket_url or f"file://{self.up.dir / 'bucket'}")

    # -- observing -----------------------------------------------------------------------------------
    def poll(self) -> RunStatus | None:
        """A status, and invariant 1 on it: every version with a live lease has its manifest in the bucket.
        Also notes the recovery of pending faults."""
        self._note_recoveries()
        s = self.up.status()
        if s is None:
            return None
        for v in s.versions:
            if v.leases <= 0:
                continue
            try:
                present = self._store.exists(adapter_manifest_of(self.up, v.version))
            except errors.Unavailable:
                continue  # the bucket is down right now: nothing to see
            if not present:
                again = self.up.status()
                still = {x.version: x.leases for x in again.versions} if again else {}
                assert still.get(v.version, 0) == 0, f"v{v.version} is leased but its manifest is gone"
            self.leased_checks += 1
        return s

    def step(self) -> int:
        records = [r for r in self.up.audit() if r["event"] == "step"]
        return int(records[-1]["step"]) if records else 0

    def wait(self, what: str, predicate: Callable[[], Any], timeout_s: float = 300.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert not self.up.ended(), (
                f"bucketrl up exited ({self.up.proc.returncode}) while waiting for {what}:\n"
                + (  # type: ignore[union-attr]
                    self.up.output()[-4000:]
                )
            )
            value = predicate()
            if value:
                return value
            self.poll()
            time.sleep(POLL_S)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")

    def steps_after(self, t_wall: float, epoch: int | None = None) -> list[dict[str, Any]]:
        return [
            r
            for r in self.up.audit()
            if r["event"] == "step" and r["t"] > t_wall and (epoch is None or int(r["epoch"]) >= epoch)
        ]

    def until_step(self, step: int, timeout_s: float = 300.0) -> None:
        self.wait(f"trainer step {step}", lambda: self.step() >= step, timeout_s)

    # -- injecting -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def fault(
        self,
        kind: str,
        *,
        min_epoch: int | None = None,
        back: Callable[[], Any] | None = None,
        block: bool = True,
        ends_later: bool = False,
    ) -> Iterator[Fault]:
        """Record one fault: injected on entry, over on exit (or when the caller sets ``ended``: ``ends_later``);
        recovered once ``back()`` holds (a killed service runs again) and the trainer completed a step after.
        ``block``: wait for the recovery before going on (faults of the generators overlap the next ones)."""
        fault = Fault(kind, self.step(), time.monotonic(), back=back, min_epoch=min_epoch)
        yield fault
        if not ends_later:
            fault.ended = time.monotonic()
        self.faults.append(fault)
        self.pending.append(fault)
        if block:
            self.wait(f"recovery from {kind}", lambda: fault.recovered is not None)

    def _note_recoveries(self) -> None:
        if not self.pending:
            return
        steps = [r for r in self.up.audit() if r["event"] == "step"]
        for f in list(self.pending):
            if f.ended is None:
                continue
            if f.back_wall is None and (f.back is None or f.back()):
                f.back_wall = time.time()
            after = f.back_wall
            if after is not None and any(
                r["t"] > after and (f.min_epoch is None or int(r["epoch"]) >= f.min_epoch) for r in steps
            ):
                f.recovered = time.monotonic()
                self.pending.remove(f)
                print(
                    f"[chaos] {self.faults.index(f) + 1:2d}. {f.kind:<24} at step {f.step:3d}: "
                    f"recovered {f.recovery_s:5.1f}s after it ended"
                )

    def settle(self, timeout_s: float = 300.0) -> None:
        """Wait until every fault injected so far has recovered."""
        self.wait("every fault to recover", lambda: not self.pending, timeout_s)

    def live_pid(self, service: str) -> int:
        """The pid of ``service`` once it runs (the supervisor may be restarting it)."""
        return self.wait(f"{service} to run", lambda: (pid := self.up.pid(service)) and alive(pid) and pid, 120)

    def kill(self, service: str) -> None:
        """SIGKILL ``service``; it is back when ``up`` restarted it (and, for Redis and the proxy, status works)."""
        pid = self.live_pid(service)

        def back() -> bool:
            again = self.up.pid(service)
            restarted = again != pid and alive(again)
            return restarted and (service.startswith("gen-") or self.up.status() is not None)

        with self.fault(f"SIGKILL {service}", back=back, block=not service.startswith("gen-")):
            os.kill(pid, signal.SIGKILL)

    def kill_mid_continuation(self, service: str, timeout_s: float = 120.0) -> bool:
        """SIGKILL generator ``service`` the moment its log says a call goes on under a newer version. True when it
        died mid-continuation: the call's prompts were still leased to it after the kill (a batch submitted ends
        its leases), so nothing of the call reached the proxy. Its prompts come back once their leases run out."""
        import redis

        log = self.up.logs / f"{service}.log"
        self.live_pid(service)
        deadline = time.monotonic() + timeout_s
        with log.open("rb") as fh:
            fh.seek(0, os.SEEK_END)  # only a continuation that starts from now on
            seen, match = "", None
            while match is None:
                assert time.monotonic() < deadline, f"{service} continued no call within {timeout_s:.0f}s"
                chunk = fh.read()
                if not chunk:
                    time.sleep(0.005)  # tight: a continuation of the tiny model lasts a fraction of a second
                    continue
                seen = (seen + chunk.decode(errors="replace"))[-20_000:]
                match = CONTINUING.search(seen)
        pid = self.up.pid(service)

        def back() -> bool:
            again = self.up.pid(service)
            return again != pid and alive(again)

        with self.fault(f"SIGKILL {service} mid-continuation", back=back, block=False):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)  # a request it sent just before its death has landed by now
        r = redis.Redis(port=self.up.redis_port())
        try:
            owner = r.hgetall(f"brl:{self.up.cfg.run}:prompts:owner")
        finally:
            r.close()
        held = {k.decode() for k, v in owner.items() if v.decode() == service}
        continued = set(match.group(1).split(", "))
        landed = continued <= held
        self.continuations_killed.append((continued, landed))
        print(
            f"[chaos] {service} killed as it continued {sorted(continued)} under v{match.group(2)}: "
            f"{'mid-continuation' if landed else 'its prompts no longer leased to it (the call submitted?)'}"
        )
        return landed

    def kill_trainer(self) -> None:
        s = self.wait("a trainer that has registered and stepped", self._trainer_stepping, 300)
        pid = self.live_pid("trainer")
        with self.fault("SIGKILL trainer", min_epoch=s.trainer.epoch + 1):
            os.kill(pid, signal.SIGKILL)

    def _trainer_stepping(self) -> RunStatus | None:
        s = self.poll()
        if s is None:
            return None
        return s if any(int(r["epoch"]) == s.trainer.epoch for r in self.steps_after(0.0)) else None

    def freeze(self, service: str, seconds: float) -> None:
        """SIGSTOP ``service`` now and SIGCONT it ``seconds`` later (meanwhile the next faults go on)."""
        pid = self.live_pid(service)

        def thaw(fault: Fault) -> None:
            with contextlib.suppress(ProcessLookupError):  # a later fault killed it while frozen: that ended this
                os.kill(pid, signal.SIGCONT)
            fault.ended = time.monotonic()

        with self.fault(f"SIGSTOP {service} {seconds:.0f}s", block=False, ends_later=True) as fault:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(seconds, thaw, args=(fault,)).start()

    def flushall(self, checkpoint_every: int) -> int:
        """FLUSHALL while the trainer holds claimed-but-unacked groups (its last step is not a checkpoint step);
        returns that step."""
        import redis

        r = redis.Redis(port=self.up.redis_port())
        try:
            at = self.wait("a step that is not a checkpoint step", lambda: (s := self.step()) % checkpoint_every and s)
            with self.fault(f"FLUSHALL (step {at})"):
                r.flushall()  # right after the read: a step takes far longer than this
        finally:
            r.close()
        return int(at)

    def outage(self, kind: str, down: Callable[[], None], up: Callable[[], None], seconds: float) -> None:
        with self.fault(f"{kind} {seconds:.0f}s"):
            down()
            try:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    self.poll()
                    time.sleep(0.5)
            finally:
                up()

    # -- the end -------------------------------------------------------------------------------------
    def wait_for_exit(self, timeout_s: float = 600.0) -> int:
        deadline = time.monotonic() + timeout_s
        while not self.up.ended() and time.monotonic() < deadline:
            self.poll()
            with contextlib.suppress(subprocess.TimeoutExpired):  # back at once when `up` exits
                self.up.proc.wait(1.0)  # type: ignore[union-attr]
        self._note_recoveries()  # the trainer's last steps may recover the last faults
        assert self.up.ended(), "bucketrl up did not finish in time:\n" + self.up.output()[-4000:]
        return int(self.up.proc.returncode)  # type: ignore[union-attr]

    def report(self) -> str:
        by_kind: dict[str, list[float]] = {}
        for f in self.faults:
            by_kind.setdefault(re.sub(r" \(step \d+\)| \d+s$", "", f.kind), []).append(f.recovery_s or 0.0)
        lines = [
            f"{len(self.faults)} faults injected, {sum(f.recovered is not None for f in self.faults)} recovered; "
            "time to recover (fault over -> next trainer step), median / max:"
        ]
        for kind, times in by_kind.items():
            lines.append(f"  {kind:<22} x{len(times)}  {statistics.median(times):5.1f}s / {max(times):5.1f}s")
        return "\n".join(lines)


def adapter_manifest_of(up: UpProcess, version: int) -> str:
    return f"runs/{up.cfg.run}/adapters/v{version}/manifest.json"


def rewards_by_step(up: UpProcess) -> dict[int, float]:
    """step -> reward of the last execution of that step (the trainer's log; survives Redis wipes)."""
    out: dict[int, float] = {}
    for m in STEP_LINE.finditer((up.logs / "trainer.log").read_text(errors="replace")):
        out[int(m.group(1))] = float(m.group(2))
    return out


@contextlib.contextmanager
def reopen(up: UpProcess) -> Iterator[LocalCluster]:
    """The finished run's Redis (from its append-only file) and proxy, started again to read the final state."""
    cluster = LocalCluster(up.cfg)
    cluster.prepare()
    try:
        cluster.start_redis()
        cluster.start_proxy()
        yield cluster
    finally:
        cluster.stop_all()
        cluster.release()


__all__ = ["Chaos", "UpProcess", "adapter_manifest", "alive", "reopen", "rewards_by_step"]
