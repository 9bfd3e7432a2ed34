"""The generator pool as operators see it (issue 23, "Operating it"): per run, its share, the fraction of the
tokens it got (recently and overall), its queue, its live versions and LoRA slots, its budget and hold, in
``GET /v1/pool``, ``bucketrl status`` and the dashboard (a real headless Chromium). Real proxy, real Redis.

    .venv/bin/python -m pytest -q tests/ui/test_dashboard_pool.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bucketrl.cli import app
from bucketrl.wire import MetricsPush
from tests.e2e.helpers import wait_for
from tests.proxy.harness import TOKENS, ProxyHarness
from tests.proxy.test_pool import Run, serve
from tests.ui.cdp import Chromium

BUDGET = 40  # b's generated-token budget: 10 groups of 2 completions x 2 tokens


def two_runs(h: ProxyHarness) -> dict[str, Run]:
    """a (share 2) and b (share 1, a budget), 12 pool leases served; a's generator holds v1 loaded; b paused."""
    runs = {"a": Run(h, "a", 2, share=2), "b": Run(h, "b", 2, budget_tokens=BUDGET)}
    got = serve(h.client("a", "generator"), runs, 12)
    assert got == {"a": 8, "b": 4}, got
    runs["a"].g.push_metrics(MetricsPush(worker_id="gen-a", loaded_versions=[1], phase="generating"))
    runs["b"].t.pause_generation()
    return runs


def test_the_pool_answer_and_status_carry_queue_versions_slots_and_budget(proxy: ProxyHarness) -> None:
    two_runs(proxy)
    with proxy.http("viewer") as viewer:
        pool = viewer.get("/v1/pool").json()
    by = {r["run"]: r for r in pool["runs"]}
    a, b = by["a"], by["b"]
    assert pool["token_fraction"] == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert pool["recent_fraction"] == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    # Queue: every accepted group, unclaimed (no trainer claims here), out of the run's capacity.
    assert (a["queue_groups"], a["queue_capacity"], b["queue_groups"]) == (8, 512, 4)
    # Live versions: v1, held by each run's generator version lease. Slots: a's generator holds one adapter of
    # the max_staleness + 2 = 6 it gives a run; b has no generator heard from.
    assert (a["live_versions"], b["live_versions"]) == ([1], [1])
    assert (a["generators"], a["adapters_loaded"], a["slots_per_generator"]) == (1, 1, 6)
    assert (b["generators"], b["adapters_loaded"]) == (0, 0)
    # Budget: b spent 16 of its 40 tokens; a has none. b is paused (its hold says so).
    assert (b["tokens_generated"], b["budget_tokens"], b["budget_used"]) == (16, BUDGET, pytest.approx(0.4))
    assert (a["budget_tokens"], a["budget_used"]) == (None, None)
    assert (a["hold"], b["hold"], b["paused"]) == ("ok", "paused", True)
    # The run status's pool part carries the same (the dashboard's run cards read it).
    with proxy.http("viewer") as viewer:
        own = viewer.get("/v1/runs/b/status").json()["pool"]
    assert (own["queue_groups"], own["live_versions"], own["budget_used"]) == (4, [1], pytest.approx(0.4))

    base = ["status", "--proxy", proxy.url, "--run", "a", "--token", TOKENS["viewer"]]
    listed = {r["run"]: r for r in json.loads(CliRunner().invoke(app, [*base, "--json"]).output)["runs"]}
    assert (listed["a"]["queue_groups"], listed["a"]["adapters_loaded"], listed["b"]["budget_used"]) == (8, 1, 0.4)
    table = CliRunner().invoke(app, base, env={"COLUMNS": "300"})
    assert table.exit_code == 0, table.output
    rows = {line.split("│")[1].strip(): line for line in table.output.splitlines() if line.count("│") > 10}
    assert "8 / 512" in rows["a"] and "1 / 6 (1 gen)" in rows["a"] and "66.7 %" in rows["a"], rows
    assert "16 of 40 (40 %)" in rows["b"] and "paused" in rows["b"] and "v1" in rows["b"], rows


# What the page drew: the pool table's rows as cell texts, and the run's own fraction and budget cards.
DRAWN = """JSON.stringify({
  rows: [...document.querySelectorAll('#pool tbody tr')].map((tr) => [...tr.cells].map((c) => c.textContent)),
  hidden: document.getElementById('pool-section').hidden,
  fraction: document.getElementById('c-fraction').textContent,
  budget: document.getElementById('c-budget').textContent,
  state: window.bucketrlDashboard || null,
})"""


@pytest.mark.browser
def test_the_dashboard_shows_the_pool_table_and_the_runs_fraction_and_budget(
    proxy: ProxyHarness, tmp_path: Path
) -> None:
    two_runs(proxy)
    browser = Chromium(tmp_path / "chromium")
    try:
        for domain in ("Runtime", "Log", "Page"):
            browser.send(f"{domain}.enable")
        browser.send("Page.navigate", {"url": f"{proxy.url}/ui?run=b#token={TOKENS['viewer']}"})
        drawn = lambda: json.loads(browser.evaluate(DRAWN))  # noqa: E731
        wait_for(lambda: (browser.pump(0.5), (drawn()["state"] or {}).get("polls", 0) >= 2)[1], 60, "two polls")
        seen = drawn()
        problems = browser.problems()
    finally:
        browser.close()
    assert problems == [] and seen["state"]["lastError"] is None, (problems, seen["state"])
    assert seen["hidden"] is False and seen["state"]["poolRows"] == 2
    rows = {r[0]: r for r in seen["rows"]}
    header = ["run", "share", "recent", "overall", "tokens", "queue", "inflight", "versions", "slots", "budget", "hold"]
    assert dict(zip(header, rows["a"], strict=True)) == {
        "run": "a", "share": "×2", "recent": "66.7 %", "overall": "66.7 %", "tokens": "32", "queue": "8 / 512",
        "inflight": "0", "versions": "v1", "slots": "1 / 6 (1 gen)", "budget": "none", "hold": "ok",
    }  # fmt: skip
    assert rows["b"][1:4] == ["×1", "33.3 %", "33.3 %"] and rows["b"][9:] == ["16 of 40 (40 %)", "paused"], rows
    # The run this page follows (b): its fraction got (last 60 s · overall) and its budget spent.
    assert seen["fraction"] == "33.3 % · 33.3 %" and seen["budget"] == "16 of 40 (40 %)", seen
