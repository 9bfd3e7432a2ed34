"""Prompt-lease and dataset routes over real HTTP (uvicorn + real Redis + bucket)."""

from __future__ import annotations

import json
import time

import pytest

from bucketrl import errors
from bucketrl.proxy.state import prompt_lease
from bucketrl.wire import PromptLease
from tests.proxy.harness import ProxyHarness, make_spec


def test_prompt_lease_renew_release_and_admission_over_http(proxy_file: ProxyHarness) -> None:
    spec = make_spec(dataset={"uri": "toy:digits", "size": 3}, groups_per_step=2, max_staleness=2)  # limit 4
    t = proxy_file.client("r1", "trainer")
    t.put_run(spec)
    g = proxy_file.client("r1", "generator")
    a = g.lease_prompts("gen-a", 3, ttl_s=60)
    assert [(p.prompt_id, p.index, p.pass_) for p in a.prompts] == [("0-0", 0, 0), ("0-1", 1, 0), ("0-2", 2, 0)]
    b = g.lease_prompts("gen-b", 5, ttl_s=1.5)  # partial grant up to the admission limit
    assert [p.prompt_id for p in b.prompts] == ["1-0"]
    with proxy_file.http("generator") as http:
        r = http.post("/v1/runs/r1/prompts/lease", json={"worker_id": "gen-b", "n": 1})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "backpressure" and r.json()["error"]["retryable"] is True
        r = http.post("/v1/runs/r1/prompts/renew", json={"worker_id": "gen-a", "prompt_ids": ["../x"]})
        assert r.status_code == 422 and "prompt_ids[0]" in r.json()["error"]["message"]
        r = http.post("/v1/runs/r1/prompts/lease", json={"worker_id": "gen-b", "n": 0})
        assert r.status_code == 422
    with proxy_file.http("viewer") as http:
        assert http.post("/v1/runs/r1/prompts/lease", json={"worker_id": "v", "n": 1}).status_code == 403
    st = proxy_file.client("r1", "viewer").status()
    assert (st.prompts_inflight, st.prompt_cursor) == (4, 4)

    renewed = g.renew_prompts("gen-a", ["0-0", "1-0"], ttl_s=120)
    assert [p.prompt_id for p in renewed.prompts] == ["0-0"]  # 1-0 is gen-b's
    time.sleep(max(0.0, b.expires_at - time.time()) + 0.1)  # gen-b's lease expired: 1-0 is issued again, first
    with pytest.raises(errors.Gone):
        g.renew_prompts("gen-b", ["1-0"])
    g.release_prompts("gen-a", ["0-2"])
    c = g.lease_prompts("gen-c", 4)  # room for 2 (0-0, 0-1 still leased): both are reissues, none new
    assert sorted(p.prompt_id for p in c.prompts) == ["0-2", "1-0"]
    assert proxy_file.client("r1", "viewer").status().prompt_cursor == 4


def test_dataset_upload_download(proxy: ProxyHarness) -> None:
    spec = make_spec(dataset={"uri": "bucket:dataset.jsonl", "size": 3})
    t = proxy.client("r1", "trainer")
    g = proxy.client("r1", "generator")
    t.put_run(spec)
    with pytest.raises(errors.NotFound):
        g.download_dataset()
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]
    data = ("\n".join(json.dumps(r) for r in rows) + "\n").encode()
    bad_line = data + b"[1, 2]\n"
    with pytest.raises(errors.Invalid, match="line 4"):
        t.upload_dataset(bad_line)
    with pytest.raises(errors.Invalid, match="missing the prompt field"):
        t.upload_dataset(data + b'{"question": "x"}\n')
    with pytest.raises(errors.Invalid, match="2 rows"):
        t.upload_dataset(b"\n".join(data.splitlines()[:2]))
    with pytest.raises(errors.NotFound):  # nothing was stored by the refused uploads
        g.download_dataset()
    with pytest.raises(errors.Forbidden):
        g.upload_dataset(data)
    info = t.upload_dataset(data)
    assert (info.rows, info.bytes) == (3, len(data))
    assert t.upload_dataset(data) == info  # the same bytes again: fine
    with pytest.raises(errors.Conflict):
        t.upload_dataset(data + b'{"prompt": "extra"}\n')
    assert g.download_dataset() == data
    assert proxy.client("r1", "viewer").download_dataset() == data


@pytest.mark.alone  # the wait is checked to a tenth of a second
def test_prompt_lease_long_poll_over_http(proxy_file: ProxyHarness) -> None:
    """``wait_s`` holds a refused lease until prompts are released (the pipeline announcement over Redis
    pub/sub), then grants it; a long-poll that times out answers 429 with Retry-After 0."""
    import threading

    spec = make_spec(dataset={"uri": "toy:digits", "size": 20}, groups_per_step=2, max_staleness=2)  # limit 4
    proxy_file.client("r2", "trainer").put_run(spec)
    g = proxy_file.client("r2", "generator")
    full = g.lease_prompts("gen-a", 4, ttl_s=60)
    with proxy_file.http("generator") as http:
        for bad in ({"wait_s": 61}, {"wait_s": -1}, {"version": 0}):
            r = http.post("/v1/runs/r2/prompts/lease", json={"worker_id": "gen-b", "n": 1, **bad})
            assert r.status_code == 422 and next(iter(bad)) in r.json()["error"]["message"], r.text
        t0 = time.monotonic()
        r = http.post("/v1/runs/r2/prompts/lease", json={"worker_id": "gen-b", "n": 1, "wait_s": 0.5})
        assert r.status_code == 429 and r.headers["Retry-After"] == "0" and time.monotonic() - t0 >= 0.5

    got: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: got.update(lease=g.lease_prompts("gen-b", 3, ttl_s=60, wait_s=20)))
    t0 = time.monotonic()
    waiter.start()
    time.sleep(0.4)
    assert waiter.is_alive()  # held by the proxy, not refused
    g.release_prompts("gen-a", [p.prompt_id for p in full.prompts[:2]])
    waiter.join(10)
    elapsed = time.monotonic() - t0
    lease = got["lease"]
    assert isinstance(lease, PromptLease)
    assert sorted(p.prompt_id for p in lease.prompts) == sorted(p.prompt_id for p in full.prompts[:2])
    # Woken by the announcement: well before the 0.5 s re-check slice would have found the room.
    assert 0.35 <= lease.waited_s <= elapsed < 0.4 + prompt_lease.PACE_SLICE_S, (lease.waited_s, elapsed)
    # Only the request answered 429 counts as a refusal; the one that waited and got its prompts does not.
    assert proxy_file.client("r2", "viewer").status().queue.backpressure_total == 1
