"""`bucketrl up --runs 2 --shares 2,1`: two runs' trainers on the one machine's generators (pool mode), and the
issue's two-run chaos in small: run A's trainer and one pool generator (serving both runs) are SIGKILLed mid-run,
`up` restarts them, and run B's accounting is untouched (its trainer never restarted, every group it accepted
accounted exactly); for both runs, exactly-once accounting and the staleness bound hold.

    .venv/bin/python -m pytest -q -s tests/e2e/test_up_runs.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bucketrl.wire import RunSpec
from tests.e2e.helpers import effective_history

pytestmark = pytest.mark.slow

MAX_STEPS = 8


def _status(run_dir: Path) -> dict[str, Any] | None:
    out = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "status", "--dir", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def _audit(run_dir: Path, run: str) -> list[dict[str, Any]]:
    path = run_dir / "logs" / f"trainer-{run}-audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_accounting(run_dir: Path, run: str, figures: dict[str, Any]) -> None:
    """docs/design.md section 4's accounting for one run: the proxy's counters at the end, and in its trainer's
    effective history no delivery trained twice and every acked one trained."""
    q = figures["queue"]
    assert q["accepted_total"] > 0, (run, q)
    accounted = q["acked_total"] + q["dropped_stale_total"] + q["lost_total"] + q["groups"] + q["pending"]
    assert q["accepted_total"] == accounted, (run, q)
    assert q["lost_total"] == 0, (run, q)
    records = _audit(run_dir, run)
    trained = [d for deliveries in effective_history(records).values() for d in deliveries]
    assert trained and len(trained) == len(set(trained)), f"{run}: a delivery was trained twice"
    acked = {d for r in records if r["event"] in ("checkpoint", "resume") for d in r.get("acked") or []}
    assert acked <= set(trained), f"{run}: {len(acked - set(trained))} acked deliveries were never trained"
    # The staleness bound, per run: no trainer push of either epoch reports a trained group staler than the run's
    # max_staleness (up's watcher keeps every push of the run in its metrics.jsonl).
    pushes = [json.loads(line) for line in (run_dir / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    stale = [p["metrics"]["sample/staleness_max"] for p in pushes if "sample/staleness_max" in p["metrics"]]
    bound = RunSpec.model_fields["max_staleness"].default
    assert stale and max(stale) <= bound, (run, max(stale or [0]), bound)


def _wait_for_runs(proc: subprocess.Popen[str], run_dir: Path, a_step: int) -> dict[str, Any]:
    """`status --json` once both runs are listed and run A's trainer has reached ``a_step``."""
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        s = _status(run_dir) if (run_dir / "endpoint.json").exists() else None
        if s and s["trainer"]["step"] >= a_step and len(s.get("runs", [])) == 2:
            return s
        time.sleep(1.0)
    raise AssertionError(f"run demo-1 did not reach step {a_step} with both runs on the pool")


def test_two_runs_on_one_pool_and_a_killed_trainer_disturbs_only_its_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "sweep"
    cmd = [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", "--lr", "3e-3"]
    cmd += ["--runs", "2", "--shares", "2,1", "--max-steps", str(MAX_STEPS), "--checkpoint-every", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        s = _wait_for_runs(proc, run_dir, 3)
        assert s["run"] == "demo-1"  # `status --dir` shows the first run, and the pool lists them all
        runs = {r["run"]: r for r in s["runs"]}
        assert set(runs) == {"demo-1", "demo-2"}
        assert (runs["demo-1"]["share"], runs["demo-2"]["share"]) == (2.0, 1.0)
        for r in runs.values():
            assert r["tokens_generated"] > 0 and r["groups_accepted"] > 0, r
        pids = json.loads((run_dir / "services.json").read_text())
        assert {"trainer-demo-1", "trainer-demo-2", "gen-0", "gen-1"} <= set(pids)
        b_pid = pids["trainer-demo-2"]
        os.kill(pids["trainer-demo-1"], signal.SIGKILL)  # a crash of run A's trainer: up restarts it
        # and of a generator holding both runs' prompt leases: they go back to the pool, not lost nor trained twice
        os.kill(pids["gen-0"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["runs"]) == {"demo-1", "demo-2"}, summary
    for run, figures in summary["runs"].items():
        assert figures["steps"] == MAX_STEPS and figures["latest_version"] >= MAX_STEPS, (run, figures)
        assert figures["share"] == (2.0 if run == "demo-1" else 1.0)
        assert figures["tokens_generated"] > 0 and figures["groups_accepted"] == figures["queue"]["accepted_total"]
        assert (run_dir / "runs" / run / "reward.png").exists()
        _check_accounting(run_dir, run, figures)
    split = [f["token_fraction_while_all_ran"] for f in summary["runs"].values()]
    assert None not in split and abs(sum(split) - 1.0) < 1e-9, split
    # A's trainer started again (from its checkpoint); B's ran once, start to end, in the same process.
    starts = {run: [r for r in _audit(run_dir, run) if r["event"] == "start"] for run in ("demo-1", "demo-2")}
    assert len(starts["demo-1"]) == 2 and starts["demo-1"][1]["epoch"] > starts["demo-1"][0]["epoch"], starts
    assert len(starts["demo-2"]) == 1 and not [r for r in _audit(run_dir, "demo-2") if r["event"] == "resume"]
    final = json.loads((run_dir / "services.json").read_text())
    assert final["trainer-demo-2"] == b_pid
    assert final["gen-0"] != pids["gen-0"]  # up started the killed generator again
