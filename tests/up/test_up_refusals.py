"""A refused `bucketrl up` changes nothing on disk (house rule: bad input gets one line and changes nothing).

`up` run as a user runs it, a subprocess, with one mistake each: a run directory that did not exist must not exist
after (nor the folders above it that `up` would have made), and one that did must hold exactly what it held.
They used to keep ``logs/``, ``tokens`` and ``up.lock`` (and, after a model preflight refusal, the built-in model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _up(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "up", "--no-live", "--generators", "1", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def _one_line_refusal(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bucketrl up: ") and needle in lines[0], out.stderr


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with a file's bytes (None for a directory)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def test_a_refused_up_leaves_a_new_directory_absent_and_an_old_one_as_it_was(tmp_path: Path) -> None:
    """Mistakes found before the model is read: a run-spec file that is not JSON, an unknown toy task."""
    (tmp_path / "spec.json").write_text('{"loss": {entropy_coef: 0.1}}')
    new = tmp_path / "runs" / "fresh"  # neither exists yet
    _one_line_refusal(_up(tmp_path, "--dir", str(new), "--run-spec", "spec.json"), "--run-spec spec.json: not JSON")
    assert not (tmp_path / "runs").exists(), _tree(tmp_path / "runs")

    old = tmp_path / "mine"
    (old / "notes").mkdir(parents=True)
    (old / "notes" / "todo.txt").write_text("keep me\n")
    before = _tree(old)
    _one_line_refusal(_up(tmp_path, "--dir", str(old), "--dataset", "toy:chess"), "unknown toy task")
    assert _tree(old) == before
    # Without --dir: ./runs/demo under the user's directory.
    _one_line_refusal(_up(tmp_path, "--dataset", "toy:chess"), "unknown toy task")
    assert not (tmp_path / "runs").exists(), _tree(tmp_path / "runs")


def test_a_preflight_refusal_leaves_no_built_in_model_behind(tmp_path: Path) -> None:
    """The model preflight needs the built-in model built under the run directory; its refusal removes it."""
    run_dir = tmp_path / "run"
    out = _up(tmp_path, "--dir", str(run_dir), "--max-new-tokens", "600")
    _one_line_refusal(out, "lower --max-new-tokens to at most")
    assert not run_dir.exists(), _tree(run_dir)


def test_a_run_spec_files_base_model_is_checked_and_named_as_the_files(tmp_path: Path) -> None:
    """With no --model, the --run-spec file's base_model is the run's model: the preflight checks it and names the
    file (the built-in tiny model used to be built and given to the generators as BUCKETRL_MODEL_PATH instead)."""
    (tmp_path / "spec.json").write_text('{"base_model": "/nonexistent/model"}')
    run_dir = tmp_path / "run"
    out = _up(tmp_path, "--dir", str(run_dir), "--run-spec", "spec.json")
    _one_line_refusal(out, "base_model (--run-spec spec.json) /nonexistent/model: no such directory")
    assert not run_dir.exists(), _tree(run_dir)
