"""Evaluation during training on the proxy (``bucketrl.proxy.state.evals``) over real HTTP, Redis and bucket: eval
prompts leased per evaluated version, each prompt counted once, the per-version result in the bucket, the eval
route and the status; a Redis wipe keeps complete results and restarts partial ones without double counting."""

from __future__ import annotations

import pytest

from bucketrl.proxy import rebuild
from bucketrl.wire import EvalResult, EvalSample
from tests.proxy.harness import ProxyHarness, adapter_tar
from tests.proxy.test_rollouts_routes import Setup
from tests.support.services import RedisServer

EVAL = {"every": 2, "size": 3, "n": 2, "sampling": {"temperature": 1.0}, "pass_threshold": 1.0}


def result(version: int, index: int, rewards: list[float | None], length: int = 4) -> EvalResult:
    return EvalResult(version=version, index=index, samples=[EvalSample(reward=r, length=length) for r in rewards])


def test_eval_prompts_are_leased_per_evaluated_version_and_counted_once(
    proxy: ProxyHarness, redis_server: RedisServer
) -> None:
    s = Setup(proxy, eval=EVAL)
    s.t.publish_adapter(2, adapter_tar(2))
    # v1 and v3, 5, ... are evaluated; v2 is not; v3 is not published yet.
    assert s.g.lease_eval("gen-0", [2], n=8).items == []
    assert s.g.lease_eval("gen-0", [3], n=8).items == []
    got = s.g.lease_eval("gen-0", [1, 2], n=2).items
    assert [(i.version, i.index) for i in got] == [(1, 0), (1, 1)]
    rest = s.g.lease_eval("gen-1", [1], n=8).items
    assert [(i.version, i.index) for i in rest] == [(1, 2)]
    assert s.g.lease_eval("gen-1", [1], n=8).items == []  # all leased, none expired

    first = s.g.submit_eval("gen-0", [result(1, 0, [1.0, 0.5]), result(1, 1, [0.0, None], length=2)])
    assert (first.accepted, first.duplicates) == (2, 0)
    # A retried submit (or a prompt done twice after its lease expired) adds nothing.
    again = s.g.submit_eval("gen-0", [result(1, 1, [1.0, 1.0])])
    assert (again.accepted, again.duplicates) == (0, 1)
    assert s.g.eval_results() == []  # not complete yet
    done = s.g.submit_eval("gen-1", [result(1, 2, [1.0, 1.0], length=6)])
    assert done.accepted == 1

    (res,) = proxy.client(s.run, "viewer").eval_results()
    assert (res.version, res.prompts, res.samples, res.k) == (1, 3, 6, 2)
    assert res.reward_mean == pytest.approx((1.0 + 0.5 + 0.0 + 1.0 + 1.0) / 5)
    assert res.pass_at_1 == pytest.approx((1 / 2 + 0 + 2 / 2) / 3)
    assert res.pass_at_k == pytest.approx(2 / 3)
    assert res.mean_length == pytest.approx((4 + 4 + 2 + 2 + 6 + 6) / 6)
    assert res.unscorable_frac == pytest.approx(1 / 6)
    assert proxy.client(s.run, "viewer").status().eval == [res]
    assert s.g.lease_eval("gen-0", [1], n=8).items == []  # a finished version is never leased again
    assert s.g.submit_eval("gen-0", [result(1, 0, [0.0, 0.0])]).duplicates == 1

    # v3: a partial evaluation, then Redis is wiped.
    s.t.publish_adapter(3, adapter_tar(3))
    assert len(s.g.lease_eval("gen-0", [3], n=8).items) == 3
    s.g.submit_eval("gen-0", [result(3, 0, [0.0, 0.0])])
    redis_server.wipe()
    redis_server.start()
    assert any(proxy.call(rebuild.rebuild_if_wiped) for _ in range(3))
    viewer = proxy.client(s.run, "viewer")
    assert viewer.eval_results() == [res], "a complete result survives the wipe (read back from the bucket)"
    # The partial v3 starts over: every prompt is leased again and counted once.
    assert [i.index for i in s.g.lease_eval("gen-0", [3], n=8).items] == [0, 1, 2]
    s.g.submit_eval("gen-0", [result(3, i, [1.0, 1.0]) for i in range(3)])
    v3 = viewer.eval_results()[1]
    assert (v3.version, v3.prompts, v3.pass_at_1, v3.reward_mean) == (3, 3, 1.0, 1.0)


def test_a_run_without_eval_leases_nothing(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file)
    assert s.g.lease_eval("gen-0", [1], n=8).items == []
    assert proxy_file.client(s.run, "viewer").status().eval == []
