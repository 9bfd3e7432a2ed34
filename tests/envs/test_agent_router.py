"""One URL for agents in front of two generators (``bucketrl agent-router``, its own process, real HTTP): an agent
(a plain ``openai`` client in another process) opens episodes through it; they land on both generators, a full
generator's 429 admission answer is retried on the other, each episode's calls (streamed ones included) reach the
generator that holds it, and a call for an episode nobody holds gets the generator's 404."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from bucketrl.generator.worker import GeneratorWorker
from bucketrl.router.app import Refused, Router
from bucketrl.up.processes import bucketrl_command
from bucketrl.wire import EnvSpec
from tests.envs.test_worker_episodes import TOOLS_RUN
from tests.generator.worker_support import create_run, running_worker, wait_until, worker_settings
from tests.proxy.harness import ProxyHarness

TOKEN = "agents-token"
EPISODES = 6  # gen-a holds at most 2 open, gen-b 4: one of gen-b's after gen-a's 429, then both are full


def _endpoint(path: Path) -> dict[str, str]:
    return wait_until(lambda: path.exists() and json.loads(path.read_text()).get("openai"), 90, str(path))


@pytest.mark.slow  # real processes for seconds: make test, not make test-fast
def test_one_url_spreads_episodes_over_generators_and_keeps_each_on_its_own(
    proxy: ProxyHarness, tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    run = {**TOOLS_RUN, "group_size": 2, "groups_per_step": 1, "max_staleness": 50, "env": EnvSpec(name="external")}
    create_run(proxy, "routed", tiny_model_dir, adapter_dir, **run)
    files = {name: tmp_path / f"{name}.json" for name in ("gen-a", "gen-b", "router")}
    limits = {"gen-a": 2, "gen-b": 4}  # open episodes each admits: groups of 2
    with ExitStack() as stack:
        workers: dict[str, GeneratorWorker] = {}
        backends: dict[str, str] = {}  # endpoint URL -> generator
        for name, limit in limits.items():
            # One after the other: two workers starting at once in one process (a test's setup, never a
            # deployment's) have been seen to stall after loading the model.
            settings = worker_settings(
                proxy,
                "routed",
                name,
                openai_port=0,
                openai_token=TOKEN,
                endpoint_file=str(files[name]),
                max_open_episodes=limit,
            )
            workers[name] = stack.enter_context(running_worker(settings))
            backends[_endpoint(files[name])["base_url"].removesuffix("/v1")] = name
        argv = bucketrl_command(
            "agent-router", "--port", "0", "--endpoint-file", str(files["router"]), "--run", "routed"
        )
        argv += [a for b in backends for a in ("--backend", b)]
        env = {**os.environ, "BUCKETRL_OPENAI_TOKEN": TOKEN}
        router = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            info = _endpoint(files["router"])
            url = info["base_url"].removesuffix("/v1")
            assert info["token"] == TOKEN and set(info["generators"]) == set(backends)
            agent = subprocess.run(
                [sys.executable, "-m", "tests.envs.router_agent", url, TOKEN, str(EPISODES)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert agent.returncode == 0, agent.stderr[-3000:]
            health = httpx.get(f"{url}/healthz", timeout=5).json()
            bad_token = httpx.post(f"{url}/v1/episodes", headers={"Authorization": "Bearer wrong"}, timeout=10)
        finally:
            router.terminate()
            log = router.communicate(timeout=20)[0]
        metrics = {name: w.metrics.snapshot() for name, w in workers.items()}
    first, *records, last = [json.loads(line) for line in agent.stdout.splitlines()]
    # Both full: the agent gets a generator's 429 admission answer, with its Retry-After (the smaller of the two).
    refused = first["refused"]
    assert refused["status"] == 429 and refused["body"]["error"]["code"] == "admission", refused
    assert refused["retry_after"] is not None and float(refused["retry_after"]) >= 0
    assert metrics["gen-b"]["episode/admission_refused_total"] >= 1
    assert len(records) == EPISODES, log[-2000:]
    # Spread over both generators: gen-a took what its admission control allows, refused one, gen-b the rest.
    opened = {backends[b]: n for b, n in health["episodes_opened"].items()}
    assert opened == {"gen-a": 2, "gen-b": 4}
    assert metrics["gen-a"]["episode/admission_refused_total"] >= 1
    # A group fills before the next starts (slots_left): 3 whole groups of 2, not 6 groups of one episode each.
    assert sorted(Counter(r["episode"]["prompt_id"] for r in records).values()) == [2, 2, 2]
    # Every call reached the generator that holds its episode: each closed its own episodes, two turns each, none
    # failed (a call of another generator's episode would be a 404 there), and the router never had to look.
    for name, n in opened.items():
        m = metrics[name]
        assert (m["episode/episodes_total"], m["episode/turns_total"], m["episode/failed_total"]) == (n, 2 * n, 0)
    # Streaming passed through: server-sent chunks, the role first and a finish reason, then the plain turn.
    for r in records:
        assert r["chunks"] >= 2 and r["finish_reasons"][0] in ("stop", "length", "tool_calls")
        assert r["finished"]["episode_id"] == r["episode"]["episode_id"] and r["finished"]["turns"] == 2
    assert health["looked_up"] == 1  # only the unknown episode was asked of every generator
    assert last["unknown"]["status"] == 404 and last["unknown"]["body"]["code"] == "model_not_found"
    assert bad_token.status_code == 401  # the generators check the token the router forwards


def test_generators_named_by_dns_are_every_address_of_the_name() -> None:
    """``--backend-dns generator:8100``: each address of the name is a generator (Compose's replicas, the pods
    of a headless Service), re-resolved as they come and go; a name that does not resolve adds none."""
    router = Router(["http://10.0.0.9:8100"], dns=["localhost:8100", "no-such-host.invalid:8100"])
    asyncio.run(router.resolve())
    assert router.backends[0] == "http://10.0.0.9:8100" and "http://127.0.0.1:8100" in router.backends
    assert len(router.backends) in (2, 3)  # localhost may resolve to ::1 too
    asyncio.run(router.aclose())


def test_when_every_generator_refuses_the_agent_gets_the_soonest_retry() -> None:
    """A 429 over a 503, the smallest Retry-After of the 429s; none answered at all: the router's own 503."""
    busy = [Refused(429, b'{"n": 1}', 12.0), Refused(503, b'{"n": 2}', 1.0), Refused(429, b'{"n": 3}', 3.0)]
    got = Router._all_refused(busy)
    assert (got.status_code, got.headers["retry-after"], got.body) == (429, "3", b'{"n": 3}')
    got = Router._all_refused([Refused(503, b"", None), Refused(503, b'{"n": 2}', 5.0)])
    assert (got.status_code, got.headers["retry-after"], got.body) == (503, "5", b'{"n": 2}')
    got = Router._all_refused([Refused(503, b"", None)])
    assert got.status_code == 503 and json.loads(got.body)["error"]["code"] == "unavailable"


def test_a_mistyped_backend_is_one_line_exit_2_before_anything_listens() -> None:
    for args, says in (
        (["--backend", "gen-0:8100"], "--backend 'gen-0:8100': a generator endpoint's URL, e.g. http://gen-0:8100"),
        (["--backend-dns", "generator"], "--backend-dns 'generator': HOST:PORT, e.g. generator:8100"),
        ([], "the agent router needs generator endpoints: --backend URL or --backend-dns HOST:PORT"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "bucketrl.cli", "agent-router", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2, out
        assert out.stderr.strip() == f"bucketrl agent-router: {says}" and not out.stdout, out
