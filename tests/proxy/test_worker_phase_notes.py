"""A worker's phase and notes (a configuration error, the first reward error of each kind) reach the status, are
kept by metric-only pushes, and `bucketrl status` shows them."""

from __future__ import annotations

from rich.console import Console

from bucketrl.status_cli import render_status
from bucketrl.wire import MetricsPush
from tests.proxy.harness import ProxyHarness, make_spec


def test_phase_and_notes_reach_status_and_survive_metric_pushes(proxy_file: ProxyHarness) -> None:
    proxy_file.client("r1", "trainer").put_run(make_spec())
    gen = proxy_file.client("r1", "generator")
    gen.push_metrics(MetricsPush(worker_id="g1", phase="loading model"))
    notes = {"reward_error/non_numeric": "the reward function returned str '1.0', not a number"}
    gen.push_metrics(MetricsPush(worker_id="g1", phase="generating", notes=notes, metrics={"reward": 0.1}))
    gen.push_metrics(MetricsPush(worker_id="g1", metrics={"reward": 0.2}))  # keeps phase and notes
    status = proxy_file.client("r1", "viewer").status()
    (w,) = [w for w in status.workers if w.worker_id == "g1"]
    assert w.phase == "generating" and w.notes == notes
    console = Console(width=200, record=True)
    console.print(*render_status(status))
    text = console.export_text()
    assert "generating" in text and "reward_error/non_numeric" in text and "str '1.0'" in text
