"""A completion's length is bounded by the run's spec, not by the generator's own claim (issue 12).

The proxy checks completions against the batch's declared ``sampling.max_new_tokens``, which the generator
writes itself: a batch may declare what an older, larger spec said (it was sampled before the change), but
never more than the run's spec has ever allowed; that bound survives a restart and a Redis wipe."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import redis

from bucketrl import errors
from bucketrl.wire import RolloutBatch, packed
from tests.proxy.harness import ProxyHarness
from tests.proxy.test_rollouts_routes import Setup


def _long(s: Setup, n_tokens: int, declared: int | None, n_groups: int = 1) -> RolloutBatch:
    """A batch whose completions are ``n_tokens`` long, declaring ``max_new_tokens=declared``."""
    b = s.batch(n_groups)
    comp: dict[str, Any] = {"token_ids": [5] * n_tokens, "logprobs": [-0.5] * n_tokens, "finish_reason": "length"}
    groups = [
        g.model_copy(update={"completions": [c.model_copy(update=comp) for c in g.completions]}) for g in b.groups
    ]
    sampling = None if declared is None else s.spec.sampling.model_copy(update={"max_new_tokens": declared})
    return RolloutBatch.model_validate(
        {**b.model_dump(mode="json"), "groups": [g.model_dump(mode="json") for g in groups], "sampling": sampling}
    )


def _with_max_new(s: Setup, n: int) -> None:
    s.spec = s.spec.model_copy(update={"sampling": s.spec.sampling.model_copy(update={"max_new_tokens": n})})
    s.t.put_run(s.spec)


def _accepted(p: ProxyHarness, s: Setup) -> int:
    return p.client(s.run, "viewer").status().queue.accepted_total


def test_a_declared_max_new_tokens_above_anything_the_spec_allowed_is_422(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=32, groups_per_step=8, sampling={"max_new_tokens": 8})
    greedy = _long(s, 50, declared=100)
    with pytest.raises(errors.Invalid, match=r"sampling\.max_new_tokens: 100, more than the run's spec has ever"):
        s.g.submit_rollouts(greedy, "packed")  # the client's default: msgpack, arrays packed
    with pytest.raises(errors.Invalid, match=r"sampling\.max_new_tokens: 100"):
        s.g.submit_rollouts(greedy, "json", use_msgpack=False)
    with proxy_file.http("generator") as http:  # packed msgpack, straight over HTTP
        r = http.post(
            s.path("/rollouts"),
            content=msgpack.packb(packed.packed(greedy), use_bin_type=True),
            headers={"Content-Type": "application/msgpack", "Idempotency-Key": "raw"},
        )
        assert r.status_code == 422 and "sampling.max_new_tokens: 100" in r.json()["error"]["message"]
    # Declaring nothing, or the spec's own value, does not lift the cap either.
    for declared in (None, 8):
        with pytest.raises(errors.Invalid, match=r"completions\[0\]\.token_ids: 50 tokens, more than"):
            s.g.submit_rollouts(_long(s, 50, declared), f"d{declared}")
    assert _accepted(proxy_file, s) == 0
    assert s.g.submit_rollouts(_long(s, 8, declared=8), "ok").accepted_groups == 1


def test_a_batch_sampled_under_an_older_larger_spec_is_accepted_and_the_bound_survives_a_wipe(
    proxy_file: ProxyHarness,
) -> None:
    s = Setup(proxy_file, queue_capacity_groups=32, groups_per_step=8, sampling={"max_new_tokens": 8})
    _with_max_new(s, 32)
    in_flight = _long(s, 30, declared=32)  # sampled while the spec said 32
    _with_max_new(s, 8)
    assert s.g.submit_rollouts(in_flight, "in-flight").accepted_groups == 1
    assert s.g.submit_rollouts(_long(s, 30, declared=None), "undeclared").accepted_groups == 1
    with pytest.raises(errors.Invalid, match=r"sampling\.max_new_tokens: 33, more than .* \(32\)"):
        s.g.submit_rollouts(_long(s, 30, declared=33), "over")

    # A restart, then a Redis wipe: the rebuild restores the bound from the bucket.
    proxy_file.restart()
    redis.Redis.from_url(proxy_file.settings.redis_url).flushall()
    s.g = proxy_file.client(s.run, "generator", retries=3)
    assert s.g.submit_rollouts(_long(s, 30, declared=32), "after-wipe").accepted_groups == 1
    with pytest.raises(errors.Invalid, match=r"sampling\.max_new_tokens: 33, more than .* \(32\)"):
        s.g.submit_rollouts(_long(s, 30, declared=33), "over-after-wipe")
    assert proxy_file.client(s.run, "viewer").get_run().spec.sampling.max_new_tokens == 8
