"""The dashboard's routes on a real proxy: page, assets, run list, and what they refuse."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketrl.proxy.routes.ui import ASSETS
from tests.proxy.harness import ProxyHarness, make_spec, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


def test_page_and_every_asset_it_references_are_served(proxy: ProxyHarness) -> None:
    with proxy.http(None) as anon:  # the page holds no data: no token needed
        root = anon.get("/", follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/ui"
        page = anon.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        referenced = set(re.findall(r'(?:src|href)="/ui/static/([^"]+)"', page.text))
        assert referenced == {"dashboard.js", "dashboard.css"}
        for name in referenced:
            r = anon.get(f"/ui/static/{name}")
            assert r.status_code == 200, name
            assert r.headers["content-type"] == ASSETS[name]
            assert r.headers["cache-control"] == "no-cache"
        # No CDN: nothing the page or its script loads comes from another origin.
        js = anon.get("/ui/static/dashboard.js").text
        assert "http://" not in page.text + js and "https://" not in page.text + js


def test_unknown_or_malicious_asset_names_are_refused(proxy: ProxyHarness) -> None:
    with proxy.http(None) as anon:
        assert anon.get("/ui/static/nope.js").json()["error"]["code"] == "not_found"
        for bad in ("..%2Fapp.py", "..%2F..%2Fsettings.py", "UPPER.js"):
            r = anon.get(f"/ui/static/{bad}")
            assert r.status_code in (404, 422), (bad, r.status_code)
            assert "error" in r.json()
        assert anon.get("/ui/static/__init__.py").status_code == 404


def test_run_list_needs_a_viewer_token(proxy: ProxyHarness) -> None:
    t = proxy.client("r-ui", "trainer")
    t.put_run(make_spec())
    with proxy.http(None) as anon:
        r = anon.get("/ui/api/runs")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    with proxy.http("viewer") as viewer:
        assert viewer.get("/ui/api/runs").json() == {"runs": ["r-ui"]}


def test_routes_are_in_the_openapi_schema(proxy: ProxyHarness) -> None:
    with proxy.http(None) as anon:
        paths = anon.get("/openapi.json").json()["paths"]
    assert {"/", "/ui", "/ui/static/{name}", "/ui/api/runs"} <= paths.keys()
    assert paths["/ui/api/runs"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "RunList"
    )
