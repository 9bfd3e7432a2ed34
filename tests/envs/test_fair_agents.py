"""Fair admission end to end (issue 36): two agents of different speeds (plain ``openai`` clients in their own
processes, each sending its name) share one run with the run's own environment (toy:tools), through one URL (the
agent router, its own process) in front of two generators. Each generator divides its groups max-min fair between
the sources that ask (bucketrl/generator/admission.py): the slow agent, which wants one group at a time, gets it at
the next free slot; the fast one, which wants more than its part, gets its part; the environment is not starved
by the agents either. One run serves both tests (real processes for about a minute)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bucketrl.generator.admission import ENV, agent_source
from bucketrl.generator.worker import GeneratorWorker
from bucketrl.rollout.episodes import GroupRun
from bucketrl.up.processes import bucketrl_command
from bucketrl.wire import EpisodeSpec
from tests.envs.test_slow_agents import SteppingTrainer
from tests.envs.test_worker_episodes import TOOLS_RUN
from tests.generator.worker_support import create_run, running_worker, wait_until, worker_settings
from tests.proxy.harness import running
from tests.support.services import RedisServer

pytestmark = pytest.mark.slow  # real processes paced by their own sleeps: make test, not make test-fast

TOKEN = "agents-token"
GROUPS_PER_STEP, MAX_STALENESS, MIN_STEP_S = 2, 24, 0.5
CAPACITY = 3  # groups each generator holds open or not yet trained (BUCKETRL_MAX_OPEN_EPISODES = 3 x group_size)
SLOW_PAUSE_S = 3.0
FAST_PROCESSES = 4  # two at a time fill one of the fast agent's groups: it wants two groups, more than its part
GIVE_UP_S = 30.0  # an agent refused this long for one episode is starved (it exits 3)
GENERATORS = ("gen-a", "gen-b")
SLOW, FAST = agent_source("slow"), agent_source("fast")
SOURCES = (ENV, SLOW, FAST)


@dataclass
class Outcome:
    records: dict[str, list[dict[str, Any]]]  # agent name -> its episodes' lines
    trained: list[tuple[int, GroupRun]]
    metrics: dict[str, dict[str, float]]  # generator -> its metrics at the end
    env_before: dict[str, float]  # generator -> its environment's groups admitted when the agents began
    samples: list[tuple[float, dict[str, Counter[str]]]] = field(default_factory=list)  # (time, generator -> held)
    dropped_stale: int = 0


def _endpoint(path: Path) -> dict[str, str]:
    return wait_until(lambda: path.exists() and json.loads(path.read_text()).get("openai"), 90, str(path))


def _agent(url: str, name: str, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.envs.slow_agent", "--agent", name, "--give-up", str(GIVE_UP_S), *args]
    return subprocess.Popen([*cmd, "--", url, TOKEN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sample(
    workers: dict[str, GeneratorWorker], out: list[tuple[float, dict[str, Counter[str]]]], stop: threading.Event
) -> None:
    """Each generator's groups open or handed over and not yet trained, by source, five times a second (the
    test's view of the shares held, read under the lock the generator decides under)."""
    while not stop.wait(0.2):
        now, held = time.time(), {}
        for name, w in workers.items():
            d = w.episodes
            assert d is not None
            with d._admission_lock:
                held[name] = Counter([g.source for g in d.svc.book.groups()] + d.admission.pending_sources())
        out.append((now, held))


@pytest.fixture(scope="module")
def outcome(tiny_model_dir: Path, adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    tmp = tmp_path_factory.mktemp("fair")
    redis = RedisServer(tmp / "redis").start()
    with ExitStack() as stack:
        stack.callback(redis.kill)
        proxy = stack.enter_context(running(redis.url, f"file://{tmp / 'bucket'}"))
        run = {
            **TOOLS_RUN,
            "group_size": 2,
            "groups_per_step": GROUPS_PER_STEP,
            "max_staleness": MAX_STALENESS,
            "episode": EpisodeSpec(max_turns=3, episode_timeout_s=60.0, max_episode_tokens=256),
        }
        trainer, _ = create_run(proxy, "fair", tiny_model_dir, adapter_dir, **run)
        files = {name: tmp / f"{name}.json" for name in ("gen-a", "gen-b", "router")}
        workers: dict[str, GeneratorWorker] = {}
        for name in GENERATORS:  # one after the other (tests/envs/test_agent_router.py says why)
            settings = worker_settings(
                proxy,
                "fair",
                name,
                openai_port=0,
                openai_token=TOKEN,
                endpoint_file=str(files[name]),
                max_open_episodes=CAPACITY * 2,
            )
            workers[name] = stack.enter_context(running_worker(settings))
            _endpoint(files[name])
        stepper = stack.enter_context(SteppingTrainer(trainer, adapter_dir, GROUPS_PER_STEP, MAX_STALENESS, MIN_STEP_S))
        argv = bucketrl_command("agent-router", "--port", "0", "--endpoint-file", str(files["router"]), "--run", "fair")
        argv += [a for f in GENERATORS for a in ("--backend", _endpoint(files[f])["base_url"].removesuffix("/v1"))]
        env = {**os.environ, "BUCKETRL_OPENAI_TOKEN": TOKEN}
        router = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stack.callback(router.communicate, timeout=20)
        stack.callback(router.terminate)
        url = _endpoint(files["router"])["base_url"].removesuffix("/v1")
        wait_until(lambda: stepper.version >= 3, 90, "the environment's groups to step the trainer")
        env_before = {n: w.metrics.snapshot().get("admission/env/admitted_total", 0.0) for n, w in workers.items()}
        samples: list[tuple[float, dict[str, Counter[str]]]] = []
        stop_sampling = threading.Event()
        sampler = threading.Thread(target=_sample, args=(workers, samples, stop_sampling), daemon=True)
        sampler.start()
        stop = tmp / "stop"
        fast = [
            _agent(url, "fast", "--episodes", "200", "--max-wait", "1", "--stop-file", str(stop))
            for _ in range(FAST_PROCESSES)
        ]
        time.sleep(2.0)  # the fast agent asks first: the slow one comes to a generator already busy
        slow = _agent(url, "slow", "--episodes", "4", "--pause", str(SLOW_PAUSE_S), "--max-wait", "5")
        slow_out, slow_err = slow.communicate(timeout=180)
        stop.touch()  # the fast agent ran all along; each process stops once its group is complete
        fast_outs = [p.communicate(timeout=120) for p in fast]
        stop_sampling.set()
        sampler.join(5)
        assert slow.returncode == 0, (slow_out[-2000:], slow_err[-2000:])
        assert all(p.returncode == 0 for p in fast), [
            (p.returncode, o[-1000:], e[-1000:]) for p, (o, e) in zip(fast, fast_outs, strict=True)
        ]
        records = {
            "slow": [json.loads(line) for line in slow_out.splitlines()],
            "fast": [json.loads(line) for o, _ in fast_outs for line in o.splitlines()],
        }
        prompts = {r["prompt_id"] for rs in records.values() for r in rs}
        with contextlib.suppress(TimeoutError):  # the tests say which were not trained
            wait_until(lambda: {g.prompt_id for _, g in list(stepper.trained)} >= prompts, 60, "the agents' groups")
        q = trainer.status().queue
        yield Outcome(
            records,
            list(stepper.trained),
            {n: w.metrics.snapshot() for n, w in workers.items()},
            env_before,
            samples,
            q.rejected_stale_total + q.dropped_stale_total,
        )


def _held(outcome: Outcome, gens: tuple[str, ...] = GENERATORS) -> dict[str, float]:
    """Each source's share of the groups ``gens`` held (open or not yet trained), averaged over the slow agent's
    activity (its first ask to its last finish), when all three sources asked."""
    slow = outcome.records["slow"]
    t0, t1 = min(r["asked"] for r in slow), max(r["finished"] for r in slow)
    total: Counter[str] = Counter()
    for t, held in outcome.samples:
        if t0 <= t <= t1:
            for g in gens:
                total.update(held[g])
    n = sum(total.values())
    return {s: total[s] / n for s in SOURCES}


def test_agents_of_different_speeds_each_get_their_groups_trained_and_a_fair_share(outcome: Outcome) -> None:
    slow, fast = outcome.records["slow"], outcome.records["fast"]
    # Nothing dropped as stale; every episode of both agents finished and was trained once with its reward.
    assert outcome.dropped_stale == 0
    assert len(slow) == 4 and all(r["finish_status"] == 200 for r in slow + fast)
    sent = {(r["prompt_id"], r["index_in_group"]): r["reward"] for r in slow + fast}
    trained = {
        (g.prompt_id, i): g.completions[idx[0]].reward
        for _, g in outcome.trained
        if g.prompt_id in {p for p, _ in sent}
        for i, idx in enumerate(g.episodes())
    }
    assert trained == sent
    # Max-min fair: the slow agent wants one group at a time, less than an equal part of a generator's three: it got
    # it whenever it asked, at once (first-come-first-served it lost the race to the environment and the fast
    # agent: refused 5 times in 4 episodes). The fast agent wants more than its part (its
    # processes fill a group two at a time): it was held back, yet not starved.
    assert sum(r["refusals"] for r in slow) <= 1, [(r["refusals"], r["waited_s"]) for r in slow]
    assert sum(r["refusals"] for r in fast) >= 1 and len({r["prompt_id"] for r in fast}) >= 4
    # Every source held groups while all three asked (open or handed over and not yet trained, both generators).
    held = _held(outcome)
    assert min(held.values()) > 0, held


def test_across_generators_behind_one_url_no_source_is_starved(outcome: Outcome) -> None:
    slow, fast = outcome.records["slow"], outcome.records["fast"]
    # The fast agent's groups were admitted on both generators.
    for gen, m in outcome.metrics.items():
        assert m["admission/agent:fast/admitted_total"] >= 1, gen
    # Each of the slow agent's groups is its own two episodes on one generator (the router sends an agent to the
    # generator with a free slot of that agent's group; a generator fills a group with one agent's episodes only).
    by_prompt = Counter(r["prompt_id"] for r in slow)
    assert sorted(by_prompt.values()) == [2, 2] and not {r["prompt_id"] for r in fast} & set(by_prompt)
    assert sum(m.get("admission/agent:slow/admitted_total", 0) for m in outcome.metrics.values()) == 2
    # The reverse: the agents did not starve the environment. On each generator it kept a fair part of the groups
    # held while both agents asked (measured 0.55 and 0.45) and went on admitting groups.
    for gen, m in outcome.metrics.items():
        assert _held(outcome, (gen,))[ENV] >= 0.25, gen
        assert m["admission/env/admitted_total"] - outcome.env_before[gen] >= 4, gen
    # ... and fed the trainer between the slow agent's groups.
    order = [g.prompt_id for _, g in outcome.trained]
    first, last = (order.index(p) for p in by_prompt)
    first, last = min(first, last), max(first, last)
    assert sum(p not in by_prompt and p not in {r["prompt_id"] for r in fast} for p in order[first:last]) >= 2
