"""Multi-turn trajectories on the wire (docs/design.md "Multi-turn trajectories"): the ``Completion`` model's
segments, derived flat fields and loss mask, split episodes, and the proxy's per-run validation over real HTTP
(JSON and msgpack), each bad trajectory a 422 naming the field and changing nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgpack
import pytest
from pydantic import ValidationError

from bucketrl.wire import Completion, RolloutBatch, RolloutGroup, RunSpec, Segment
from bucketrl.wire.packed import packb, validate_keeping_arrays
from tests.proxy.harness import ProxyHarness
from tests.proxy.test_rollouts_routes import Setup

OLD_COMPLETION_KEYS = {"token_ids", "logprobs", "reward", "finish_reason"}


def traj(reward: float = 1.0, **kw: Any) -> Completion:
    """prompt | model [4, 5] | env [6, 7, 8] | model [9]"""
    return Completion.from_segments(
        [("model", [4, 5], [-0.5, -1.0]), ("env", [6, 7, 8], None), ("model", [9], [-0.25])], reward, **kw
    )


# -- the model -------------------------------------------------------------------------------------------


def test_flat_fields_are_derived_and_the_mask_marks_model_tokens() -> None:
    c = traj()
    assert c.token_ids == [4, 5, 6, 7, 8, 9]
    assert c.logprobs == [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25]
    assert c.loss_mask() == [1, 1, 0, 0, 0, 1]
    assert (c.turns(), c.model_tokens(), c.multi_turn) == (2, 3, True)
    single = Completion(token_ids=[4, 5], logprobs=[-0.1, -0.2], reward=0.0)
    assert (single.loss_mask(), single.turns(), single.model_tokens(), single.multi_turn) == ([1, 1], 1, 2, False)


def test_from_segments_merges_adjacent_kinds_and_drops_trailing_env() -> None:
    c = Completion.from_segments(
        [
            ("model", [4], [-0.1]),
            ("model", [5], [-0.2]),
            ("env", [6], None),
            ("env", [], None),
            ("env", [7], None),
            ("model", [8], [-0.3]),
            ("env", [9, 10], None),
        ],
        0.5,
        "length",
    )
    assert [(s.kind, s.token_ids, s.logprobs) for s in c.segments or []] == [
        ("model", [4, 5], [-0.1, -0.2]),
        ("env", [6, 7], None),
        ("model", [8], [-0.3]),
    ]
    assert (c.finish_reason, c.reward) == ("length", 0.5)
    seg = Segment(kind="model", token_ids=[1], logprobs=[-0.5])
    assert Completion.from_segments([seg], None).token_ids == [1]


def test_serialised_forms_round_trip_and_single_turn_bytes_are_unchanged() -> None:
    c = traj(prompt_token_ids=[1, 2], episode=0)
    dumped = c.model_dump(mode="json")
    # Each token once: the flat fields are not serialised next to the segments.
    assert "token_ids" not in dumped and "logprobs" not in dumped
    for again in (
        Completion.model_validate_json(c.model_dump_json(), strict=True),
        Completion.model_validate(msgpack.unpackb(msgpack.packb(dumped)), strict=True),
    ):
        assert again == c and again.loss_mask() == c.loss_mask()
    # A single-turn completion serialises with exactly the keys (and bytes) it had before multi-turn existed.
    single = Completion(token_ids=[4, 5], logprobs=[-0.1, -0.2], reward=None, finish_reason="length")
    assert set(single.model_dump()) == OLD_COMPLETION_KEYS
    assert (
        single.model_dump_json() == '{"token_ids":[4,5],"logprobs":[-0.1,-0.2],"reward":null,"finish_reason":"length"}'
    )
    # A multi-turn completion without the split fields does not carry them as nulls either.
    assert set(traj().model_dump()) == {"reward", "finish_reason", "segments"}


EP_STATS = {"episodes": 2.0, "tool_calls": 3.0, "tool_errors": 1.0, "timeouts": 0.0, "gen_s": 0.75, "env_s": 0.25}


def test_episode_stats_round_trip_and_groups_without_them_serialise_as_before() -> None:
    plain = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=[1, 2],
        completions=[Completion(token_ids=[4], logprobs=[-0.5], reward=1.0, finish_reason="stop")],
    )
    # No episode_stats key at all: a single-turn group's bytes (and a batch's digest) are what they were.
    assert plain.model_dump_json() == (
        '{"prompt_id":"0-0","prompt_index":0,"prompt_token_ids":[1,2],"completions":[{"token_ids":[4],'
        '"logprobs":[-0.5],"reward":1.0,"finish_reason":"stop"}],"reward_errors":{}}'
    )
    assert "episode_stats" not in msgpack.unpackb(packb(plain))
    with_stats = plain.model_copy(update={"completions": [traj()], "episode_stats": EP_STATS})
    for group in (plain, with_stats):
        assert RolloutGroup.model_validate_json(group.model_dump_json(), strict=True) == group
        assert RolloutGroup.model_validate(msgpack.unpackb(packb(group)), strict=True) == group
        kept = validate_keeping_arrays(RolloutGroup, msgpack.unpackb(packb(group)))
        assert kept.episode_stats == group.episode_stats


@pytest.mark.parametrize(
    ("stats", "needle"),
    [
        ({"tool_calls": float("nan")}, "finite"),
        ({"tool_calls": -1.0}, "greater than or equal to 0"),
        ({"Tool Calls": 1.0}, "should match pattern"),
        ({"x" * 33: 1.0}, "at most 32 characters"),
        ({f"k{i}": 1.0 for i in range(17)}, "at most 16 items"),
        ({"tool_calls": "many"}, "valid number"),
    ],
)
def test_bad_episode_stats_are_refused(stats: dict[str, Any], needle: str) -> None:
    data = {"prompt_id": "0-0", "prompt_index": 0, "prompt_token_ids": [1], "completions": [traj().model_dump()]}
    with pytest.raises(ValidationError, match="episode_stats") as exc:
        RolloutGroup.model_validate({**data, "episode_stats": stats})
    assert needle in str(exc.value)


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as exc:
        Completion.model_validate(data)
    return str(exc.value)


MODEL = {"kind": "model", "token_ids": [4, 5], "logprobs": [-0.5, -1.0]}
ENV = {"kind": "env", "token_ids": [6]}


@pytest.mark.parametrize(
    ("segments", "extra", "needle"),
    [
        ([MODEL, {**ENV, "logprobs": [-0.1]}, MODEL], {}, "an env segment carries none"),
        ([{"kind": "model", "token_ids": [4]}], {}, "a model segment needs one behaviour logprob"),
        (
            [{"kind": "model", "token_ids": [4, 5], "logprobs": [-0.1]}],
            {},
            "logprobs has 1 entries but token_ids has 2",
        ),
        ([{"kind": "model", "token_ids": [4], "logprobs": [0.5]}], {}, "logprobs[0] = 0.5"),
        ([{"kind": "model", "token_ids": [-4], "logprobs": [-0.5]}], {}, "token_ids must be >= 0"),
        ([{"kind": "model", "token_ids": [], "logprobs": []}], {}, "at least 1 item"),
        ([{"kind": "tool", "token_ids": [4]}], {}, "'model' or 'env'"),
        ([ENV, MODEL], {}, "segments[0]: the first and last segments must be model"),
        ([MODEL, ENV], {}, "segments[1]: the first and last segments must be model"),
        ([MODEL, MODEL], {}, "segments[1]: two model segments in a row"),
        ([], {}, "at least 1 item"),
        ([MODEL], {"token_ids": [4, 5], "logprobs": [-0.5, -1.0]}, "derived from segments; send segments alone"),
    ],
)
def test_bad_segments_are_refused_naming_what_is_wrong(
    segments: list[dict[str, Any]], extra: dict[str, Any], needle: str
) -> None:
    assert needle in _error({"segments": segments, "reward": 1.0, **extra})


def test_single_turn_rules_hold() -> None:
    assert "at least 1 token" in _error({"reward": 1.0})
    assert "belong to multi-turn completions" in _error(
        {"token_ids": [4], "logprobs": [-1.0], "reward": 1.0, "prompt_token_ids": [1]}
    )
    assert "belong to multi-turn completions" in _error(
        {"token_ids": [4], "logprobs": [-1.0], "reward": 1.0, "episode": 0}
    )


def _group(completions: list[Completion]) -> dict[str, Any]:
    return {
        "prompt_id": "0-0",
        "prompt_index": 0,
        "prompt_token_ids": [1, 2, 3],
        "completions": [c.model_dump() for c in completions],
    }


def test_split_episodes_are_consecutive_and_share_reward_and_finish_reason() -> None:
    group = RolloutGroup.model_validate(
        _group([traj(1.0, episode=0), traj(1.0, episode=0, prompt_token_ids=[1, 2, 3, 4, 5, 6]), traj(0.0, episode=1)])
    )
    assert group.episodes() == [[0, 1], [2]]
    assert group.prompt_of(group.completions[1]) == [1, 2, 3, 4, 5, 6]
    assert group.prompt_of(group.completions[0]) == [1, 2, 3]
    assert RolloutGroup.model_validate(_group([traj(), traj()])).episodes() == [[0], [1]]
    bad = [
        ([traj(episode=1), traj(episode=1)], "completions[0].episode: 1, expected 0"),
        ([traj(episode=0), traj(episode=1), traj(episode=0)], "completions[2].episode: 0, expected 2"),
        ([traj(episode=0), traj()], "completions[1].episode: set on some completions"),
        ([traj(1.0, episode=0), traj(0.0, episode=0)], "samples of episode 0 must repeat its reward"),
        ([traj(episode=0), traj(episode=0, finish_reason="abort")], "samples of episode 0 must repeat"),
    ]
    for comps, needle in bad:
        with pytest.raises(ValidationError) as exc:
            RolloutGroup.model_validate(_group(comps))
        assert needle in str(exc.value), (needle, str(exc.value))


def test_run_spec_episode_limits_have_defaults_and_bounds() -> None:
    base = {"base_model": "m", "reward": {"name": "toy"}, "dataset": {"uri": "toy:digits", "size": 4}, "vocab_size": 64}
    spec = RunSpec.model_validate(base)
    assert (spec.episode.max_turns, spec.episode.episode_timeout_s, spec.episode.max_episode_tokens) == (8, 300.0, 4096)
    custom = RunSpec.model_validate(
        {**base, "episode": {"max_turns": 3, "episode_timeout_s": 5, "max_episode_tokens": 99}}
    )
    assert custom.episode.max_turns == 3
    for bad in ({"max_turns": 0}, {"episode_timeout_s": 0}, {"max_episode_tokens": 1}, {"max_turn": 3}):
        with pytest.raises(ValidationError):
            RunSpec.model_validate({**base, "episode": bad})


def test_a_multi_turn_run_with_eval_is_refused() -> None:
    """Generators evaluate single completions only: a multi-turn run asking for eval would never be evaluated."""
    base = {"base_model": "m", "reward": {"name": "toy"}, "dataset": {"uri": "toy:digits", "size": 4}, "vocab_size": 64}
    RunSpec.model_validate({**base, "eval": {"every": 2}})
    RunSpec.model_validate({**base, "env": {"name": "toy:tools"}})
    with pytest.raises(ValidationError, match="not supported for multi-turn runs"):
        RunSpec.model_validate({**base, "env": {"name": "toy:tools"}, "eval": {"every": 2}})


# -- the proxy ------------------------------------------------------------------------------------------


def _multi_turn_batch(s: Setup, comps_of: Any, **group_kw: Any) -> RolloutBatch:
    single = s.batch(1)
    group = single.groups[0].model_copy(update={"completions": comps_of(), **group_kw})
    return single.model_copy(update={"groups": [group]})


def test_multi_turn_batches_round_trip_through_the_proxy(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=8, groups_per_step=4)
    plain = _multi_turn_batch(s, lambda: [traj(1.0), traj(0.0)])
    split = _multi_turn_batch(
        s,
        lambda: [
            traj(1.0, episode=0),
            traj(1.0, episode=0, prompt_token_ids=[1, 2, 3, 4, 5, 6, 7]),
            traj(0.0, episode=1),
        ],
        episode_stats=EP_STATS,
    )
    assert s.g.submit_rollouts(plain, "mt-json", use_msgpack=False).accepted_groups == 1
    assert s.g.submit_rollouts(split, "mt-msgpack", use_msgpack=True).accepted_groups == 1
    got = s.t.claim("trainer-0", max_groups=2)
    groups = [d.groups[0] for d in got.deliveries]
    assert groups == [plain.groups[0], split.groups[0]]  # bit-exact through both encodings and the bucket
    assert (groups[0].episode_stats, groups[1].episode_stats) == ({}, EP_STATS)
    assert groups[1].episodes() == [[0, 1], [2]]
    assert groups[0].completions[0].loss_mask() == [1, 1, 0, 0, 0, 1]


def test_bad_trajectories_get_422_naming_the_field_and_change_nothing(proxy_file: ProxyHarness) -> None:
    # vocab 64, max_new_tokens 4 per model turn, 2 turns and 12 tokens (prompt included) per sample.
    s = Setup(
        proxy_file,
        queue_capacity_groups=8,
        groups_per_step=4,
        sampling={"max_new_tokens": 4},
        episode={"max_turns": 2, "max_episode_tokens": 12},
    )
    good = _multi_turn_batch(s, lambda: [traj(1.0), traj(0.0)])
    raw = good.model_dump(mode="json")
    seg = ["groups", 0, "completions", 1, "segments"]

    def edit(path: list[Any], value: Any) -> dict[str, Any]:
        body = json.loads(json.dumps(raw))
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return body

    many_tokens = {"kind": "env", "token_ids": list(range(10, 20))}
    three_turns = [MODEL, ENV, MODEL, ENV, MODEL]
    cases = [
        (edit([*seg, 1, "logprobs"], [-0.1, -0.1, -0.1]), "body.groups.0.completions.1.segments.1", "an env segment"),
        (edit([*seg, 0, "logprobs"], None), "body.groups.0.completions.1.segments.0", "a model segment needs"),
        (edit([*seg, 0, "logprobs"], [-0.5]), "body.groups.0.completions.1.segments.0", "logprobs has 1 entries"),
        (edit([*seg, 1, "token_ids", 2], 64), "groups[0].completions[1].segments[1].token_ids[2]", ">= vocab_size 64"),
        (edit([*seg, 2, "token_ids", 0], 99), "groups[0].completions[1].segments[2].token_ids[0]", ">= vocab_size 64"),
        (edit([*seg, 1], many_tokens), "groups[0].completions[1].segments", "more than episode.max_episode_tokens 12"),
        (edit(seg, three_turns), "groups[0].completions[1].segments", "3 model turns, more than episode.max_turns 2"),
        (
            edit([*seg, 0], {"kind": "model", "token_ids": [1] * 5, "logprobs": [-1.0] * 5}),
            "groups[0].completions[1].segments[0].token_ids",
            "more than the sampling's max_new_tokens 4",
        ),
        (edit([*seg, 1], MODEL), "body.groups.0.completions.1", "two model segments in a row"),
        (edit(["groups", 0, "completions", 1, "token_ids"], [4]), "body.groups.0.completions.1", "send segments alone"),
        (
            edit(["groups", 0, "completions", 1, "prompt_token_ids"], [1, 70]),
            "groups[0].completions[1].prompt_token_ids[1]",
            ">= vocab_size 64",
        ),
    ]
    with proxy_file.http("generator") as http:
        for i, (body, where, what) in enumerate(cases):
            for ctype in ("application/json", "application/msgpack"):
                content = msgpack.packb(body) if ctype == "application/msgpack" else json.dumps(body).encode()
                r = http.post(
                    s.path("/rollouts"), content=content, headers={"Content-Type": ctype, "Idempotency-Key": f"b{i}"}
                )
                msg = r.json()["error"]["message"]
                assert r.status_code == 422 and where in msg and what in msg, (i, ctype, msg)
        # Split episodes: G episodes (not completions), each within max_turns over all of its samples.
        for key, comps, where, what in [
            ("e1", [traj(1.0, episode=0), traj(1.0, episode=0)], "groups[0].completions", "1 episodes, the run's"),
            (
                "e2",
                [traj(1.0, episode=0), traj(1.0, episode=0, prompt_token_ids=[1]), traj(0.0, episode=1)],
                "groups[0].completions[0].segments",
                "episode 0 has 4 model turns over its 2 samples, more than episode.max_turns 2",
            ),
        ]:
            body = _multi_turn_batch(s, lambda comps=comps: comps).model_dump(mode="json")
            r = http.post(s.path("/rollouts"), json=body, headers={"Idempotency-Key": key})
            msg = r.json()["error"]["message"]
            assert r.status_code == 422 and where in msg and what in msg, (key, msg)
    st = proxy_file.client(s.run, "viewer").status()
    assert (st.queue.groups, st.queue.accepted_total) == (0, 0)
    # The good batch is still accepted afterwards (its prompt lease untouched by the refusals).
    assert s.g.submit_rollouts(good, "ok").accepted_groups == 1


def test_openapi_documents_segments(proxy_file: ProxyHarness) -> None:
    schema = httpx.get(f"{proxy_file.url}/openapi.json").json()["components"]["schemas"]
    completion = next(v for k, v in schema.items() if k.startswith("Completion"))
    assert {"segments", "prompt_token_ids", "episode", "token_ids", "logprobs"} <= set(completion["properties"])
    assert any(k.startswith("Segment") for k in schema)


def test_a_large_multi_turn_batch_decodes_off_the_loop_and_round_trips(proxy_file: ProxyHarness) -> None:
    """Over 256 KiB a body is validated in the decoder child and comes back pickled: the derived flat fields and
    the loss mask survive, and the claim answers the same group."""
    s = Setup(proxy_file, queue_capacity_groups=8, groups_per_step=4, episode={"max_episode_tokens": 200_000})
    env = [(7 * i) % 64 for i in range(60_000)]

    def comps() -> list[Completion]:
        return [
            Completion.from_segments([("model", [4], [-0.5]), ("env", env, None), ("model", [9, 10], [-1.0, -0.5])], r)
            for r in (1.0, 0.0)
        ]

    batch = _multi_turn_batch(s, comps)
    assert len(batch.model_dump_json()) > 300_000
    assert s.g.submit_rollouts(batch, "big", use_msgpack=False).accepted_groups == 1
    got = s.t.claim("trainer-0", max_groups=1).deliveries[0].groups[0]
    assert got == batch.groups[0]
    assert got.completions[0].loss_mask() == [1] + [0] * len(env) + [1, 1]
