"""Auth (401/403), the error table (body shape, 404/413/422/429/500), bad input of every kind.

Bad input must get a clear error naming the problem and change nothing.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import msgpack
import pytest
from fastapi import FastAPI

from bucketrl import errors
from bucketrl.proxy import errors as error_table
from bucketrl.proxy.auth import TokenAuth, parse_pairs
from bucketrl.proxy.identity import MARKER_KEY
from bucketrl.proxy.telemetry import Telemetry
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "retryable"}, body
    return body["error"]


def test_missing_bad_and_malformed_tokens_are_401(proxy_file: ProxyHarness) -> None:
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "Basic dG9rOng="},
        {"Authorization": "Bearer"},
    ):
        with httpx.Client(base_url=proxy_file.url, headers=headers) as c:
            r = c.get("/v1/runs/r1/status")
            assert r.status_code == 401, headers
            assert _error(r)["code"] == "unauthorized"
            # 401 before anything else: an unknown run is not revealed to a caller without a token.
            assert c.put("/v1/runs/x", json={}).status_code == 401


def test_wrong_role_is_403_and_admin_may_do_everything(proxy_file: ProxyHarness) -> None:
    spec = make_spec().model_dump_json()
    hdr = {"Content-Type": "application/json"}
    with proxy_file.http("generator") as g, proxy_file.http("viewer") as v, proxy_file.http("trainer") as t:
        r = g.put("/v1/runs/r1", content=spec, headers=hdr)
        assert r.status_code == 403 and _error(r)["code"] == "forbidden" and "generator" in _error(r)["message"]
        assert v.put("/v1/runs/r1", content=spec, headers=hdr).status_code == 403
        assert t.put("/v1/runs/r1", content=spec, headers=hdr).status_code == 201
        assert v.get("/v1/runs/r1/status").status_code == 200
        assert t.post("/v1/runs/r1/leases", json={"worker_id": "w"}).status_code == 403  # trainer may not lease
        assert v.get("/v1/runs/r1/adapters/1").status_code == 403  # viewer may not download
        assert v.post("/v1/runs/r1/metrics", json={"worker_id": "w"}).status_code == 403
        assert g.get("/v1/runs/r1/checkpoints/latest").status_code == 403
    with proxy_file.http("admin") as a:
        assert a.put("/v1/runs/r1", content=spec, headers=hdr).status_code == 200
        assert a.post("/v1/runs/r1/trainer", json={"worker_id": "t"}).status_code == 200


def test_unknown_run_and_unknown_route_are_404(proxy_file: ProxyHarness) -> None:
    with proxy_file.http("admin") as a:
        for method, path in [
            ("GET", "/v1/runs/ghost"),
            ("GET", "/v1/runs/ghost/status"),
            ("POST", "/v1/runs/ghost/trainer"),
            ("GET", "/v1/runs/ghost/adapters/latest"),
            ("GET", "/v1/runs/ghost/checkpoints/latest"),
        ]:
            r = a.request(method, path, json={"worker_id": "w"})
            assert r.status_code == 404, (method, path)
            assert _error(r)["code"] == "unknown_run"
        r = a.post("/v1/runs/ghost/leases", json={"worker_id": "w"})
        assert r.status_code == 404
        r = a.get("/v1/nothing-here")
        assert r.status_code == 404 and _error(r)["code"] == "not_found"


def _raw_get(port: int, raw_path: str) -> tuple[int, bytes]:
    """Send a request line byte-for-byte (httpx would normalise '..' away)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            f"GET {raw_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['admin']}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_path_parameters_cannot_escape_their_prefix(proxy_file: ProxyHarness) -> None:
    proxy_file.client("ok", "trainer").put_run(make_spec())
    for raw in ("/v1/runs/%2E%2E/status", "/v1/runs/..%2Fok/status", "/v1/runs/a%2F..%2Fok", "/v1/runs/.hidden"):
        status, body = _raw_get(proxy_file.port, raw)
        # Either the id fails validation (422) or the decoded path matches no route (404): never 200.
        assert status in (404, 422), (raw, status, body)
    with proxy_file.http("admin") as a:
        r = a.get("/v1/runs/bad%20id")
        assert r.status_code == 422 and "run" in _error(r)["message"]
        r = a.post("/v1/runs/ok/leases/bad%21id/renew", json={})
        assert r.status_code == 422 and "lease_id" in _error(r)["message"]
        # Versions are integer path segments: "abc" names no resource (and PUT .../adapters/latest is 405).
        assert a.get("/v1/runs/ok/adapters/abc").status_code == 404
        r = a.get("/v1/runs/ok/adapters/0")
        assert r.status_code == 422 and "version" in _error(r)["message"]
        r = a.get("/v1/runs/ok/adapters/latest", params={"wait_s": -1})
        assert r.status_code == 422 and "wait_s" in _error(r)["message"]
    store = proxy_file.ctx.store
    assert all(k.startswith("runs/ok/") or k == MARKER_KEY for k in store.list_keys(""))


def test_garbage_bodies_are_422_naming_the_field_and_change_nothing(proxy_file: ProxyHarness) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec(max_staleness=3))
    with proxy_file.http("admin") as a:
        r = a.put("/v1/runs/r2", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and "body" in _error(r)["message"]
        r = a.put("/v1/runs/r2", content=b"\xc1\xc1\xc1", headers={"Content-Type": "application/msgpack"})
        assert r.status_code == 422 and "msgpack" in _error(r)["message"]
        r = a.put("/v1/runs/r2", content=b"", headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and "empty" in _error(r)["message"]
        r = a.put("/v1/runs/r2", content=b"base_model=x", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and "Content-Type" in _error(r)["message"]
        bad = make_spec().model_dump()
        bad["lora"]["rank"] = 8  # typo of "r": the spec forbids unknown fields
        r = a.put("/v1/runs/r2", json=bad)
        assert r.status_code == 422 and "body.lora.rank" in _error(r)["message"]
        bad = make_spec().model_dump()
        bad["sampling"]["temperature"] = -1
        packed = msgpack.packb(bad)
        r = a.put("/v1/runs/r2", content=packed, headers={"Content-Type": "application/msgpack"})
        assert r.status_code == 422 and "body.sampling.temperature" in _error(r)["message"]
        r = a.post("/v1/runs/r1/leases", json={"worker_id": "../etc", "ttl_s": 5})
        assert r.status_code == 422 and "body.worker_id" in _error(r)["message"]
        r = a.post("/v1/runs/r1/metrics", content=b'{"worker_id": "w", "metrics": {"x": NaN}}')
        assert r.status_code == 422 and "metrics" in _error(r)["message"]
        r = a.post(
            "/v1/runs/r1/metrics", content=msgpack.packb({1: 2}), headers={"Content-Type": "application/msgpack"}
        )
        assert r.status_code == 422
        # Nothing changed: r2 never came to exist, r1 kept its spec.
        assert a.get("/v1/runs/r2").status_code == 404
        assert a.get("/v1/runs/r1").json()["spec"]["max_staleness"] == 3
        assert a.get("/v1/runs/r1/status").json()["workers"] == []


def test_oversized_bodies_are_413_before_being_read(redis_server: RedisServer, tmp_path: Path) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'b'}", max_adapter_bytes=4096, max_json_bytes=2048) as p:
        t = p.client("r1", "trainer")
        t.put_run(make_spec())
        t.register_trainer("t0")
        with p.http("admin") as a:
            big = b"\0" * 100_000
            headers = {"X-Trainer-Epoch": "1", "X-Content-SHA256": "0" * 64, "Content-Type": "application/x-tar"}
            r = a.put("/v1/runs/r1/adapters/1", content=big, headers=headers)
            assert r.status_code == 413 and _error(r)["code"] == "payload_too_large"

            # No Content-Length (chunked): refused once the streamed bytes pass the limit.
            def chunks():
                for _ in range(100):
                    yield b"\0" * 1000

            r = a.put("/v1/runs/r1/adapters/1", content=chunks(), headers=headers)
            assert r.status_code == 413
            r = a.post("/v1/runs/r1/metrics", json={"worker_id": "w", "metrics": {f"m{i}": 1.0 for i in range(300)}})
            assert r.status_code == 413
            r = a.post("/v1/runs/r1/metrics", content=(b"x" * 1000 for _ in range(5)))
            assert r.status_code == 413
        assert t.get_run().state.latest_version == 0
        assert p.ctx.store.list_keys("runs/r1/adapters") == []


def test_declared_length_over_limit_is_refused_without_reading_the_body(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Declare 1 GB, send nothing: the 413 comes back at once (the proxy did not wait for the body)."""
    with running(redis_server.url, f"file://{tmp_path / 'b'}", max_adapter_bytes=4096) as p:
        t = p.client("r1", "trainer")
        t.put_run(make_spec())
        t.register_trainer("t0")
        with socket.create_connection(("127.0.0.1", p.port), timeout=5) as s:
            s.sendall(
                (
                    "PUT /v1/runs/r1/adapters/1 HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {TOKENS['trainer']}\r\nX-Trainer-Epoch: 1\r\n"
                    f"X-Content-SHA256: {'0' * 64}\r\nContent-Length: 1000000000\r\n\r\n"
                ).encode()
            )
            head = s.recv(65536)
        assert head.split()[1] == b"413", head


def test_error_table_backpressure_and_unexpected_errors() -> None:
    app = FastAPI()
    error_table.install(app)
    telemetry = Telemetry()

    class Ctx:
        pass

    ctx = Ctx()
    ctx.telemetry = telemetry  # type: ignore[attr-defined]
    app.state.ctx = ctx

    @app.get("/busy")
    async def busy() -> None:
        raise errors.Backpressure("queue full", retry_after=1.2)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals /etc/passwd")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/busy"), await c.get("/boom")

    import asyncio

    busy_r, boom_r = asyncio.run(go())
    assert busy_r.status_code == 429 and busy_r.headers["Retry-After"] == "2"
    assert _error(busy_r) == {"code": "backpressure", "message": "queue full", "retryable": True}
    assert telemetry.backpressure_rejections.labels(route="/busy")._value.get() == 1
    assert boom_r.status_code == 500
    assert "secret" not in boom_r.text and _error(boom_r)["code"] == "internal"


def test_token_configuration_rules(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    abc, dfg, v1 = "abc" * 6, "def" * 6, "v1" * 8
    f.write_text(f"# workers\ntrainer:{abc}\n\ngenerator: {dfg} \n")
    auth = TokenAuth.from_settings(f"viewer:{v1}", str(f), False, "0.0.0.0")
    assert auth.authenticate(f"Bearer {abc}").role == "trainer"
    assert auth.authenticate(f"Bearer {dfg}").role == "generator"
    assert auth.authenticate(f"bearer {v1}").role == "viewer"
    with pytest.raises(errors.Unauthorized):
        auth.authenticate("Bearer " + abc[:-1])
    with pytest.raises(ValueError, match="unknown role"):
        parse_pairs("root:x", "BUCKETRL_TOKENS")
    with pytest.raises(ValueError, match="role:token"):
        parse_pairs("trainer", "BUCKETRL_TOKENS")
    with pytest.raises(ValueError, match="BUCKETRL_TOKENS"):
        TokenAuth.from_settings("", None, False, "127.0.0.1")
    with pytest.raises(ValueError, match="loopback"):
        TokenAuth.from_settings("", None, True, "0.0.0.0")
    with pytest.raises(ValueError, match="cannot be read"):
        TokenAuth.from_settings("", str(tmp_path / "missing"), False, "127.0.0.1")
    anon = TokenAuth.from_settings("", None, True, "127.0.0.1")
    assert anon.authenticate(None).role == "admin"
    assert TokenAuth.from_settings("", None, True, "::1").anonymous


def test_anonymous_embedded_mode_serves_without_tokens(redis_server: RedisServer, tmp_path: Path) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'b'}", tokens="", allow_anonymous=True) as p:
        with httpx.Client(base_url=p.url) as c:
            r = c.put("/v1/runs/r1", content=make_spec().model_dump_json())
            assert r.status_code == 201
            r = c.post("/v1/runs/r1/trainer", json={"worker_id": "t"})
            assert r.status_code == 200 and r.json()["epoch"] == 1
        t = p.client("r1", "admin")
        t.epoch = 1
        assert t.publish_adapter(1, adapter_tar(1)).version == 1


def test_client_hanging_up_mid_upload_leaves_nothing(proxy_file: ProxyHarness) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("t0")
    with socket.create_connection(("127.0.0.1", proxy_file.port), timeout=5) as s:
        s.sendall(
            (
                "PUT /v1/runs/r1/adapters/1 HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {TOKENS['trainer']}\r\nX-Trainer-Epoch: 1\r\n"
                f"X-Content-SHA256: {'0' * 64}\r\nContent-Length: 100000\r\n\r\n"
            ).encode()
            + b"\0" * 5000
        )
    time.sleep(0.3)
    assert t.get_run().state.latest_version == 0
    assert proxy_file.ctx.store.list_keys("runs/r1/adapters") == []
    assert t.publish_adapter(1, adapter_tar(1)).version == 1
