"""docker-compose.yml started for real with podman-compose: it trains, scales, survives kills and a down/up.

The only change to the stack is tests/containers/compose.standins.yml, which swaps the two images that cannot be
pulled here (Redis, MinIO) for stand-ins built from Debian and adapts the bucket-creation job to the S3 stand-in.
Every variable comes from .env.example with each change-me value replaced, so a new variable there reaches the
test without editing it.
"""

from __future__ import annotations

import re
import secrets
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

pytestmark = [pytest.mark.slow, pytest.mark.containers]

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

    def logs(self, container: str, tail: int = 400) -> str:
        return podman.tail(podman.podman("logs", "--tail", str(tail), container, check=False), 200_000)

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
    s.compose("down", "-v", "-t", "5")  # a stack a killed session left behind
    try:
        yield s
    except BaseException:
        raise
    finally:
        print(s.dump())
        s.compose("down", "-v", "-t", "5")


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


def step(stack: Stack) -> int:
    return int(stack.status()["trainer"]["step"])


def generator_ids(status: dict[str, Any]) -> set[str]:
    return {w["worker_id"] for w in status["workers"] if w["role"] == "generator" and w["last_seen_s"] < 30}


def test_compose_stack_trains_scales_survives_kills_and_resumes_after_down_up(stack: Stack) -> None:
    stack.compose("up", "-d", "--no-build")
    first = wait_for("5 training steps", lambda: step(stack) >= 5 and step(stack), stack, timeout_s=420)
    proxy = stack.containers("proxy")[0]
    assert podman.podman("healthcheck", "run", proxy, check=False).returncode == 0, "compose's proxy health check"
    assert stack.containers("minio-init", running_only=False), "the bucket job never ran"

    # Scale out: two more generators join the same run.
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "generator=3")
    assert len(stack.containers("generator")) == 3
    wait_for("3 generators reporting", lambda: len(generator_ids(stack.status())) >= 3, stack, timeout_s=240)

    # Kill -9 one generator and the trainer: the run goes on, the trainer resumes from its checkpoint.
    ckpt = wait_for("a checkpoint (step 10)", lambda: step(stack) >= 11 and step(stack), stack, timeout_s=420)
    epoch = stack.status()["trainer"]["epoch"]
    trainer = stack.containers("trainer")[0]
    podman.podman("kill", stack.containers("generator")[0])
    podman.podman("kill", trainer)
    wait_for("the trainer restarted", lambda: stack.status()["trainer"]["epoch"] > epoch, stack, timeout_s=240)
    resumed = [int(m) for m in re.findall(r"resumed from checkpoint step (\d+)", stack.logs(trainer))]
    assert resumed and resumed[-1] >= 10, f"no resume from the step-10 checkpoint in the trainer log: {resumed}"
    wait_for("training past the kill", lambda: step(stack) > ckpt, stack, timeout_s=300)
    # The killed generator is restarted by its on-failure policy: three generators again.
    wait_for("3 generators again", lambda: len(stack.containers("generator")) == 3, stack, timeout_s=120)

    # down (volumes kept) then up: the run resumes from Redis's and the bucket's volumes, not from scratch.
    before = step(stack)
    stack.compose("down", "-t", "20")
    stack.compose("up", "-d", "--no-build")
    trainer = stack.containers("trainer")[0]
    wait_for("training after down/up", lambda: step(stack) > before, stack, timeout_s=420)
    resumed = [int(m) for m in re.findall(r"resumed from checkpoint step (\d+)", stack.logs(trainer))]
    assert resumed and resumed[-1] >= 10, f"after down/up the trainer did not resume from a checkpoint: {resumed}"
    info = httpx.get(f"{stack.url}/v1/runs/demo", headers=stack.viewer, timeout=10).json()
    assert info["state"]["latest_version"] >= before, info["state"]
    print(f"\ncompose stack: first {first} steps, checkpoint at {ckpt}, resumed from {resumed[-1]}")
