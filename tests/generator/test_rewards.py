"""Reward registry and the scoring pool: tricky inputs, and rewards that raise, hang, crash or lie."""

from __future__ import annotations

import time

import pytest

from bucketrl import errors
from bucketrl.rewards import (
    RewardItem,
    RewardPool,
    exact_reward,
    extract_boxed,
    extract_final_answer,
    math_reward,
    regex_reward,
    resolve_reward,
    validate_reward,
)
from bucketrl.wire import RewardSpec

FIX = "tests.generator.reward_fixtures"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (r"so \boxed{42}", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{{a}+{b}}", "{a}+{b}"),
        (r"\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text: str, want: str | None) -> None:
    assert extract_boxed(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("the answer is 12, not 13", "13"),
        ("x = -3.5.", "-3.5"),
        ("1,234 apples", "1,234"),
        ("ratio 3/4", "3/4"),
        (r"\boxed{7} and later 9", "7"),
        (r"\boxed{} but 5", "5"),
        ("nothing numeric", None),
    ],
)
def test_extract_final_answer(text: str, want: str | None) -> None:
    assert extract_final_answer(text) == want


@pytest.mark.parametrize(
    ("completion", "answer", "want"),
    [
        (r"thus \boxed{42}", "42", 1.0),
        ("the answer is 42", "42", 1.0),
        ("the answer is 42.0", "42", 1.0),
        ("1,000 total", "1000", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\sqrt{4}}", "2", 1.0),  # symbolic: math_verify
        (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        (r"\boxed{41}", "42", 0.0),
        ("42 was wrong, it is 43", "42", 0.0),
        ("", "42", 0.0),
        (r"\boxed{{{{", "42", 0.0),
        ("}}}\\boxed}{ $$ \\frac{", "1", 0.0),
        ("9" * 5000, "9", 0.0),
        ("\x00\ufffd garbage \U0001f600", "1", 0.0),
        (r"\boxed{42}", r"\boxed{42}", 1.0),
    ],
)
def test_math_reward(completion: str, answer: str, want: float) -> None:
    assert math_reward(completion, answer, prompt="p") == want


def test_math_reward_without_reference_is_unscorable() -> None:
    assert math_reward(r"\boxed{1}", None, prompt="p") is None
    assert math_reward(r"\boxed{1}", "  ", prompt="p") is None


def test_exact_and_regex() -> None:
    assert exact_reward(" yes\n", "yes", prompt="") == 1.0
    assert exact_reward("Yes", "yes", prompt="") == 0.0
    assert exact_reward("Yes", "yes", prompt="", case_sensitive=False) == 1.0
    assert exact_reward("yes ", "yes", prompt="", strip=False) == 0.0
    assert exact_reward("x", None, prompt="") is None
    assert regex_reward("answer: 12", "12", prompt="", pattern=r"answer:\s*(\d+)") == 1.0
    assert regex_reward("answer: 13", "12", prompt="", pattern=r"answer:\s*(\d+)") == 0.0
    assert regex_reward("no answer", "12", prompt="", pattern=r"answer:\s*(\d+)") == 0.0
    assert regex_reward("DONE", None, prompt="", pattern="done", ignore_case=True) == 1.0
    assert regex_reward(" 123 ", r"\d+", prompt="") == 1.0
    assert regex_reward("123x", r"\d+", prompt="") == 0.0


def test_resolve_and_validate_refuse_bad_names_and_kwargs() -> None:
    assert resolve_reward("math") is math_reward
    assert resolve_reward(f"{FIX}:length_reward")("abc", None, prompt="") == 3
    for bad, needle in [
        ("nope", "not one of"),
        ("no_such_module_xyz:fn", "cannot import"),
        (f"{FIX}:missing", "no callable"),
        (f"{FIX}:not_callable", "no callable"),
    ]:
        with pytest.raises(errors.Invalid, match=needle):
            resolve_reward(bad)
    with pytest.raises(errors.Invalid, match="does not accept"):
        validate_reward(RewardSpec(name="exact", kwargs={"casesensitive": False}))
    with pytest.raises(errors.Invalid, match="valid regex"):
        validate_reward(RewardSpec(name="regex", kwargs={"pattern": "(unclosed"}))
    validate_reward(RewardSpec(name=f"{FIX}:length_reward", kwargs={"scale": 2.0}))


def test_pool_scores_in_order_with_kwargs() -> None:
    with RewardPool(RewardSpec(name=f"{FIX}:length_reward", kwargs={"scale": 0.5}), workers=2) as pool:
        items = [RewardItem("x" * i, None, "p") for i in range(7)]
        assert pool.score(items) == [0.5 * i for i in range(7)]
        assert pool.unscorable_total == 0


def test_pool_math_reward_in_processes() -> None:
    with RewardPool(RewardSpec(name="math"), workers=1, timeout_s=30) as pool:
        got = pool.score([RewardItem(r"\boxed{\frac{2}{4}}", "0.5", ""), RewardItem("7", "8", "")])
    assert got == [1.0, 0.0]


@pytest.mark.parametrize(
    ("fn", "counter"), [("raises", "errors_total"), ("hangs", "timeouts_total"), ("dies", "crashes_total")]
)
def test_pool_survives_bad_rewards(fn: str, counter: str) -> None:
    """A reward that raises, hangs or kills its process gives None for that item; the pool keeps working."""
    with RewardPool(RewardSpec(name=f"{FIX}:{fn}"), workers=2, timeout_s=1.5) as pool:
        t0 = time.monotonic()
        got = pool.score([RewardItem("ok", None, ""), RewardItem("bad", None, ""), RewardItem("ok", None, "")])
        assert got == [1.0, None, 1.0]
        assert time.monotonic() - t0 < 20
        assert getattr(pool, counter) == 1
        assert pool.unscorable_total == 1
        # Still alive and correct afterwards, with every process usable.
        assert pool.score([RewardItem("ok", None, "")] * 4) == [1.0] * 4


def test_pool_reports_each_failure_as_it_happens() -> None:
    """A reward that hangs costs its timeout per item: the first failure is known (on_failure, which the generator
    pushes as a note: live view, dashboard, status) a whole timeout before the batch's results are."""
    seen: list[tuple[float, str | None]] = []
    hook = lambda r: seen.append((time.monotonic(), r.kind))  # noqa: E731
    # hang_probe=0: two hung items in a row would otherwise end the batch (see the next test).
    pool = RewardPool(RewardSpec(name=f"{FIX}:hangs"), workers=1, timeout_s=1.5, on_failure=hook, hang_probe=0)
    with pool:
        got = pool.score_detailed([RewardItem(c, None, "") for c in ("a", "b", "ok")])
        done = time.monotonic()
    assert [r.kind for r in got] == ["timeout", "timeout", None]
    assert [k for _, k in seen] == ["timeout", "timeout"]
    assert seen[0][0] < done - 1.0, (seen, done)


def test_a_reward_that_hangs_on_everything_costs_a_batch_two_deadlines() -> None:
    """Once the first hang_probe (2 x workers) completions of a batch all time out and none answered, the rest of
    the batch is timed out without a call: 2 rounds of deadlines, not one per completion (12 x 1.5 s / 2 = 9 s)."""
    with RewardPool(RewardSpec(name=f"{FIX}:hangs"), workers=2, timeout_s=1.5) as pool:
        assert pool.hang_probe == 4
        t0 = time.monotonic()
        got = pool.score_detailed([RewardItem(f"bad{i}", None, "") for i in range(12)])
        seconds = time.monotonic() - t0
        assert [r.kind for r in got] == ["timeout"] * 12
        assert pool.timeouts_total == 4 and pool.skipped_total == 8 and pool.unscorable_total == 12
        assert sum("not called on this one" in (r.message or "") for r in got) == 8
        assert all("BUCKETRL_REWARD_TIMEOUT_S" in (r.message or "") for r in got)
        assert seconds < 8, seconds  # 2 deadlines side by side, twice, + respawns (was 6 deadlines: 9 s)
        assert pool.hanging  # a shutting-down generator does not wait for it
        # The next batch is probed again: a reward that recovers is scored.
        assert pool.score([RewardItem("ok", None, "")] * 3) == [1.0] * 3
        assert not pool.hanging


def test_a_reward_that_answers_is_never_skipped() -> None:
    """One answer in the batch ends the probe: a reward that hangs on some completions is called on every one."""
    with RewardPool(RewardSpec(name=f"{FIX}:hangs"), workers=1, timeout_s=1.0, hang_probe=2) as pool:
        got = pool.score([RewardItem(c, None, "") for c in ("ok", "bad", "bad", "bad", "ok")])
        assert got == [1.0, None, None, None, 1.0]
        assert pool.timeouts_total == 3 and pool.skipped_total == 0


def test_pool_turns_garbage_results_into_none() -> None:
    with RewardPool(RewardSpec(name=f"{FIX}:garbage"), workers=1) as pool:
        assert pool.score([RewardItem(c, None, "") for c in ("nan", "str", "inf", "fine")]) == [None, None, None, 0.5]
        assert pool.unscorable_total == 3


def test_pool_refuses_unknown_reward_before_starting() -> None:
    with pytest.raises(errors.Invalid):
        RewardPool(RewardSpec(name="nope"))


def test_pool_score_can_be_cancelled() -> None:
    import threading

    cancel = threading.Event()
    with RewardPool(RewardSpec(name=f"{FIX}:sleepy", kwargs={"seconds": 60}), workers=1, timeout_s=120) as pool:
        threading.Timer(1.0, cancel.set).start()
        t0 = time.monotonic()
        assert pool.score([RewardItem("a", None, "")] * 3, cancel=cancel) == [None, None, None]
        assert time.monotonic() - t0 < 10
        assert pool.unscorable_total == 3


def test_toy_reward_through_the_registry_and_pool() -> None:
    fn = resolve_reward("toy")
    assert fn("2468", "even", prompt="even:", length=4) == 1.0
    assert fn("1357", "even", prompt="even:", length=4) == pytest.approx(0.1)
    validate_reward(RewardSpec(name="toy", kwargs={"task": "digits", "length": 4}))
    with RewardPool(RewardSpec(name="toy", kwargs={"length": 4}), workers=1) as pool:
        # A missing answer makes the toy reward raise: unscorable, not a dead pool.
        got = pool.score([RewardItem("2468", "even", "even:"), RewardItem("2468", None, "even:")])
    assert got == [1.0, None]


@pytest.mark.parametrize("fn", ["hangs", "dies"])
def test_only_the_bad_item_of_a_chunk_is_lost(fn: str) -> None:
    """Items travel in chunks; a hung or fatal item costs only itself, the rest of its chunk is scored."""
    with RewardPool(RewardSpec(name=f"{FIX}:{fn}"), workers=1, timeout_s=1.5) as pool:
        got = pool.score([RewardItem(c, None, "") for c in ("ok", "bad", "ok", "ok", "ok")])
    assert got == [1.0, None, 1.0, 1.0, 1.0]
