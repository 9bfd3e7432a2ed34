"""Pool mode: one generator process, one transformers engine, two runs of one base model (docs/pool.md).

A real proxy over a real Redis and bucket, the real transformers engine on the tiny model, a trainer stand-in
per run claiming and acking. The pool lease picks each lease's run; the groups land in that run's queue,
sampled with that run's adapter (checked against teacher-forced logprobs), and each run's lane keeps its own
adapters in its own slots."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bucketrl.generator.pool import LaneEngine, PoolGenerator, plan_slots
from tests.generator.helpers import make_adapter
from tests.generator.test_worker import check_delivery
from tests.generator.worker_support import Consumer, create_run, worker_settings
from tests.proxy.harness import ProxyHarness, make_spec, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("pool-adapters")
    return {v: make_adapter(tiny_model_dir, root / f"v{v}", seed=30 + v) for v in (1, 2)}


def test_one_engine_serves_two_runs_each_with_its_own_adapters(
    proxy: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path]
) -> None:
    ta, spec = create_run(proxy, "pa", tiny_model_dir, adapters[1], share=2)
    tb, _ = create_run(proxy, "pb", tiny_model_dir, adapters[2])  # b's v1 is the other adapter's weights
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = worker_settings(proxy, "pa", "gen-a", runs="pa,pb")
    gen = PoolGenerator(settings)
    thread = threading.Thread(target=gen.run, daemon=True)
    with Consumer(ta) as ca, Consumer(tb) as cb:
        thread.start()
        try:
            da = ca.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 2, 240)
            db = cb.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 1, 240)
        finally:
            gen.notice_given(20.0, "test")  # what SIGTERM does: every lane hands back what it never sampled
            thread.join(60)
    assert not thread.is_alive()
    for d in da:  # run pa's groups sampled with pa's v1, run pb's with pb's (adapters[2] under pb-v1)
        check_delivery(d, spec, tiny_model_dir, adapters, tok)
    for d in db:
        check_delivery(d, spec, tiny_model_dir, {1: adapters[2]}, tok)
    pool = {r.run: r for r in proxy.client("pa", "viewer").pool_status().runs}
    assert pool["pa"].tokens_generated > 0 and pool["pb"].tokens_generated > 0
    assert pool["pa"].prompts_inflight == pool["pb"].prompts_inflight == 0  # released or submitted at stop


def test_slots_are_planned_across_runs_and_a_lane_sees_only_its_adapters() -> None:
    specs = {"a": make_spec(max_staleness=1), "b": make_spec(max_staleness=2), "c": make_spec(max_staleness=0)}
    assert plan_slots(specs, None) == ({"a": 3, "b": 4, "c": 2}, [])
    # 6 slots: a (3) fits, b (4) would not, c (2) does: b is left to other generators rather than thrashing.
    assert plan_slots(specs, 6) == ({"a": 3, "c": 2}, ["b"])

    class Resident:
        name, max_model_len = "fake", 64  # an engine's adapter table only (no model: the edge under test)

        def __init__(self) -> None:
            self.names: list[str] = []

        def load_adapter(self, name: str, version: int, path: object) -> None:
            self.names.append(name)

        def unload_adapter(self, name: str) -> None:
            self.names.remove(name)

        def loaded_adapters(self) -> list[str]:
            return list(self.names)

    engine = Resident()
    a, a_v = LaneEngine(engine, "a", 3), LaneEngine(engine, "a-v2", 3)  # type: ignore[arg-type]
    a.load_adapter("a-v1", 1, "x")
    a_v.load_adapter("a-v2-v1", 1, "y")
    assert (a.loaded_adapters(), a_v.loaded_adapters(), a.max_loras) == (["a-v1"], ["a-v2-v1"], 3)
