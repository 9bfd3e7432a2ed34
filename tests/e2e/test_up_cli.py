"""`bucketrl up` as a user runs it: a short run ends with a summary and plots; Ctrl-C stops every service it
started; running again with the same directory resumes the run (versions continue, nothing is redone).

    .venv/bin/python -m pytest -q -s tests/e2e/test_up_cli.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bucketrl.up.synclatency import PUBLISHED

pytestmark = pytest.mark.slow


def _up(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", "--lr", "3e-3", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _status(run_dir: Path) -> dict | None:
    out = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "status", "--dir", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _published(run_dir: Path) -> list[int]:
    return [int(m.group(2)) for m in PUBLISHED.finditer((run_dir / "logs" / "trainer.log").read_text())]


def test_ctrl_c_stops_everything_and_a_rerun_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "demo"
    proc = _up(run_dir, "--max-steps", "200", "--checkpoint-every", "5", "--eval-every", "4")
    try:
        deadline = time.monotonic() + 240
        step = 0
        while time.monotonic() < deadline and step < 7:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            s = _status(run_dir) if (run_dir / "endpoint.json").exists() else None
            step = s["trainer"]["step"] if s else 0
            time.sleep(1.0)
        assert step >= 7, "the run did not reach step 7"
        # `status --json` carries the run's cost (docs/cost.md): the workers declared their class (cpu here).
        assert s is not None and s["cost"]["trainer_steps"] == step and s["cost"]["usd_total"] >= 0
        assert {c["gpu_class"] for c in s["cost"]["classes"]} and s["cost"]["prices"]["estimate"]
        pids = json.loads((run_dir / "services.json").read_text())
        assert set(pids) == {"redis", "proxy", "trainer", "gen-0", "gen-1"}
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stopping workers" in out and "summary" in out
    for name, pid in pids.items():
        assert not _alive(pid), f"{name} (pid {pid}) survived Ctrl-C"
    first = _published(run_dir)
    assert first == list(range(1, len(first) + 1))
    stopped_at = json.loads((run_dir / "summary.json").read_text())["last_step"]
    assert stopped_at >= 7

    # Same directory again: Redis comes back from its append-only file, the trainer from its checkpoint.
    proc = _up(run_dir, "--max-steps", str(stopped_at + 4), "--checkpoint-every", "5", "--eval-every", "4")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == stopped_at + 4
    cost = summary["cost"]  # up's summary carries the cost too; a second session's seconds add to the first's
    assert cost["trainer_steps"] == stopped_at + 4 and cost["usd_total"] > 0 and cost["usd_per_step"] > 0
    published = _published(run_dir)
    assert published == list(range(1, len(published) + 1)) and len(published) > len(first)
    audit = [json.loads(line) for line in (run_dir / "logs" / "trainer-audit.jsonl").read_text().splitlines()]
    resumed = [r for r in audit if r["event"] == "resume"]
    assert resumed and resumed[-1]["step"] >= stopped_at - 5  # SIGTERM checkpointed (at worst the last periodic one)
    # The first session's history is part of the report: one reward per step, steps 1..N.
    assert summary["steps"] == stopped_at + 4
    assert (run_dir / "reward.png").exists() and (run_dir / "pipeline.png").exists()
    # TensorBoard event files in the run directory (tensorboard is installed here), read with its own reader:
    # one point per step across the Ctrl-C and the resume (steps retrained after the checkpoint are purged).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard" / "demo"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, stopped_at + 5))
    # Evaluation during training (--eval-every 4: v1, v5, v9...) across both sessions, each version once.
    evaluated = [step for step, _ in summary["eval_curve"]]
    assert summary["eval_versions"] >= 2 and evaluated == sorted(set(evaluated)), summary["eval_curve"]
    assert summary["eval_reward_first"] is not None
    # ... and in the TensorBoard files: each evaluated version once (steps retrained after the resume are purged
    # with their reports), with the reward the proxy recorded for it.
    reported = [int(e.value) for e in acc.Scalars("eval/version")]
    assert len(reported) >= 2 and reported == sorted(set(reported)), reported
    curve = [reward for _, reward in summary["eval_curve"]]
    for e in acc.Scalars("eval/reward"):
        assert any(e.value == pytest.approx(r, abs=1e-6) for r in curve), (e.value, curve)
    print(f"\n[up] Ctrl-C at step {stopped_at}, resumed to {summary['last_step']}; versions 1..{published[-1]}")
