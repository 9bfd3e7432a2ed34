"""The dashboard in a real headless Chromium against a live run: it loads with no console errors and draws
its charts from the metrics the workers push. The screenshot is kept in ``test-artifacts/dashboard.png``.

    .venv/bin/python -m pytest -q -s tests/ui/test_dashboard_browser.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.helpers import Watch, running_cluster, wait_for
from tests.ui.cdp import Chromium

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# Charts fed by the trainer's and generators' pushes; "queue" and "cost" are fed by the page's own status polls.
CHARTS = (
    "reward",
    "step_time",
    "wait",
    "queue",
    "cost",
    "staleness",
    "sync",
    "throughput",
    "ratio",
    "length",
    "tokens",
    "fractions",
    "entropy_kl",
)

EVAL_SERIES = "eval (held-out)"  # the reward chart's eval curve (dashboard.js)

# Coloured (non-background) pixels of a chart's canvas: proves lines were drawn, not just an empty frame.
INK = """
(() => {
  const out = {};
  for (const c of document.querySelectorAll('canvas')) {
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) {
      const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
      if (a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 60) n++;  // saturated: a series colour, not grey
    }
    out[c.id.replace('chart-', '')] = n;
  }
  return out;
})()
"""


LAYOUT = """
(() => Object.fromEntries(
  ['charts-step', 'charts-time'].map((id) => [id, document.getElementById(id).childElementCount])))()
"""


def test_dashboard_draws_live_charts_without_console_errors(tmp_path: Path) -> None:
    with running_cluster(tmp_path, max_steps=60, generators=1, eval_every=2) as cluster:
        watch = Watch(cluster)
        watch.until_step(4, 240)
        browser = Chromium(tmp_path / "chromium")
        try:
            for domain in ("Runtime", "Log", "Page"):
                browser.send(f"{domain}.enable")
            browser.send("Page.navigate", {"url": cluster.dashboard_url})
            state = lambda: browser.evaluate("JSON.stringify(window.bucketrlDashboard || null)")  # noqa: E731
            wait_for(lambda: (browser.pump(0.5), '"polls":3' in (state() or ""))[1], 60, "three dashboard polls")
            import json

            seen = json.loads(state())
            wait_for(lambda: (browser.pump(0.5), all(json.loads(state())["charts"].get(c, 0) > 0 for c in CHARTS))[1],
                     60, f"every chart to have points (have {seen['charts']})")  # fmt: skip
            # Evaluation during training (--eval-every 2) and sample completions reach their tables.
            wait_for(lambda: (browser.pump(0.5), json.loads(state()).get("evalRows", 0) > 0)[1], 90, "an eval row")
            # ... and the eval curve on the reward chart (the trainer reports each evaluated version once).
            wait_for(lambda: (browser.pump(0.5), json.loads(state())["series"]["reward"].get(EVAL_SERIES, 0) > 0)[1],
                     90, "the eval curve on the reward chart")  # fmt: skip
            # A worker's notes (here a generator's first reward error, as a failing reward makes it push them)
            # reach its row in the workers table.
            from bucketrl.wire import MetricsPush

            note = {"reward_error/timeout": "the reward function ran past 10s (BUCKETRL_REWARD_TIMEOUT_S)"}
            cluster.client("generator").push_metrics(MetricsPush(worker_id="gen-9", phase="generating", notes=note))
            rows = lambda: browser.evaluate("document.querySelector('#workers').innerText")  # noqa: E731
            wait_for(lambda: (browser.pump(0.5), "reward_error/timeout" in rows())[1], 30, "the note in its row")
            browser.pump(2.5)  # one more poll: the page keeps running without errors
            seen = json.loads(state())
            ink = browser.evaluate(INK)
            shot = browser.screenshot(ARTIFACTS / "dashboard.png")
            workers = browser.evaluate("document.querySelector('#workers').innerText")
            samples = browser.evaluate("document.querySelector('#samples').innerText")
            layout = browser.evaluate(LAYOUT)
            cards = browser.evaluate("document.querySelector('#cards').innerText")
            url = browser.evaluate("window.location.href")
            problems = browser.problems()
        finally:
            browser.close()
    print(f"\ndashboard: polls {seen['polls']}, points per chart {seen['charts']}, ink {ink}, screenshot {shot}")
    assert problems == [], problems
    assert seen["lastError"] is None and seen["run"] == "demo"
    assert seen["series"]["reward"][EVAL_SERIES] > 0, seen["series"]["reward"]
    for chart in CHARTS:
        assert seen["charts"][chart] > 0, chart
        assert ink[chart] > 50, (chart, ink[chart])
    # Tables and cards filled from the status; the token came from the URL fragment and left the address bar.
    assert seen["sampleRows"] > 0 and "v" in samples.splitlines()[1], samples
    # One x-axis convention per grid: every chart drawn against trainer steps sits in the step grid.
    # (charts-time includes the multi-turn "episodes" chart, empty in this single-turn run.)
    assert layout == {"charts-step": 8, "charts-time": 6}, layout
    assert "gen-0" in workers and "generator" in workers and "trainer" in workers, workers
    assert "generating" in workers, workers  # each worker's phase (issue 11), not an empty heartbeat
    assert "reward_error/timeout: the reward function ran past 10s" in workers, workers
    assert "policy version" in cards and "–" not in cards.split("reward")[1].splitlines()[1], cards
    assert "token=" not in url and "run=demo" in url, url
    assert shot.stat().st_size > 20_000
