"""Completion jobs on a real proxy over real Redis (``bucketrl.proxy.state.completion_jobs``): a retried submit is
the same job, two generators never get the same job, the first result wins, an expired lease is offered again
first, long-polls wake on a result and on a publish, and bad input is refused with nothing changed."""

from __future__ import annotations

import threading
import time

import pytest

from bucketrl import errors
from bucketrl.wire.common import MAX_PROMPT_TOKENS
from bucketrl.wire.completion_jobs import CompletionChoice, CompletionJobRequest, CompletionJobResult
from tests.proxy.harness import ProxyHarness, adapter_tar
from tests.proxy.test_rollouts_routes import Setup


def job(rid: str, version: int | None = 1, **kw: object) -> CompletionJobRequest:
    return CompletionJobRequest.model_validate(
        {"request_id": rid, "version": version, "prompt_token_ids": [1, 2, 3], "max_tokens": 4, **kw}
    )


def answer(req: CompletionJobRequest, worker: str = "gen-0", tokens: list[int] | None = None) -> CompletionJobResult:
    toks = tokens if tokens is not None else [5, 6]
    choice = CompletionChoice(token_ids=toks, logprobs=[-0.5] * len(toks), finish_reason="length")
    return CompletionJobResult(
        request_id=req.request_id, worker_id=worker, version=req.version, choices=[choice] * req.n
    )


def test_submit_is_idempotent_and_the_first_result_wins(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file)
    a = job("a")
    assert s.t.submit_completion_job(a).state == "queued"
    assert s.t.submit_completion_job(a).state == "queued"  # a retry: the same job, not a second one
    with pytest.raises(errors.Conflict, match="names another"):
        s.t.submit_completion_job(job("a", max_tokens=3))
    s.t.submit_completion_job(job("base", version=None))

    got = s.g.lease_completion_jobs("gen-0", loaded_versions=[1]).jobs
    assert sorted(j.job.request_id for j in got) == ["a", "base"]
    assert s.g.lease_completion_jobs("gen-1").jobs == []  # two generators never hold the same job
    assert s.t.submit_completion_job(a).state == "leased"
    assert s.t.wait_completion_job("a", wait_s=0) is None

    s.g.post_completion_result(answer(a, "gen-0", [7]))
    assert s.g.post_completion_result(answer(a, "gen-1", [8, 9])).state == "done"  # answered 200 ...
    res = s.t.wait_completion_job("a", wait_s=0)
    assert res is not None and (res.worker_id, res.choices[0].token_ids) == ("gen-0", [7])  # ... the first kept
    assert s.t.submit_completion_job(a).state == "done"


def test_an_expired_lease_is_offered_again_first(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file)
    for rid in ("old", "new"):
        s.t.submit_completion_job(job(rid))
    (lost,) = s.g.lease_completion_jobs("gen-dead", max_jobs=1, ttl_s=0.2).jobs  # leases and never answers
    assert lost.job.request_id == "old"
    time.sleep(0.4)
    again = s.g.lease_completion_jobs("gen-1", max_jobs=1).jobs
    assert [j.job.request_id for j in again] == ["old"]  # before "new", never leased
    assert [j.job.request_id for j in s.g.lease_completion_jobs("gen-1").jobs] == ["new"]


def test_long_polls_wake_on_a_result_and_on_a_publish(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file)
    s.t.submit_completion_job(job("v2", version=2))  # not published yet: accepted, waits for it
    assert s.g.lease_completion_jobs("gen-0", wait_s=0).jobs == []
    leased: list[str] = []

    def generator() -> None:
        leased.extend(j.job.request_id for j in s.g.lease_completion_jobs("gen-0", wait_s=30).jobs)

    th = threading.Thread(target=generator)
    th.start()
    time.sleep(0.3)
    s.t.publish_adapter(2, adapter_tar(2))
    th.join(30)
    assert leased == ["v2"]

    results: list[CompletionJobResult | None] = []
    th = threading.Thread(target=lambda: results.append(s.t.wait_completion_job("v2", wait_s=30)))
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s.g.post_completion_result(answer(job("v2", version=2)))
    th.join(30)
    assert results and results[0] is not None and results[0].version == 2
    assert time.monotonic() - t0 < 20  # woken by the result, not by the end of wait_s


def test_bad_input_is_refused_and_changes_nothing(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file)
    with pytest.raises(errors.NotFound, match="nope"):
        proxy_file.client("nope", "trainer").submit_completion_job(job("a"))
    with pytest.raises(errors.Invalid, match="vocabulary"):
        s.t.submit_completion_job(job("a", prompt_token_ids=[1, 64]))  # the run's vocab_size is 64
    http = proxy_file.http("trainer")
    too_long = http.post(
        s.path("/completion-jobs"), json={"request_id": "a", "prompt_token_ids": [1] * (MAX_PROMPT_TOKENS + 1)}
    )
    assert too_long.status_code in (413, 422), too_long.text
    bad_version = http.post(s.path("/completion-jobs"), json={"request_id": "a", "version": 0, "prompt_token_ids": [1]})
    assert bad_version.status_code == 422 and "version" in bad_version.text
    with pytest.raises(errors.NotFound, match="no completion job"):
        s.t.wait_completion_job("a", wait_s=0)
    assert s.g.lease_completion_jobs("gen-0").jobs == []  # nothing was queued

    s.t.submit_completion_job(job("b", n=2))
    with pytest.raises(errors.Invalid, match="choices"):
        s.g.post_completion_result(answer(job("b", n=1)))
    with pytest.raises(errors.Invalid, match="max_tokens"):
        s.g.post_completion_result(answer(job("b", n=2), tokens=[1] * 5))
    with pytest.raises(errors.NotFound, match="no completion job"):
        s.g.post_completion_result(answer(job("zzz")))
    assert s.t.wait_completion_job("b", wait_s=0) is None  # still pending: the bad results changed nothing
    with pytest.raises(errors.Forbidden):
        s.g.submit_completion_job(job("c"))  # a generator does not queue jobs
