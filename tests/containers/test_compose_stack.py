"""docker-compose.yml started for real with podman-compose: it trains, scales, survives kills and a down/up.

The only change to the stack is tests/containers/compose.standins.yml, which swaps the two images that cannot be
pulled here (Redis, MinIO) for stand-ins built from Debian and adapts the bucket-creation job to the S3 stand-in.
Every variable comes from .env.example with each change-me value replaced, so a new variable there reaches the
test without editing it.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.containers import podman
from tests.support.services import free_port

# The first test also builds the images (about 20 min on a machine that never built them): not the suite's 600 s.
pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(3600)]

PROJECT = "bucketrl-ctest"
FILES = (podman.ROOT / "docker-compose.yml", podman.HERE / "compose.standins.yml")


@dataclass
class Stack:
    env_file: Path
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['PROXY_PORT']}"

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "podman_compose", "-p", PROJECT, "--env-file", str(self.env_file)]
        for f in FILES:
            cmd += ["-f", str(f)]
        proc = subprocess.run(
            [*cmd, *args],
            cwd=podman.ROOT,
            env={**podman.env(), **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)} exited {proc.returncode}:\n{podman.tail(proc)}")
        return proc

    def up(self, *extra: str, before_workers: Callable[[], None] | None = None) -> None:
        """``up -d`` in the stack's start order, one tier at a time.

        Podman 4.3 (Debian bookworm) cannot start a container whose ``--requires`` names an exited one-shot job
        ("not found in input list"), and podman-compose ignores ``condition: service_healthy`` before podman 4.6.
        So each tier starts with ``--no-deps`` once the one before it is done: what Docker Compose's conditions do.
        """
        self.compose("up", "-d", "--no-build", "--no-deps", "redis", "minio", "minio-init", "model-init")
        for job in ("minio-init", "model-init"):
            (name,) = self.containers(job, running_only=False)
            code = podman.podman("wait", name, timeout=300).stdout.strip()
            assert code == "0", f"{job} exited {code}:\n{self.logs(name)}"
        self.compose("up", "-d", "--no-build", "--no-deps", "proxy")
        wait_for("the proxy ready", lambda: httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200, self, 180)
        if before_workers is not None:
            before_workers()
        self.compose("up", "-d", "--no-build", "--no-deps", *extra, "trainer", "generator")

    def remove(self) -> None:
        """Every container and volume of the test project. Scaled-out replicas first: podman-compose's `down` only
        knows the services' configured scale."""
        label = f"label=com.docker.compose.project={PROJECT}"
        names = podman.podman("ps", "-a", "-q", "--filter", label).stdout.split()
        if names:
            podman.podman("rm", "-f", "-t", "5", *names, check=False, timeout=300)
        self.compose("down", "-v", "-t", "5")
        volumes = podman.podman("volume", "ls", "-q", "--filter", label).stdout.split()
        if volumes:
            podman.podman("volume", "rm", "-f", *volumes, check=False)

    def containers(self, service: str, running_only: bool = True) -> list[str]:
        args = ["ps", "--format", "{{.Names}}", "--filter", f"label=com.docker.compose.project={PROJECT}"]
        args += ["--filter", f"label=com.docker.compose.service={service}"]
        if not running_only:
            args.append("-a")
        return sorted(podman.podman(*args).stdout.split())

    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/v1/runs/{self.env['BUCKETRL_RUN']}/status", headers=self.viewer, timeout=10)
        r.raise_for_status()
        return r.json()

    @property
    def viewer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.env['VIEWER_TOKEN']}"}

    def logs(self, container: str, tail: int | None = None) -> str:
        """The container's log (every run of it: podman keeps the log across restarts), or its last lines."""
        args = ["logs", container] if tail is None else ["logs", "--tail", str(tail), container]
        proc = podman.podman(*args, check=False)
        return (proc.stdout or "") + (proc.stderr or "")

    def dump(self) -> str:
        out = []
        label = f"label=com.docker.compose.project={PROJECT}"
        names = podman.podman("ps", "-a", "--format", "{{.Names}} {{.Status}}", "--filter", label)
        out.append(names.stdout)
        for line in names.stdout.splitlines():
            name = line.split()[0]
            out.append(f"--- {name} ---\n{self.logs(name, 25)[-2500:]}")
        return "\n".join(out)


def env_from_example(port: int) -> dict[str, str]:
    """.env.example's variables with every change-me value replaced by a fresh secret."""
    env: dict[str, str] = {}
    for line in (podman.ROOT / ".env.example").read_text().splitlines():
        m = re.match(r"^([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            key, value = m.groups()
            env[key] = f"ct-{secrets.token_hex(12)}" if "change-me" in value else value
    env.update(PROXY_PORT=str(port), IMAGE_REPO=podman.IMAGE_REPO, IMAGE_TAG=podman.IMAGE_TAG, BUCKETRL_RUN="demo")
    return env


@pytest.fixture()
def stack(built_images: dict[str, float], tmp_path: Path) -> Iterator[Stack]:
    env = env_from_example(free_port())
    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    s = Stack(env_file, env)
    s.remove()  # a stack a killed session left behind
    try:
        yield s
    finally:
        print(s.dump())
        s.remove()


def wait_for(what: str, predicate: Callable[[], Any], stack: Stack, timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(2)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})\n{stack.dump()}")


def crash(container: str) -> None:
    """SIGKILL the container's process from the host, as the OOM killer would. (`podman kill`, like `docker
    kill`, counts as a manual stop, after which no restart policy applies.)"""
    pid = int(podman.podman("inspect", container, "--format", "{{.State.Pid}}").stdout.strip())
    assert pid > 0, f"{container} is not running"
    os.kill(pid, signal.SIGKILL)


def step(stack: Stack) -> int:
    return int(stack.status()["trainer"]["step"])


def generator_ids(status: dict[str, Any]) -> set[str]:
    return {w["worker_id"] for w in status["workers"] if w["role"] == "generator" and w["last_seen_s"] < 30}


def test_compose_stack_trains_scales_survives_kills_and_resumes_after_down_up(stack: Stack) -> None:
    stack.up()
    first = wait_for("5 training steps", lambda: step(stack) >= 5 and step(stack), stack, timeout_s=420)
    proxy = stack.containers("proxy")[0]
    assert podman.podman("healthcheck", "run", proxy, check=False).returncode == 0, "compose's proxy health check"
    assert stack.containers("minio-init", running_only=False), "the bucket job never ran"

    # Scale out: two more generators join the same run.
    stack.compose("up", "-d", "--no-build", "--no-deps", "--no-recreate", "--scale", "generator=3", "generator")
    assert len(stack.containers("generator")) == 3
    wait_for("3 generators reporting", lambda: len(generator_ids(stack.status())) >= 3, stack, timeout_s=240)

    # Kill -9 one generator and the trainer: the run goes on, the trainer resumes from its checkpoint.
    ckpt = wait_for("a checkpoint (step 10)", lambda: step(stack) >= 11 and step(stack), stack, timeout_s=420)
    epoch = stack.status()["trainer"]["epoch"]
    trainer = stack.containers("trainer")[0]
    crash(stack.containers("generator")[0])
    crash(trainer)
    wait_for("the trainer restarted", lambda: stack.status()["trainer"]["epoch"] > epoch, stack, timeout_s=240)
    resumed = [int(m) for m in re.findall(r"resumed from checkpoint step (\d+)", stack.logs(trainer))]
    assert resumed and resumed[-1] >= 10, f"no resume from the step-10 checkpoint in the trainer log: {resumed}"
    wait_for("training past the kill", lambda: step(stack) > ckpt, stack, timeout_s=300)
    assert stack.status()["queue"]["lost_total"] == 0, "accepted groups vanished after the kills"
    # The killed generator is restarted by its on-failure policy: three generators again.
    wait_for("3 generators again", lambda: len(stack.containers("generator")) == 3, stack, timeout_s=120)

    # down (volumes kept) then up: the run resumes from Redis's and the bucket's volumes, not from scratch.
    before = step(stack)
    # podman-compose's `down` stops only the configured scale (generator_1): remove the replicas it added first.
    extra = stack.containers("generator")[1:]
    podman.podman("rm", "-f", "-t", "10", *extra)
    stack.compose("down", "-t", "20")
    assert not stack.containers("trainer") and not stack.containers("generator") and not stack.containers("redis")
    kept: dict[str, int] = {}

    def state_survived() -> None:
        # Before any worker runs again: Redis's volume kept the run's step, the bucket's volume its checkpoint.
        kept["step"] = step(stack)
        trainer_auth = {"Authorization": f"Bearer {stack.env['TRAINER_TOKEN']}"}
        r = httpx.get(f"{stack.url}/v1/runs/demo/checkpoints/latest", headers=trainer_auth, timeout=10)
        assert r.status_code == 200, r.text
        kept["checkpoint"] = int(r.json()["step"])
        # Nothing lost across two kills and a down/up: with no worker running the queue's accounting is exact
        # (what the killed trainer had claimed but not acked is pending, handed out again to its next epoch).
        q = stack.status()["queue"]
        assert q["lost_total"] == 0, q
        assert q["accepted_total"] == q["acked_total"] + q["dropped_stale_total"] + q["groups"] + q["pending"], q
        kept["accepted"] = int(q["accepted_total"])

    stack.up(before_workers=state_survived)
    assert kept["step"] >= 10 and kept["checkpoint"] >= 10 and kept["accepted"] > 0, kept
    wait_for("training after down/up", lambda: step(stack) > before, stack, timeout_s=420)
    info = httpx.get(f"{stack.url}/v1/runs/demo", headers=stack.viewer, timeout=10).json()
    assert info["state"]["latest_version"] >= before, info["state"]
    assert stack.status()["queue"]["lost_total"] == 0
    print(f"\ncompose stack: {first} steps, killed at {ckpt}, resumed from {resumed[-1]}; after down/up {kept}")
