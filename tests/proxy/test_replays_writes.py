"""Issue 10's replay rule for the remaining write routes: trainer registration, run spec PUT, dataset PUT, metrics
push and eval submit. Each request is replayed concurrently and after it completed; where the route writes the
bucket, that write is slowed past the client's timeout (``SlowStore``), so the client's own transport retries
are the concurrent replays. Harness and helpers: ``test_replays.py`` (bucket-slowing), ``test_replays_leases.py``
(lost answers, simultaneous sends)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bucketrl.proxy.state import evals
from bucketrl.wire import MetricsPush
from tests.proxy.harness import ProxyHarness, adapter_tar, make_spec
from tests.proxy.test_evals import EVAL, result
from tests.proxy.test_replays import _impatient, _slow
from tests.proxy.test_replays_leases import _at_once, _losing
from tests.proxy.test_rollouts_routes import Setup


def test_trainer_registration_replayed_keeps_its_epoch(proxy_file: ProxyHarness) -> None:
    """The epoch record's bucket write outlasts the client: the old route took a new epoch on every retry (the
    client ended up with whichever answered, and a late replay fenced the live trainer). Replays of one
    registration answer the epoch its first attempt took, once its record is in the bucket."""
    s = Setup(proxy_file)  # trainer-0: epoch 1
    slow = _slow(proxy_file, slow_keys=("/trainer-epochs/",))
    t = _impatient(proxy_file, "trainer")
    reg = t.register_trainer("trainer-1")
    assert reg.epoch == 2 and t.epoch == 2
    assert s.t.get_run().state.trainer_epoch == 2
    assert slow.inner.get_bytes("runs/r1/trainer-epochs/000000000002") == b"trainer-1"
    slow.slow_writes = False
    body = {"worker_id": "trainer-1", "request_id": "reg-1"}
    with proxy_file.http("trainer") as h:
        first = h.post("/v1/runs/r1/trainer", json=body).json()
    assert first["epoch"] == 3
    answers = _at_once(proxy_file, lambda h: h.post("/v1/runs/r1/trainer", json=body), role="trainer")
    assert [r.json() for r in answers] == [first] * len(answers)  # concurrently and after completion
    assert s.t.get_run().state.trainer_epoch == 3
    # A registration of its own (another request id) still fences the older one.
    assert proxy_file.client("r1", "trainer").register_trainer("trainer-2").epoch == 4


def test_run_put_replayed_answers_the_same_run(proxy_file: ProxyHarness) -> None:
    """Creating a run writes run.json (slowed): the retries confirm the one run, the bucket holds its spec."""
    spec = make_spec()
    slow = _slow(proxy_file, slow_keys=("/run.json",))
    info = _impatient(proxy_file, "trainer").put_run(spec)
    assert info.spec == spec and info.state.latest_version == 0
    slow.slow_writes = False
    assert json.loads(slow.inner.get_bytes("runs/r1/run.json")) == json.loads(spec.model_dump_json())
    body = json.loads(spec.model_dump_json(by_alias=True))
    answers = _at_once(proxy_file, lambda h: h.put("/v1/runs/r1", json=body), role="trainer")
    assert {r.status_code for r in answers} == {200}
    assert all(r.json() == answers[0].json() for r in answers)
    assert proxy_file.client("r1", "viewer").get_run().spec == spec


def test_a_slow_run_put_never_leaves_an_older_spec_in_the_bucket(proxy_file: ProxyHarness) -> None:
    """A PUT whose run.json write is slow lands after a newer PUT's: the bucket (what a rebuild restores) must
    end with the newer spec, not the late one (it did)."""
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())
    older, newer = make_spec(max_staleness=2), make_spec(max_staleness=3)
    slow = _slow(proxy_file, slow_keys=("/run.json",), slow_s=2.0)
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(proxy_file.client("r1", "trainer", timeout_s=30.0).put_run, older)
        assert slow.slowing.wait(30)  # its write of the older spec is under way
        slow.slow_writes = False
        assert t.put_run(newer).spec == newer
        late.result(60)
    assert json.loads(slow.inner.get_bytes("runs/r1/run.json")) == json.loads(newer.model_dump_json())
    assert t.get_run().spec == newer


def test_dataset_put_replayed_stores_it_once(proxy_file: ProxyHarness) -> None:
    """The dataset's bucket writes outlast the client: its retries wait for the first attempt's lock and answer
    what it stored (the same DatasetInfo, not 409)."""
    spec = make_spec(dataset={"uri": "bucket:dataset.jsonl", "size": 3})
    t = proxy_file.client("r1", "trainer")
    t.put_run(spec)
    data = b"".join(json.dumps({"prompt": f"{i}+1="}).encode() + b"\n" for i in range(3))
    _slow(proxy_file, slow_keys=("/dataset",))
    info = _impatient(proxy_file, "trainer", timeout_s=2.0).upload_dataset(data)
    assert (info.rows, info.bytes) == (3, len(data))
    proxy_file.ctx.store.slow_writes = False  # type: ignore[attr-defined]
    answers = _at_once(proxy_file, lambda h: h.put("/v1/runs/r1/dataset", content=data), n=4, role="trainer")
    assert {r.status_code for r in answers} == {200}
    assert {r.text for r in answers} == {info.model_dump_json()}
    assert proxy_file.client("r1", "generator").download_dataset() == data


def _steps(proxy: ProxyHarness) -> list[int]:
    with proxy.http("viewer") as h:
        return [m["step"] for m in h.get("/v1/runs/r1/metrics/recent").json()]


def test_metrics_push_replayed_or_late_is_recorded_once(proxy_file: ProxyHarness) -> None:
    """A push's retry used to add a second point to the run's series, and a push arriving after a newer one put
    the trainer's step (and a generator's loaded versions) back. Pushes are numbered per client session."""
    s = Setup(proxy_file)
    t, lose = _losing(proxy_file, "/metrics", role="trainer")
    t.push_metrics(MetricsPush(worker_id="trainer-0", step=5, metrics={"loss": 1.0}))
    assert lose.sent == 1
    assert _steps(proxy_file) == [5]
    late = MetricsPush(worker_id="trainer-0", step=6, metrics={"loss": 0.5}, session="s1", seq=1)
    newer = late.model_copy(update={"step": 7, "seq": 2})
    push = newer.model_dump_json()
    answers = _at_once(proxy_file, lambda h: h.post("/v1/runs/r1/metrics", content=push), role="trainer")
    assert {r.status_code for r in answers} == {204}
    with proxy_file.http("trainer") as h:
        assert h.post("/v1/runs/r1/metrics", content=late.model_dump_json()).status_code == 204
    assert _steps(proxy_file) == [5, 7]
    assert s.t.get_run().state.trainer_step == 7
    # A restarted worker (a new session) starts its numbering again, and is heard.
    s.t.push_metrics(MetricsPush(worker_id="trainer-0", step=2))
    assert s.t.get_run().state.trainer_step == 2


def test_eval_submit_replayed_counts_once(proxy_file: ProxyHarness) -> None:
    """The submit that completes a version writes its result to the bucket (slowed): its retries count nothing
    again and the version's result is the one of a single delivery."""
    s = Setup(proxy_file, eval=EVAL)
    s.t.publish_adapter(2, adapter_tar(2))
    assert len(s.g.lease_eval("gen-0", [1], n=3).items) == 3
    s.g.submit_eval("gen-0", [result(1, 0, [1.0, 0.5]), result(1, 1, [0.0, 1.0])])
    _slow(proxy_file, slow_keys=("/eval",))
    last = [result(1, 2, [1.0, 1.0])]
    _impatient(proxy_file, "generator", timeout_s=1.0).submit_eval("gen-0", last)
    proxy_file.ctx.store.slow_writes = False  # type: ignore[attr-defined]
    body = json.loads(s.g.submit_eval("gen-0", last).model_dump_json())  # after completion
    assert (body["accepted"], body["duplicates"]) == (0, 1)
    (res,) = s.g.eval_results()
    assert (res.version, res.prompts, res.samples) == (1, 3, 6)
    assert res.reward_mean == (1.0 + 0.5 + 0.0 + 1.0 + 1.0 + 1.0) / 6


def test_eval_lease_replayed_gets_the_same_prompts(proxy_file: ProxyHarness) -> None:
    """A replay (same request id) of an eval lease answers the prompts its first attempt leased: the old route
    leased more on every replay (held until they expired, delaying the version's result)."""
    s = Setup(proxy_file, eval=EVAL)
    c, lose = _losing(proxy_file, "/eval/lease")
    got = c.lease_eval("gen-0", [1], n=1)
    assert lose.sent == 1 and [(i.version, i.index) for i in got.items] == [(1, 0)]
    body = {"worker_id": "gen-1", "versions": [1], "n": 1, "request_id": "ev-1"}
    answers = _at_once(proxy_file, lambda h: h.post("/v1/runs/r1/eval/lease", json=body))
    assert [r.json() for r in answers] == [{"items": [{"version": 1, "index": 1}]}] * len(answers)
    with proxy_file.http("generator") as h:  # after completion
        assert h.post("/v1/runs/r1/eval/lease", json=body).json() == answers[0].json()
    assert [(i.version, i.index) for i in s.g.lease_eval("gen-2", [1], n=8).items] == [(1, 2)]


def test_eval_leases_follow_redis_time_not_a_replicas_clock(
    proxy_file: ProxyHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 10 item 10 for eval leases: a replica whose clock runs 400 s ahead must not take another
    generator's live eval prompts as expired."""
    s = Setup(proxy_file, eval=EVAL)
    assert len(s.g.lease_eval("gen-0", [1], n=2).items) == 2
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 400)
    got = proxy_file.call(lambda ctx: evals.lease(ctx.redis, ctx.store, "r1", s.spec, [1], 8, 60))
    monkeypatch.setattr(time, "time", real)
    assert [i.index for i in got.items] == [2]
