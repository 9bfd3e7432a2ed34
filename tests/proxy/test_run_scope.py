"""Run-scoped tokens: the auth matrix over every route of the app x role x {own run, other run, missing run},
read from the app's route table so a route added later is in the matrix without anyone listing it; the
cross-run listing filtered to the caller's runs; a bad scope refused at start by the ``bucketrl proxy`` CLI.

A real proxy over a real Redis and bucket (``tests/proxy/harness.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
from fastapi.routing import APIRoute

from bucketrl.proxy.auth import TokenAuth
from tests.proxy.harness import TOKENS, TOKENS_ENV, make_spec, running
from tests.support.services import RedisServer, free_port

SCOPE = "own-*|solo"
SCOPED = {role: f"tok-{role}-scoped-0123456789" for role in ("trainer", "generator", "viewer")}
SCOPED_ENV = ",".join(f"{role}@{SCOPE}:{tok}" for role, tok in SCOPED.items())
OWN, OTHER, MISSING = "own-a", "other", "ghost"
# Routes that name no run: each either serves no run's data or filters to the caller's runs (/ui/api/runs).
# A new route without ``{run}`` fails the matrix until it is added here, after deciding what it shows whom.
CROSS_RUN = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/healthz", "/readyz", "/metrics", "/"}
CROSS_RUN |= {"/ui", "/ui/static/{name}", "/ui/api/runs"}
# The pool checks the scope itself on every run it would serve, and lists only the caller's runs.
CROSS_RUN |= {"/v1/pool/lease", "/v1/pool"}
# Staged uploads: a relay or generator token (or admin) only, listed and read within its run scope (routes/staging.py).
CROSS_RUN |= {"/v1/staging", "/v1/staging/{upload_id}"}
# A value for each path parameter other than {run}: any that passes the route's validation.
PARAM_VALUES = {"lease_id": "L1", "version": "1", "step": "1", "request_id": "job-1", "worker_id": "w1"}
JUNK = b"\x00 not a body"  # every body-reading route refuses it (422/415) before changing anything


def _routes(app: object) -> list[tuple[str, str]]:
    """(method, path template) of every route with a ``{run}`` path parameter; asserts the rest are known."""
    found: list[tuple[str, str]] = []
    for route in app.routes:  # type: ignore[attr-defined]
        params = re.findall(r"\{(\w+)(?::\w+)?\}", route.path)
        if "run" not in params:
            assert route.path in CROSS_RUN, f"{route.path} names no run and is not in CROSS_RUN: decide its scope"
            continue
        assert isinstance(route, APIRoute), route.path
        unknown = set(params) - {"run", *PARAM_VALUES}
        assert not unknown, f"{route.path}: give the matrix a value for {unknown}"
        found += [(method, route.path) for method in sorted(route.methods)]
    return found


def _url(path: str, run: str) -> str:
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: run if m[1] == "run" else PARAM_VALUES[m[1]], path)


def _call(c: httpx.Client, token: str, method: str, path: str, run: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json", "X-Trainer-Epoch": "1"}
    content = None if method in ("GET", "DELETE") else JUNK
    return c.request(method, _url(path, run), headers=headers, content=content)


def _is_scope_refusal(r: httpx.Response) -> bool:
    return r.status_code == 403 and "is limited to runs" in r.json()["error"]["message"]


def _snapshot(url: str, bucket: Path) -> tuple[dict[bytes, bytes | None], list[str]]:
    with redis.Redis.from_url(url) as r:
        state = {key: r.dump(key) for key in sorted(r.keys("*"))}
    return state, sorted(str(p.relative_to(bucket)) for p in bucket.rglob("*"))


def test_auth_matrix_every_route_x_role_x_run(redis_server: RedisServer, tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    with running(redis_server.url, f"file://{bucket}", tokens=f"{TOKENS_ENV},{SCOPED_ENV}") as h:
        admin = c = h.http("admin")  # one client: a client's setup costs more than a request
        for run in (OWN, OTHER):
            assert admin.put(f"/v1/runs/{run}", content=make_spec().model_dump_json()).status_code == 201
            assert admin.post(f"/v1/runs/{run}/trainer", json={"worker_id": "t"}).status_code == 200
        routes = _routes(h.app)
        assert len(routes) >= 25, routes  # the table really was read

        # Out of scope: 403 naming the scope, the same for an existing and a missing run (no existence leak),
        # and nothing in Redis or the bucket changed.
        before = _snapshot(redis_server.url, bucket)
        for method, path in routes:
            for role, token in SCOPED.items():
                for run in (OTHER, MISSING):
                    r = _call(c, token, method, path, run)
                    assert _is_scope_refusal(r), (method, path, role, run, r.status_code, r.text)
                    assert SCOPE in r.text and run in r.text
        assert _snapshot(redis_server.url, bucket) == before

        # In scope: exactly what the same role's unscoped token gets (the role rules alone decide); the
        # admin reaches every run.
        for method, path in routes:
            for role, token in SCOPED.items():
                unscoped = _call(c, TOKENS[role], method, path, OWN)
                scoped = _call(c, token, method, path, OWN)
                assert not _is_scope_refusal(scoped), (method, path, role, scoped.text)
                assert scoped.status_code == unscoped.status_code, (method, path, role, scoped.text, unscoped.text)
            r = _call(c, TOKENS["admin"], method, path, OTHER)
            assert r.status_code != 403, (method, path, r.text)

        # The cross-run listing shows a scoped viewer its own runs only; unscoped tokens see all.
        listed = {role: h.http(role).get("/ui/api/runs").json()["runs"] for role in ("admin", "viewer")}
        assert sorted(listed["admin"]) == sorted(listed["viewer"]) == [OTHER, OWN]
        with httpx.Client(base_url=h.url, headers={"Authorization": f"Bearer {SCOPED['viewer']}"}) as v:
            assert v.get("/ui/api/runs").json()["runs"] == [OWN]


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ("trainer@:tok-trainer-scoped-0123456789", "run scope after '@' is empty"),
        ("generator@sweep-[ab:tok-gen-scoped-0123456789", "run pattern 'sweep-[ab' is not a glob"),
        ("admin@sweep-*:tok-admin-scoped-0123456789", "admin token sees every run"),
        ("owner@sweep-*:tok-owner-scoped-0123456789", "unknown role 'owner'"),
    ],
)
def test_bad_run_scope_is_refused_at_start(tokens: str, expected: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "BUCKETRL_TOKENS": tokens,
        "BUCKETRL_REDIS_URL": "redis://127.0.0.1:1/0",  # refused before any connection is tried
        "BUCKETRL_BUCKET_URL": f"file://{tmp_path / 'b'}",
    }
    cmd = [sys.executable, "-m", "bucketrl.cli", "proxy", "--host", "127.0.0.1", "--port", str(free_port())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bucketrl proxy: BUCKETRL_TOKENS: " in proc.stderr and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "b").exists()


def test_scope_patterns_match_run_ids_as_globs() -> None:
    auth = TokenAuth.from_settings(
        "viewer@sweep-[ab]?|exact:tok-viewer-scoped-0123456789,trainer:tok-trainer-0123456789", None, False, "::1"
    )
    viewer = auth.authenticate("Bearer tok-viewer-scoped-0123456789")
    assert viewer.runs == ("sweep-[ab]?", "exact")
    assert [viewer.may_run(r) for r in ("sweep-a1", "sweep-b9", "sweep-c1", "sweep-a", "exact", "exact2")] == [
        True, True, False, False, True, False,
    ]  # fmt: skip
    assert auth.authenticate("Bearer tok-trainer-0123456789").may_run("anything")  # no '@': every run
