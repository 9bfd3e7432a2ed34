"""Partial rollouts on the wire (issue 35, docs/design.md "Partial rollouts"): a completion's version spans, their
refusals, and their way through the real proxy (submit -> bucket -> claim, JSON and packed msgpack) unchanged."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from pydantic import ValidationError

from bucketrl import errors
from bucketrl.wire import Completion, Delivery, RolloutBatch, RunSpec, VersionSpan
from bucketrl.wire.packed import packb, validate_keeping_arrays
from tests.proxy.harness import ProxyHarness, adapter_tar
from tests.proxy.test_rollouts_routes import Setup


def spans(*triples: tuple[int, int, int]) -> list[dict[str, int]]:
    return [{"version": v, "start": a, "end": b} for v, a, b in triples]


def mixed(**kw: Any) -> dict[str, Any]:
    """Five tokens: [0, 3) sampled by v1, [3, 5) by v2 (a call continued under v2)."""
    base = {
        "token_ids": [4, 5, 6, 7, 8],
        "logprobs": [-0.5, -1.0, -0.25, -2.0, -0.125],
        "reward": 1.0,
        "version_spans": spans((1, 0, 3), (2, 3, 5)),
    }
    return {**base, **kw}


def test_spans_round_trip_json_and_packed_msgpack_and_give_each_tokens_version() -> None:
    c = Completion.model_validate(mixed())
    assert c.version_spans == [VersionSpan(version=1, start=0, end=3), VersionSpan(version=2, start=3, end=5)]
    assert c.token_versions(2) == [1, 1, 1, 2, 2]
    for again in (
        Completion.model_validate_json(c.model_dump_json(), strict=True),
        Completion.model_validate(msgpack.unpackb(packb(c)), strict=True),
        validate_keeping_arrays(Completion, msgpack.unpackb(packb(c))),
    ):
        assert again.version_spans == c.version_spans and list(again.token_ids) == c.token_ids
    # Without spans: no key at all (a batch's bytes and digest are what they were before spans), every token the
    # batch's version.
    plain = Completion.model_validate(mixed(version_spans=None))
    assert "version_spans" not in plain.model_dump_json() and "version_spans" not in msgpack.unpackb(packb(plain))
    assert plain.token_versions(7) == [7] * 5


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (spans((1, 0, 2), (2, 3, 5)), "version_spans[1]: starts at 3, a gap"),
        (spans((1, 0, 3), (2, 2, 5)), "version_spans[1]: starts at 2, an overlap"),
        (spans((1, 1, 3), (2, 3, 5)), "version_spans[0]: starts at 1, a gap"),
        (spans((2, 0, 3), (1, 3, 5)), "version_spans[1]: version 1 after 2"),
        (spans((1, 0, 3), (2, 3, 4)), "cover tokens [0, 4) but token_ids has 5"),
        (spans((1, 0, 3), (2, 3, 6)), "cover tokens [0, 6) but token_ids has 5"),
        (spans((1, 0, 3), (1, 3, 3), (2, 3, 5)), "version_spans[1]: [3, 3) is empty"),
        ([], "at least 1 item"),
        (spans((0, 0, 5)), "greater than or equal to 1"),
    ],
)
def test_bad_spans_are_refused(bad: list[dict[str, int]], needle: str) -> None:
    with pytest.raises(ValidationError, match="version_spans") as exc:
        Completion.model_validate(mixed(version_spans=bad))
    assert needle in str(exc.value)


def test_spans_with_segments_are_refused() -> None:
    data = {
        "segments": [{"kind": "model", "token_ids": [4, 5], "logprobs": [-0.5, -1.0]}],
        "reward": 1.0,
        "version_spans": spans((1, 0, 2)),
    }
    with pytest.raises(ValidationError, match="multi-turn completions \\(segments\\) are whole-version"):
        Completion.model_validate(data)


def _batch(version: int, comp: dict[str, Any]) -> dict[str, Any]:
    group = {"prompt_id": "0-0", "prompt_index": 0, "prompt_token_ids": [1], "completions": [comp, mixed()]}
    return {"worker_id": "g", "lease_id": "l", "version": version, "groups": [group]}


def test_no_span_is_newer_than_the_batch_version() -> None:
    RolloutBatch.model_validate(_batch(2, mixed()))
    Delivery.model_validate({"delivery_id": "d", **_batch(2, mixed())})
    # A completion that ended before its siblings went on under v3 keeps its v2 last span (lane-35b's relaxation).
    RolloutBatch.model_validate(_batch(3, mixed()))
    Delivery.model_validate({"delivery_id": "d", **_batch(3, mixed())})
    for model, extra in ((RolloutBatch, {}), (Delivery, {"delivery_id": "d"})):
        with pytest.raises(
            ValidationError, match=r"completions\[0\]\.version_spans: the last span.s version 2 is newer"
        ):
            model.model_validate({**extra, **_batch(1, mixed())})


def test_a_partial_rollouts_run_is_single_turn_and_the_field_is_immutable() -> None:
    base = {"base_model": "m", "reward": {"name": "toy"}, "dataset": {"uri": "toy:digits", "size": 4}, "vocab_size": 9}
    assert RunSpec.model_validate(base).partial_rollouts is False
    on = RunSpec.model_validate({**base, "partial_rollouts": True})
    assert on.immutable_diff(RunSpec.model_validate(base)) == ["partial_rollouts"]
    with pytest.raises(ValidationError, match="partial_rollouts: multi-turn runs"):
        RunSpec.model_validate({**base, "partial_rollouts": True, "env": {"name": "toy:tools"}})


# -- through the proxy -----------------------------------------------------------------------------------


def _continued(s: Setup, n: int) -> RolloutBatch:
    """A v2 batch whose completions each began under v1 and went on under v2 (spans differ per completion)."""
    b = s.batch(n, version=2)
    groups = []
    for group in b.groups:
        comps = []
        for c, comp in enumerate(group.completions):
            ids = [4 + c, 5, 6, 7][: 2 + c]
            cut = 1 + c % 2
            comps.append(
                comp.model_copy(
                    update={
                        "token_ids": ids,
                        "logprobs": [-0.5] * len(ids),
                        "version_spans": [
                            VersionSpan(version=1, start=0, end=cut),
                            VersionSpan(version=2, start=cut, end=len(ids)),
                        ],
                    }
                )
            )
        groups.append(group.model_copy(update={"completions": comps}))
    return RolloutBatch.model_validate(b.model_copy(update={"groups": groups}).model_dump())


def test_spans_ride_through_submit_bucket_and_claim_unchanged(proxy: ProxyHarness) -> None:
    s = Setup(proxy, partial_rollouts=True, max_staleness=2, group_size=3)
    s.t.publish_adapter(2, adapter_tar(2))
    s.lease_id = s.g.lease_version("gen-0").lease_id
    packed, plain = _continued(s, 2), _continued(s, 1)
    assert s.g.submit_rollouts(packed, "kp", use_msgpack=True).accepted_groups == 2
    assert s.g.submit_rollouts(plain, "kj", use_msgpack=False).accepted_groups == 1
    got = s.t.claim("trainer-0", max_groups=8)
    claimed = [g for d in got.deliveries for g in d.groups]
    assert [d.version for d in got.deliveries] == [2, 2, 2]
    assert claimed == [*packed.groups, *plain.groups]  # spans, tokens and logprobs exactly as submitted
    assert [c.token_versions(2) for c in claimed[0].completions] == [[1, 2], [1, 1, 2], [1, 2, 2, 2]]


def test_a_run_without_partial_rollouts_refuses_spans_and_keeps_nothing(proxy: ProxyHarness) -> None:
    s = Setup(proxy, max_staleness=2, group_size=3)
    s.t.publish_adapter(2, adapter_tar(2))
    s.lease_id = s.g.lease_version("gen-0").lease_id
    for use_msgpack in (True, False):
        with pytest.raises(errors.Invalid, match=r"completions\[0\]\.version_spans: the run does not have partial"):
            s.g.submit_rollouts(_continued(s, 1), f"k{use_msgpack}", use_msgpack=use_msgpack)
    status = proxy.client(s.run, "viewer").status()
    assert (status.queue.groups, status.queue.accepted_total) == (0, 0)
