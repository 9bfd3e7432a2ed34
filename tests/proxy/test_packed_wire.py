"""Packed numeric arrays on the msgpack wire (``bucketrl/wire/packed.py``), unit and over real HTTP.

- ``packb`` round-trips a batch exactly (float32 only where exact), packs every ``NumericArray`` field of any
  model (multi-turn segments, a nested field added later) and nothing else;
- a packed array is refused for exactly what its list would be refused for, naming the field, and the
  proxy's one-pass check (``validate_keeping_arrays``) names the same location;
- through a real proxy: the client submits packed by default; packed, plain-msgpack and JSON bodies are all
  accepted and claimed equal; the stored object holds the submitted group bytes untouched; a claim answers
  msgpack to a client that accepts it and JSON otherwise; a bad packed array is 422 and enqueues nothing.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from bucketrl.wire import ClaimResponse, Completion, RolloutBatch, RolloutGroup, packed
from bucketrl.wire.common import WireModel
from bucketrl.wire.rollouts import SegmentLogprobs, SegmentTokenIds
from tests.proxy.harness import ProxyHarness
from tests.proxy.test_rollouts_routes import Setup


def _batch(logprobs: list[float]) -> RolloutBatch:
    comp = {"token_ids": list(range(len(logprobs))), "logprobs": logprobs, "reward": 0.5, "finish_reason": "length"}
    group = {"prompt_id": "0-0", "prompt_index": 0, "prompt_token_ids": [5, 6, 7], "completions": [comp, comp]}
    return RolloutBatch.model_validate({"worker_id": "w", "lease_id": "l", "version": 1, "groups": [group]})


def test_packb_round_trips_exactly_and_packs_only_numeric_arrays() -> None:
    exact32 = [-0.5, -0.25, -1.0, float(np.float32(-0.3))]  # representable in float32: packed as float32
    full = [-0.1, -1e-300, -123.456789012345, -0.0]  # not: float64
    for logprobs, code in ((exact32, packed.EXT_FLOAT32), (full, packed.EXT_FLOAT64)):
        batch = _batch(logprobs)
        raw = msgpack.unpackb(packed.packb(batch))
        comp = raw["groups"][0]["completions"][0]
        assert comp["token_ids"] == msgpack.ExtType(packed.EXT_INT32, np.arange(4, dtype="<i4").tobytes())
        assert comp["logprobs"].code == code
        assert raw["groups"][0]["prompt_token_ids"].code == packed.EXT_INT32
        assert comp["reward"] == 0.5 and raw["worker_id"] == "w"  # everything else is plain msgpack
        again = RolloutBatch.model_validate(raw, strict=True)
        assert again == batch and type(again.groups[0].completions[0].logprobs[0]) is float
        assert [math.copysign(1, v) for v in again.groups[0].completions[0].logprobs] == [
            math.copysign(1, v) for v in logprobs
        ]
    # An int outside int32 is sent as the plain list (the receiver refuses it with its usual message).
    assert packed.pack_array([1, 2**40], "int") == [1, 2**40]


def test_multi_turn_segments_travel_packed_and_are_checked() -> None:
    comp = Completion.from_segments(
        [("model", [1, 2], [-0.5, -1.0]), ("env", [9, 9], None), ("model", [3], [-2.0])], 1.0
    )
    raw = msgpack.unpackb(packed.packb(comp))
    assert "token_ids" not in raw  # the derived flat fields are never sent; the segments' arrays are packed
    assert [s["token_ids"].code for s in raw["segments"]] == [packed.EXT_INT32] * 3
    assert raw["segments"][1]["logprobs"] is None and raw["segments"][2]["logprobs"].code == packed.EXT_FLOAT32
    again = Completion.model_validate(raw, strict=True)
    assert again == comp and again.token_ids == [1, 2, 9, 9, 3] and again.loss_mask() == [1, 1, 0, 0, 1]
    kept = packed.validate_keeping_arrays(Completion, raw)  # the proxy's form: the flat fields derived as lists
    assert kept.token_ids == [1, 2, 9, 9, 3] and isinstance(kept.segments[0].token_ids, np.ndarray)
    raw["segments"][2]["token_ids"] = _ext(17, [-3], "<i4")
    with pytest.raises(ValidationError, match=r"segments\.2\.token_ids\n.*token_ids must be >= 0"):
        Completion.model_validate(raw, strict=True)
    with pytest.raises(ValidationError, match=r"segments\.2\.token_ids"):
        packed.validate_keeping_arrays(Completion, raw)


class Extra(WireModel):  # a field added later: packed and checked with no change to packed.py
    token_ids: SegmentTokenIds
    logprobs: SegmentLogprobs | None = None
    mask: list[int]


class FutureGroup(RolloutGroup):
    extras: list[Extra] | None = None


def test_a_numeric_array_field_added_later_is_packed_and_checked() -> None:
    group = FutureGroup.model_validate(
        {
            **_batch([-1.0, -2.0]).groups[0].model_dump(),
            "extras": [{"token_ids": [3, 4, 5], "logprobs": None, "mask": [1, 0, 1]}],
        }
    )
    raw = msgpack.unpackb(packed.packb(group))
    extra = raw["extras"][0]
    assert extra["token_ids"].code == packed.EXT_INT32 and extra["logprobs"] is None and extra["mask"] == [1, 0, 1]
    assert FutureGroup.model_validate(raw, strict=True) == group
    extra["token_ids"] = _ext(17, [3, -4], "<i4")
    with pytest.raises(ValidationError, match=r"extras\.0\.token_ids\n.*token_ids must be >= 0"):
        FutureGroup.model_validate(raw, strict=True)


def _ext(code: int, values: list[float], dtype: str) -> msgpack.ExtType:
    return msgpack.ExtType(code, np.array(values, dtype=dtype).tobytes())


BAD_COMPLETIONS: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    # what, packed form, list form, expected words
    (
        "negative token",
        {"token_ids": _ext(17, [1, -1], "<i4"), "logprobs": _ext(19, [-1, -1], "<f8")},
        {"token_ids": [1, -1], "logprobs": [-1.0, -1.0]},
        "token_ids must be >= 0",
    ),
    (
        "positive logprob",
        {"token_ids": _ext(17, [1, 2], "<i4"), "logprobs": _ext(18, [-1, 0.5], "<f4")},
        {"token_ids": [1, 2], "logprobs": [-1.0, 0.5]},
        "logprobs[1] = 0.5 is not a finite value <= 0",
    ),
    (
        "NaN logprob",
        {"token_ids": _ext(17, [1, 2], "<i4"), "logprobs": _ext(19, [math.nan, -1], "<f8")},
        {"token_ids": [1, 2], "logprobs": [math.nan, -1.0]},
        "logprobs",
    ),
    (
        "empty",
        {"token_ids": _ext(17, [], "<i4"), "logprobs": _ext(19, [], "<f8")},
        {"token_ids": [], "logprobs": []},
        "token_ids: at least 1 token",
    ),
    (
        "lengths differ",
        {"token_ids": _ext(17, [1, 2, 3], "<i4"), "logprobs": _ext(19, [-1, -1], "<f8")},
        {"token_ids": [1, 2, 3], "logprobs": [-1.0, -1.0]},
        "logprobs has 2 entries but token_ids has 3",
    ),
]


@pytest.mark.parametrize("what,packed_form,list_form,words", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_a_packed_array_is_refused_for_what_its_list_is(
    what: str, packed_form: dict[str, Any], list_form: dict[str, Any], words: str
) -> None:
    for form in (packed_form, list_form):
        with pytest.raises(ValidationError, match="(?s)" + words.replace("[", r"\[").replace("]", r"\]")):
            Completion.model_validate({**form, "reward": None}, strict=True)
    # The proxy's one-pass check refuses it too, naming the same location.
    comp = {**packed_form, "reward": None}
    body = {
        "worker_id": "w",
        "lease_id": "l",
        "version": 1,
        "groups": [{"prompt_id": "0-0", "prompt_index": 0, "prompt_token_ids": [1], "completions": [comp]}],
    }
    with pytest.raises(ValidationError, match=r"groups\.0\.completions\.0"):
        packed.validate_keeping_arrays(RolloutBatch, body)


def test_packed_arrays_of_the_wrong_kind_or_shape_are_refused() -> None:
    def check(token_ids: Any, logprobs: Any, words: str) -> None:
        with pytest.raises(ValidationError, match=words):
            Completion.model_validate({"token_ids": token_ids, "logprobs": logprobs, "reward": None}, strict=True)

    check(_ext(19, [1, 2], "<f8"), [-1.0, -1.0], "a packed float64 array; token_ids must be int32")
    check([1, 2], _ext(17, [1, 2], "<i4"), "a packed int32 array; logprobs must be float32 or float64")
    check(msgpack.ExtType(17, b"\x01\x00\x00"), [-1.0], "not whole items")
    check(msgpack.ExtType(99, b""), [-1.0], "msgpack ext type 99")
    big = np.zeros(65_537, dtype="<i4").tobytes()
    check(msgpack.ExtType(17, big), [-1.0], "65537 items; token_ids must have 0 to 65536 items")


def test_validate_keeping_arrays_keeps_numpy_arrays() -> None:
    batch = _batch([-0.5, -1.5])
    kept = packed.validate_keeping_arrays(RolloutBatch, msgpack.unpackb(packed.packb(batch)))
    comp = kept.groups[0].completions[0]
    assert isinstance(comp.token_ids, np.ndarray) and comp.token_ids.tolist() == [0, 1]
    assert isinstance(comp.logprobs, np.ndarray) and comp.logprobs.tolist() == [-0.5, -1.5]


# -- over real HTTP --------------------------------------------------------------------------------------


def test_packed_plain_and_json_submits_claim_equal(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=32, groups_per_step=8)
    by_client, plain, as_json = s.batch(2), s.batch(1), s.batch(1)
    first = s.g.submit_rollouts(by_client, "k-packed")  # the client's default: msgpack, arrays packed
    stored = msgpack.unpackb(proxy_file.ctx.store.get_bytes(f"runs/{s.run}/rollouts/{first.batch_id}"))
    assert stored["format"] == 3 and stored["groups_msgpack"] == [packed.packb(g) for g in by_client.groups]
    with proxy_file.http("generator") as http:
        for key, content, ctype in (
            ("k-plain", msgpack.packb(plain.model_dump(mode="json")), "application/msgpack"),
            ("k-json", as_json.model_dump_json().encode(), "application/json"),
        ):
            r = http.post(s.path("/rollouts"), content=content, headers={"Content-Type": ctype, "Idempotency-Key": key})
            assert r.status_code == 202, r.text
    submitted = [*by_client.groups, *plain.groups, *as_json.groups]

    got = s.t.claim("trainer-0", max_groups=8)  # the client asks for msgpack
    assert [d.groups[0] for d in got.deliveries] == submitted
    ids = [d.delivery_id for d in got.deliveries]
    with proxy_file.http("trainer") as http:
        # An older trainer (no Accept): the same deliveries, as JSON (redelivered to a new epoch).
        epoch = http.post(s.path("/trainer"), json={"worker_id": "trainer-1"}).json()["epoch"]
        headers = {"X-Trainer-Epoch": str(epoch)}
        r = http.post(s.path("/rollouts/claim"), json={"consumer": "t1", "max_groups": 8}, headers=headers)
        assert r.headers["content-type"].startswith("application/json")
        answer = ClaimResponse.model_validate_json(r.content)
        assert sorted(d.delivery_id for d in answer.deliveries) == sorted(ids)
        assert sorted((d.groups[0] for d in answer.deliveries), key=lambda g: g.prompt_id) == sorted(
            submitted, key=lambda g: g.prompt_id
        )


def test_a_bad_packed_array_is_422_naming_it_and_enqueues_nothing(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=32, groups_per_step=8)
    good = s.batch(2)
    raw = packed.packed(good)
    raw["groups"][1]["completions"][1]["logprobs"] = _ext(19, [-1.0, 2.0], "<f8")
    with proxy_file.http("generator") as http:
        r = http.post(
            s.path("/rollouts"),
            content=msgpack.packb(raw, use_bin_type=True),
            headers={"Content-Type": "application/msgpack", "Idempotency-Key": "bad"},
        )
        assert r.status_code == 422
        message = r.json()["error"]["message"]
        assert "body.groups.1.completions.1.logprobs" in message and "logprobs[1] = 2.0" in message
        raw["groups"][1]["completions"][1]["token_ids"] = _ext(17, [4, 64], "<i4")  # 64 = vocab_size
        raw["groups"][1]["completions"][1]["logprobs"] = _ext(19, [-1.0, -2.0], "<f8")
        r = http.post(
            s.path("/rollouts"),
            content=msgpack.packb(raw, use_bin_type=True),
            headers={"Content-Type": "application/msgpack", "Idempotency-Key": "vocab"},
        )
        assert (
            r.status_code == 422
            and "groups[1].completions[1].token_ids[1]: token id 64 >= vocab_size 64" in (r.json()["error"]["message"])
        )
    assert proxy_file.client(s.run, "viewer").status().queue.accepted_total == 0
