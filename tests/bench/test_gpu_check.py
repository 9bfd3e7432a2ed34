"""``bench/gpu_check.sh`` on CPU (what runs on a GPU machine, minus CUDA): the tiny shape, bf16, a 2-rank trainer
with its base sharded by FSDP2 (the multi-GPU mode's path: torchrun, here over gloo) and one generator against a
real proxy and Redis; every figure it promises is printed and written.

    .venv/bin/python -m pytest -q -s tests/bench/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_the_pipeline_and_reports_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    argv = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--trainer-procs", "2", "--shard-base"]
    argv += ["--steps", "3"]
    out = subprocess.run(
        [*argv, "--dir", str(tmp_path), "--threads", "1"], env=env, capture_output=True, text=True, timeout=600
    )
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    for line in ("trainer steps/s", "generated tokens/s", "weight sync latency", "logprob |trainer - behaviour|",
                 "peak GPU memory"):  # fmt: skip
        assert line in out.stdout, line
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert figures["trainer_ranks"] == 2 and figures["dtype"] == "bfloat16" and figures["steps"] == 3
    assert figures["trainer_shard_base"] is True and "(base sharded, FSDP2)" in out.stdout
    assert figures["trainer_steps_per_s"] > 0 and figures["trainer_compute_steps_per_s"] > 0
    assert figures["generated_tokens_per_s"] > 0
    assert figures["weight_sync_latency_p50_s"] is not None and figures["publish_s_mean"] > 0
    # Same bf16 weights, same kernels on CPU: the gap is measured (and tiny), not missing.
    assert figures["logprob_abs_gap_mean"] is not None and figures["logprob_abs_gap_mean"] < 0.05
    # No GPU here: said so, not made up.
    assert figures["trainer_torch_peak_gib"] is None and figures["gpu_peak_gib_total"] is None
    log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "rank 1 of 2" in log and "base model sharded over 2 ranks with FSDP2" in log
