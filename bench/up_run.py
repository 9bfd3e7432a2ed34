"""What the `bucketrl up` benchmarks share: their options, one timed `bucketrl up --no-live` in a child process,
and its summary."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def timed_up(
    doc: str | None, name: str, fixed: list[str]
) -> tuple[argparse.Namespace, Path, float, dict[str, Any] | None]:
    """Parse the benchmark's options, run `bucketrl up` with ``fixed`` + the user's extra options; the options,
    the run directory, the wall time and the run's summary (None when the run failed: the reason is printed)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="run directory (default: a fresh temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--json", type=Path, help="also write the figures here (benchmarks that support it)")
    parser.add_argument("up_args", nargs="*", help="extra `bucketrl up` options (after --)")
    args = parser.parse_args()
    run_dir = args.dir or Path(tempfile.mkdtemp(prefix=f"bucketrl-{name}-")) / name
    cmd = [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", *fixed, *args.up_args]
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=False)
    wall = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        print(f"{name} run failed (exit {proc.returncode}); logs in {run_dir / 'logs'}")
        return args, run_dir, wall, None
    return args, run_dir, wall, json.loads(summary_path.read_text())
