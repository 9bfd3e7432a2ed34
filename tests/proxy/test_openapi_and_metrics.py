"""The OpenAPI schema describes every route, body and error response; /metrics exposes the telemetry."""

from __future__ import annotations

from fastapi.routing import APIRoute

from bucketrl.proxy.app import create_app
from bucketrl.proxy.settings import ProxySettings
from tests.proxy.harness import ProxyHarness, adapter_tar, make_spec

P2_ROUTES = {
    ("PUT", "/v1/runs/{run}"): ({401, 403, 409, 413, 422, 503}, "RunSpec"),
    ("GET", "/v1/runs/{run}"): ({401, 404, 422, 503}, None),
    ("POST", "/v1/runs/{run}/trainer"): ({401, 403, 404, 422, 503}, "TrainerRegisterRequest"),
    ("PUT", "/v1/runs/{run}/adapters/{version}"): ({401, 403, 404, 409, 413, 422, 503}, "tar"),
    ("GET", "/v1/runs/{run}/adapters/latest"): ({401, 403, 404, 422, 503}, None),
    ("GET", "/v1/runs/{run}/adapters/{version}"): ({401, 403, 404, 410, 422, 503}, None),
    ("POST", "/v1/runs/{run}/leases"): ({401, 403, 404, 410, 422, 503}, "VersionLeaseRequest"),
    ("POST", "/v1/runs/{run}/leases/{lease_id}/renew"): ({401, 403, 404, 410, 422, 503}, "LeaseRenewRequest"),
    ("DELETE", "/v1/runs/{run}/leases/{lease_id}"): ({401, 403, 404, 410, 422, 503}, None),
    ("PUT", "/v1/runs/{run}/checkpoints/{step}"): ({401, 403, 404, 409, 413, 422, 503}, "tar"),
    ("GET", "/v1/runs/{run}/checkpoints/latest"): ({401, 403, 404, 503}, None),
    ("GET", "/v1/runs/{run}/checkpoints/{step}"): ({401, 403, 404, 422, 503}, None),
    ("POST", "/v1/runs/{run}/metrics"): ({401, 403, 404, 413, 422, 503}, "MetricsPush"),
    ("GET", "/v1/runs/{run}/status"): ({401, 403, 404, 503}, None),
    ("GET", "/healthz"): (set(), None),
    ("GET", "/readyz"): ({503}, None),
    ("GET", "/metrics"): (set(), None),
}


def test_openapi_documents_routes_bodies_and_errors() -> None:
    app = create_app(ProxySettings(tokens="admin:" + "x" * 32))
    schema = app.openapi()
    comps = schema["components"]["schemas"]
    assert {"ErrorBody", "RunSpec", "VersionLeaseRequest", "MetricsPush", "LoraSpec", "RunStatus"} <= comps.keys()
    for (method, path), (statuses, body) in P2_ROUTES.items():
        op = schema["paths"][path][method.lower()]
        for status in statuses:
            resp = op["responses"][str(status)]
            content = resp.get("content", {}).get("application/json", {}).get("schema", {})
            if path != "/readyz":
                assert content.get("$ref") == "#/components/schemas/ErrorBody", (method, path, status)
        if body == "tar":
            assert "application/x-tar" in op["requestBody"]["content"]
            assert any(p["name"] == "X-Content-SHA256" for p in op["parameters"])
            assert any(p["name"] == "x-trainer-epoch" for p in op["parameters"])
        elif body:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{body}" and body in comps
    # Every $ref resolves, and every route the app serves is in the schema.
    import json

    for ref in {part.split('"')[0] for part in json.dumps(schema).split('"$ref": "')[1:]}:
        assert ref.removeprefix("#/components/schemas/") in comps, ref
    # Generic truths for every route, whoever wrote it: validation errors use our ErrorBody (never FastAPI's
    # HTTPValidationError), and every /v1 route documents its 401 and 503.
    assert "HTTPValidationError" not in json.dumps(schema)
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            if path.startswith("/v1/"):
                assert {"401", "503"} <= op["responses"].keys(), (method, path)
            if "{" in path:
                assert "422" in op["responses"], (method, path)
    served = {(m, r.path_format) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    documented = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    assert served == documented
    assert set(P2_ROUTES) <= served


def test_prometheus_exposition(proxy_file: ProxyHarness) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("t0")
    t.publish_adapter(1, adapter_tar(1))
    g = proxy_file.client("r1", "generator")
    g.lease_version("g1")
    g.lease_version("g2")
    with proxy_file.http(None) as anon:
        r = anon.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'bucketrl_version_leases_live{run="r1",version="1"} 2.0' in text
    assert 'bucketrl_latest_version{run="r1"} 1.0' in text
    assert 'bucketrl_versions_published_total{run="r1"} 1.0' in text
    # Latency per route TEMPLATE, never per raw path (no cardinality blow-up from ids).
    assert 'route="/v1/runs/{run}/adapters/{version}",status="200"' in text
    assert "/v1/runs/r1/" not in text
    for name in ("bucketrl_queue_depth_groups", "bucketrl_stale_dropped_groups", "bucketrl_backpressure_rejections"):
        assert f"# TYPE {name}" in text
