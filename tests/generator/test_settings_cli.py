"""Generator settings from BUCKETRL_* variables, and a CLI that starts without torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from bucketrl.generator.settings import GeneratorSettings


def test_every_setting_is_documented() -> None:
    for name, field in GeneratorSettings.model_fields.items():
        assert field.description, f"GeneratorSettings.{name} has no description"


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUCKETRL_ENGINE", "vllm")
    monkeypatch.setenv("BUCKETRL_PROXY_URL", "https://proxy:8000/")
    monkeypatch.setenv("BUCKETRL_RUN", "r1")
    monkeypatch.setenv("BUCKETRL_GPU_MEMORY_UTILIZATION", "0.85")
    monkeypatch.setenv("BUCKETRL_PROMPTS_PER_REQUEST", "32")
    s = GeneratorSettings()
    assert (s.engine, s.proxy_url, s.run, s.gpu_memory_utilization, s.prompts_per_request) == (
        "vllm",
        "https://proxy:8000",
        "r1",
        0.85,
        32,
    )


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("BUCKETRL_ENGINE", "tensorrt"),
        ("BUCKETRL_GPU_MEMORY_UTILIZATION", "1.5"),
        ("BUCKETRL_MAX_LORAS", "1"),
        ("BUCKETRL_PROXY_URL", "proxy:8000"),
        ("BUCKETRL_REWARD_TIMEOUT_S", "0"),
    ],
)
def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch, env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError):
        GeneratorSettings()


def test_cli_imports_no_heavy_library_and_refuses_bad_settings() -> None:
    code = (
        "import sys; from bucketrl.cli import app; import bucketrl.generator.cli, bucketrl.generator.settings; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    out = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "generator", "--engine", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "engine" in out.stderr


def test_a_bad_setting_is_one_line_that_names_it_and_not_the_token() -> None:
    env = {**os.environ, "BUCKETRL_PROXY_URL": "http://127.0.0.1:9", "BUCKETRL_TOKEN": "s3cret-token"}
    out = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "generator", "--runs", "a b"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bucketrl generator: ") and "BUCKETRL_RUNS" in lines[0], lines
    assert "s3cret-token" not in out.stderr


def test_sigterm_while_the_proxy_is_unreachable_exits_at_once() -> None:
    """Nothing is held before the run is found, so a notice has nothing to wait for: the start-up poll makes one
    attempt per round (the client's own outage retries used to hold the exit for most of a 30 s stop grace)."""
    env = {**os.environ, "BUCKETRL_PROXY_URL": "http://127.0.0.1:9", "BUCKETRL_TOKEN": "t"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketrl.cli", "generator", "--run", "a"],
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "BUCKETRL_PREEMPTION_NOTICE_S": "60"},
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # the worker is past start-up and polling the unreachable proxy
        if "waiting for run a" in line:
            break
    time.sleep(2.0)  # into the poll's backoff
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, rest
    assert time.monotonic() - t0 < 5.0
    assert "stopped" in rest
