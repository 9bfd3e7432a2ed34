"""The generator pool over real HTTP (uvicorn + real Redis + bucket): weighted fair share over generated tokens,
budgets and pause skip a run (429, never a failure), a removed run frees its share at once, one run's publishes
and removal leave another's accounting alone, and bad input changes nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from typer.testing import CliRunner

from bucketrl import errors
from bucketrl.cli import app
from bucketrl.client import ProxyClient
from bucketrl.proxy import rebuild
from bucketrl.proxy.state import pool as pool_state
from bucketrl.wire import EvalResult, EvalSample, PromptLeaseItem, RolloutBatch, RunSpec
from bucketrl.wire.pool import PoolLease, PoolLeaseRequest
from tests.proxy.harness import TOKENS, TOKENS_ENV, ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer

# Roomy admission control: the pick, not the pipeline limit, decides who gets each lease.
ROOMY = {
    "groups_per_step": 64,
    "max_staleness": 4,
    "queue_capacity_groups": 512,
    "dataset": {"uri": "toy:d", "size": 4096},
}


class Run:
    """A run with v1 published and a generator client; its completions have ``length`` tokens each."""

    def __init__(self, h: ProxyHarness, name: str, length: int, **spec_kw: Any) -> None:
        self.name, self.length = name, length
        self.spec: RunSpec = make_spec(**{**ROOMY, **spec_kw})
        self.t = h.client(name, "trainer")
        self.t.put_run(self.spec)
        self.t.register_trainer("trainer-" + name)
        self.t.publish_adapter(1, adapter_tar(1))
        self.g = h.client(name, "generator")
        self.lease_id = self.g.lease_version("gen").lease_id
        self.keys = 0

    def submit(self, items: list[PromptLeaseItem]) -> None:
        comp = {
            "token_ids": [5] * self.length,
            "logprobs": [-0.5] * self.length,
            "reward": 1.0,
            "finish_reason": "stop",
        }
        groups = [
            {"prompt_id": p.prompt_id, "prompt_index": p.index, "prompt_token_ids": [1, 2], "completions": [comp] * 2}
            for p in items
        ]
        batch = RolloutBatch.model_validate(
            {"worker_id": "gen", "lease_id": self.lease_id, "version": 1, "groups": groups}
        )
        self.keys += 1
        assert self.g.submit_rollouts(batch, f"{self.name}-{self.keys}").accepted_groups == len(items)


def serve(pool: ProxyClient, runs: dict[str, Run], leases: int, **kw: Any) -> dict[str, int]:
    """A generator's loop: lease from the pool, submit the groups to the run it names. Leases per run."""
    got = dict.fromkeys(runs, 0)
    for _ in range(leases):
        lease = pool.pool_lease(PoolLeaseRequest(worker_id="gen", n=1, **kw))
        runs[lease.run].submit(lease.prompts)
        got[lease.run] += 1
    return got


def tokens(pool: ProxyClient) -> dict[str, int]:
    return {s.run: s.tokens_generated for s in pool.pool_status().runs}


def test_shares_two_to_one_get_tokens_two_to_one(proxy_file: ProxyHarness) -> None:
    # b's completions are 3x longer: fair share counts tokens, so b gets 1 lease for a's 6, not 1 for 2.
    runs = {"a": Run(proxy_file, "a", 2, share=2), "b": Run(proxy_file, "b", 6, share=1)}
    pool = proxy_file.client("a", "generator")
    got = serve(pool, runs, 70)
    tok = tokens(pool)
    assert 1.8 <= tok["a"] / tok["b"] <= 2.2, (tok, got)
    assert got["a"] >= 5 * got["b"], got
    st = {s.run: s for s in pool.pool_status().runs}
    assert (st["a"].share, st["a"].groups_accepted, st["a"].tokens_generated) == (2.0, got["a"], got["a"] * 2 * 2)
    assert runs["a"].t.status().pool.tokens_generated == tok["a"]  # type: ignore[union-attr]
    # All of it within the last minute: the recent share is the share so far.
    ps = pool.pool_status()
    assert {s.run: s.tokens_recent for s in ps.runs} == tok and ps.recent_fraction == ps.token_fraction
    metrics = httpx.get(f"{proxy_file.url}/metrics", headers={"Authorization": f"Bearer {TOKENS['viewer']}"}).text
    assert f'bucketrl_tokens_generated_total{{run="a"}} {float(tok["a"])}' in metrics
    assert 'bucketrl_pool_share{run="a"} 2.0' in metrics
    # `bucketrl status --json` lists every run with its share and what it got (the proxy is in this process).
    args = ["status", "--proxy", proxy_file.url, "--run", "a", "--token", TOKENS["viewer"], "--json"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    listed = {r["run"]: r for r in json.loads(out.output)["runs"]}
    assert json.loads(out.output)["recent_fraction"] == pytest.approx({"a": 2 / 3, "b": 1 / 3}, abs=0.04)
    assert {run: (r["share"], r["tokens_generated"], r["groups_accepted"]) for run, r in listed.items()} == {
        "a": (2.0, tok["a"], got["a"]),
        "b": (1.0, tok["b"], got["b"]),
    }


def test_one_run_alone_gets_the_whole_pool_and_a_run_added_midway_its_share_at_once(
    proxy_file: ProxyHarness,
) -> None:
    runs = {"a": Run(proxy_file, "a", 2)}
    pool = proxy_file.client("a", "generator")
    assert serve(pool, runs, 10) == {"a": 10}
    runs["b"] = Run(proxy_file, "b", 2)
    # b starts at a's position (credited), not at 0: alternating from its first lease, no 10-lease catch-up.
    assert serve(pool, runs, 10) == {"a": 5, "b": 5}


def test_budget_and_pause_skip_a_run_and_a_removed_run_frees_its_share(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    runs = {"a": Run(proxy_file, "a", 2), "b": Run(proxy_file, "b", 2, budget_tokens=12)}
    pool = proxy_file.client("a", "generator")
    assert serve(pool, runs, 8) == {"a": 5, "b": 3}  # b spent its 12 tokens (3 groups of 2 x 2): a alone since
    with pytest.raises(errors.Backpressure, match="budget of 12 generated tokens is spent"):
        runs["b"].g.lease_prompts("gen", 1)  # its own lease route too: queued, not failed
    assert {s.run: s.hold for s in pool.pool_status().runs} == {"a": "ok", "b": "budget"}
    runs["b"].t.put_run(runs["b"].spec.model_copy(update={"budget_tokens": 10_000}))
    # Raised: b takes its share again from the pool's position (credited to a's score), no catch-up burst.
    assert serve(pool, runs, 6) == {"a": 3, "b": 3}

    paused = runs["a"].t.pause_generation()
    assert (paused.paused, paused.hold) == (True, "paused")
    with pytest.raises(errors.Backpressure, match="generation is paused"):
        runs["a"].g.lease_prompts("gen", 1)
    assert serve(pool, runs, 4) == {"a": 0, "b": 4}
    assert not runs["a"].t.resume_generation().paused
    assert serve(pool, runs, 4) == {"a": 2, "b": 2}  # resumed at the pool's position: no burst either

    # A's publishes change nothing of b's; a removed run (its keys and its entry gone) frees its share at once.
    before_b = _run_state(redis_server, "b")
    for v in range(2, 12):  # ten versions of a
        runs["a"].t.publish_adapter(v, adapter_tar(v))
    assert _run_state(redis_server, "b") == before_b
    with redis.Redis.from_url(redis_server.url) as r:
        r.delete(*r.keys("brl:a:*"))
        r.srem("brl:runs", "a")
    assert serve(pool, {"b": runs["b"]}, 3) == {"b": 3}
    after = _run_state(redis_server, "b")
    assert int(after["accepted_total"]) == int(before_b["accepted_total"]) + 3


def _run_keys(redis_server: RedisServer, run: str) -> dict[bytes, bytes | None]:
    """Every Redis key of ``run`` with its serialized value: any write to the run shows."""
    with redis.Redis.from_url(redis_server.url) as r:
        return {k: r.dump(k) for k in sorted(r.keys(f"brl:{run}:*"))}


def test_one_runs_pause_eval_and_resume_change_nothing_of_anothers(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    runs = {"a": Run(proxy_file, "a", 2, eval={"every": 1, "size": 2}), "b": Run(proxy_file, "b", 2)}
    pool = proxy_file.client("a", "generator")
    got = serve(pool, runs, 6)
    assert got["a"] > 0 and got["b"] > 0, got
    before = _run_keys(redis_server, "b")
    assert b"brl:b:counters" in before
    runs["a"].t.pause_generation()
    assert _run_keys(redis_server, "b") == before
    items = runs["a"].g.lease_eval("gen", [1], n=8).items
    assert len(items) == 2
    results = [EvalResult(version=1, index=i.index, samples=[EvalSample(reward=1.0, length=3)]) for i in items]
    assert runs["a"].g.submit_eval("gen", results).accepted == 2
    assert [e.version for e in runs["a"].t.eval_results()] == [1]
    runs["a"].t.resume_generation()
    assert _run_keys(redis_server, "b") == before  # a's pause, eval and resume wrote nothing of b's
    assert runs["b"].t.status().queue.accepted_total == got["b"]


def _run_state(redis_server: RedisServer, run: str) -> dict[str, str]:
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as r:
        return {**r.hgetall(f"brl:{run}:counters"), "cursor": r.get(f"brl:{run}:prompts:cursor") or ""}


def test_bad_input_is_refused_and_changes_nothing(redis_server: RedisServer, tmp_path: Path) -> None:
    scoped = "generator@a:tok-gen-scoped-0123456789"
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}", tokens=f"{TOKENS_ENV},{scoped}") as h:
        runs = {"a": Run(h, "a", 2), "b": Run(h, "b", 2)}
        with h.http("trainer") as http:
            r = http.put("/v1/runs/a", json={**runs["a"].spec.model_dump(), "share": 0})
            assert r.status_code == 422 and "share" in r.json()["error"]["message"], r.text
            assert http.get("/v1/runs/a").json()["spec"]["share"] == 1.0
        before = {run: _run_state(redis_server, run) for run in runs}
        with h.http("generator") as http:
            r = http.post("/v1/pool/lease", json={"worker_id": "gen", "runs": ["a", "ghost"]})
            assert r.status_code == 404 and "ghost" in r.json()["error"]["message"], r.text
            assert http.post("/v1/pool/lease", json={"worker_id": "gen", "runs": []}).status_code == 422
            r = http.post("/v1/pool/lease", json={"worker_id": "gen", "base_model": "other-model"})
            assert r.status_code == 429 and "no run to serve" in r.json()["error"]["message"], r.text
        assert {run: _run_state(redis_server, run) for run in runs} == before
        # A generator token limited to run a: never given b, and naming b is 403.
        limited = httpx.Client(base_url=h.url, headers={"Authorization": "Bearer tok-gen-scoped-0123456789"})
        with limited:
            r = limited.post("/v1/pool/lease", json={"worker_id": "gen", "runs": ["b"]})
            assert r.status_code == 403 and "limited to runs" in r.json()["error"]["message"]
            picked = {PoolLease.model_validate(limited.post("/v1/pool/lease", json={"worker_id": "g"}).json()).run}
            picked |= {PoolLease.model_validate(limited.post("/v1/pool/lease", json={"worker_id": "g"}).json()).run}
            assert picked == {"a"}
        assert _run_state(redis_server, "b") == before["b"]


def test_tokens_and_a_pause_survive_a_wipe(proxy_file: ProxyHarness, redis_server: RedisServer) -> None:
    """A replayed submit adds no tokens; after a Redis wipe the rebuild restores the count exactly: the
    snapshot's counters, plus the groups of batches accepted after it (their objects carry their tokens)."""
    a = Run(proxy_file, "a", 3)
    pool = proxy_file.client("a", "generator")
    first = pool.pool_lease(PoolLeaseRequest(worker_id="gen", n=2))
    a.submit(first.prompts)
    a.keys -= 1
    a.submit(first.prompts)  # the same idempotency key again: a duplicate, counted once
    claimed = a.t.claim("trainer-a", max_groups=1)
    assert a.t.ack([d.delivery_id for d in claimed.deliveries]) == 1
    assert proxy_file.call(lambda ctx: ctx.cleaner.drain(10.0))  # a snapshot with the counters so far
    a.submit(pool.pool_lease(PoolLeaseRequest(worker_id="gen", n=3)).prompts)  # accepted after it
    before = tokens(pool)
    assert before == {"a": (2 + 3) * 2 * 3}
    a.t.pause_generation()
    redis_server.wipe()
    redis_server.start()
    assert any(proxy_file.call(rebuild.rebuild_if_wiped) for _ in range(3))
    assert tokens(pool) == before
    # The pause outlives the wipe too (its bucket marker), until resumed.
    assert [(s.run, s.hold) for s in pool.pool_status().runs] == [("a", "paused")]
    with pytest.raises(errors.Backpressure, match="paused"):
        pool.pool_lease(PoolLeaseRequest(worker_id="gen"))
    a.t.resume_generation()
    assert pool.pool_lease(PoolLeaseRequest(worker_id="gen")).run == "a"


def test_concurrent_generators_agree_on_the_shares(proxy_file: ProxyHarness) -> None:
    """Four generators leasing at once (through one proxy, as many replicas share one Redis): the pick reads
    the prompts in flight, so leases taken before any submit still split by share."""
    runs = {"a": Run(proxy_file, "a", 4, share=3), "b": Run(proxy_file, "b", 4, share=1)}
    lock = threading.Lock()
    got = dict.fromkeys(runs, 0)

    def generator(name: str) -> None:
        pool = proxy_file.client("a", "generator")
        for _ in range(10):
            lease = pool.pool_lease(PoolLeaseRequest(worker_id=name, n=1))
            with lock:
                got[lease.run] += 1
                runs[lease.run].submit(lease.prompts)

    threads = [threading.Thread(target=generator, args=(f"g{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(got.values()) == 40 and 28 <= got["a"] <= 32, got
    tok = tokens(proxy_file.client("a", "viewer"))
    assert tok == {"a": got["a"] * 2 * 4, "b": got["b"] * 2 * 4}


def test_a_run_at_its_admission_limit_is_passed_over_and_its_refusal_counted_once(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    small = {"groups_per_step": 2, "max_staleness": 1, "queue_capacity_groups": 32}  # admission limit 2
    # a's large share puts it first, its 2 prompts in flight notwithstanding (b got a group already): it is
    # tried first, and refused.
    runs = {"a": Run(proxy_file, "a", 2, share=100, **small), "b": Run(proxy_file, "b", 2)}
    pool = proxy_file.client("a", "generator")
    runs["b"].submit(pool.pool_lease(PoolLeaseRequest(worker_id="gen", runs=["b"])).prompts)
    assert pool.pool_lease(PoolLeaseRequest(worker_id="gen", runs=["a"], n=2)).run == "a"  # a's limit reached
    lease = pool.pool_lease(PoolLeaseRequest(worker_id="gen", n=1))
    assert (lease.run, lease.passed_over) == ("b", {"a": "admission control"})
    with pytest.raises(errors.Backpressure, match="a: admission control"):
        pool.pool_lease(PoolLeaseRequest(worker_id="gen", runs=["a"], wait_s=1.2))  # a long-poll of 2+ passes
    # The pass-over is not a's refusal (b answered); the long-poll's passes count once.
    assert int(_run_state(redis_server, "a")["prompts_backpressure_total"]) == 1


def test_a_run_back_from_its_admission_limit_takes_its_share_not_a_catch_up_burst(proxy_file: ProxyHarness) -> None:
    """A run passed over at its admission limit (its trainer stalled) leaves the competition: when its trainer
    catches up it is credited to the other run's score, so it alternates rather than taking every lease until
    its count catches up (that burst cut the other run to 44 % for seconds: bench/pool_isolation.py)."""
    limited = {"groups_per_step": 8, "max_staleness": 1, "queue_capacity_groups": 64}  # admission limit 8
    runs = {"a": Run(proxy_file, "a", 2, **limited), "b": Run(proxy_file, "b", 2)}
    pool = proxy_file.client("a", "generator")
    for _ in range(8):  # a's trainer claims nothing: a reaches its limit
        runs["a"].submit(pool.pool_lease(PoolLeaseRequest(worker_id="gen", runs=["a"])).prompts)
    assert serve(pool, runs, 16) == {"a": 0, "b": 16}  # passed over: b gets the pool
    claimed = runs["a"].t.claim("trainer-a", max_groups=8)
    assert runs["a"].t.ack([d.delivery_id for d in claimed.deliveries]) == 8  # a's trainer is back
    got = serve(pool, runs, 8)
    assert 3 <= got["a"] <= 5, got  # its share of what comes next; before: all 8 (8 groups behind b)


def test_the_recent_share_counts_the_last_minute_only() -> None:
    """Slots of 10 s as submit_enqueue.lua keys them: the current one (partly elapsed) and the five before."""
    now = 1_000_005.0  # slot 100000
    slots = {b"99994": b"7", b"99995": b"1", b"99999": b"2", b"100000": b"4"}
    assert pool_state.recent_tokens(slots, now) == 1 + 2 + 4
    assert pool_state.recent_tokens(slots, now + 10.0) == 2 + 4  # a slot later: 99995 is out
    assert pool_state.recent_tokens({}, now) == 0


def test_a_finished_run_frees_its_share_at_once_until_a_trainer_registers_again(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    runs = {"a": Run(proxy_file, "a", 2), "b": Run(proxy_file, "b", 2)}
    pool = proxy_file.client("a", "generator")
    assert min(serve(pool, runs, 4).values()) >= 1  # both served
    done = runs["a"].t.finish_generation()  # a's trainer reached max_steps
    assert done.hold == "finished" and not done.paused
    assert serve(pool, runs, 4) == {"a": 0, "b": 4}  # at once, not once a's queue has filled
    with pytest.raises(errors.Backpressure, match="finished"):
        runs["a"].g.lease_prompts("gen", 1)
    # The hold outlives a Redis wipe (its bucket marker says finished, not paused).
    redis_server.wipe()
    redis_server.start()
    assert any(proxy_file.call(rebuild.rebuild_if_wiped) for _ in range(3))
    assert {s.run: s.hold for s in pool.pool_status().runs} == {"a": "finished", "b": "ok"}
    # A paused run stays paused when its trainer finishes; a trainer registering lifts finished, not a pause.
    runs["b"].t.pause_generation()
    assert runs["b"].t.finish_generation().hold == "paused"
    runs["a"].t.register_trainer("trainer-a-2")  # a trainer again, to train past the old max_steps
    runs["b"].t.register_trainer("trainer-b-2")
    assert {s.run: s.hold for s in pool.pool_status().runs} == {"a": "ok", "b": "paused"}
    assert serve(pool, runs, 2) == {"a": 2, "b": 0}


def test_status_pauses_and_resumes_a_runs_generation(proxy_file: ProxyHarness) -> None:
    runs = {"a": Run(proxy_file, "a", 2), "b": Run(proxy_file, "b", 2)}
    pool = proxy_file.client("a", "generator")
    base = ["status", "--proxy", proxy_file.url, "--run", "a", "--json"]
    cli = lambda *extra: CliRunner().invoke(app, [*base, *extra])  # noqa: E731
    refused = cli("--token", TOKENS["viewer"], "--generation", "pause")  # a viewer may only look
    assert refused.exit_code == 1 and "forbidden" in refused.output.lower(), refused.output
    assert {s.run: s.hold for s in pool.pool_status().runs} == {"a": "ok", "b": "ok"}
    paused = cli("--token", TOKENS["trainer"], "--generation", "pause")
    assert paused.exit_code == 0, paused.output
    assert "generation paused (hold paused)" in paused.stderr
    assert json.loads(paused.stdout)["pool"]["hold"] == "paused"
    assert serve(pool, runs, 4) == {"a": 0, "b": 4}
    resumed = cli("--token", TOKENS["trainer"], "--generation", "resume")
    assert resumed.exit_code == 0 and json.loads(resumed.stdout)["pool"]["hold"] == "ok", resumed.output
    assert serve(pool, runs, 4) == {"a": 2, "b": 2}
    bad = cli("--token", TOKENS["trainer"], "--generation", "stop")
    assert bad.exit_code == 2 and "pause or resume" in bad.stderr
