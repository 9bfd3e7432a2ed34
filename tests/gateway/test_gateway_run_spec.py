"""``BUCKETRL_RUN_SPEC`` on the gateway: with an external trainer (compose's and the chart's gateway) nothing else
creates the run, so the gateway creates it from the file or confirms it; a spec that changes an immutable field of
the existing run stops it with exit 2 and one line (a real proxy, Redis and a file bucket)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.gateway.support import REPO, gateway_env, running_gateway
from tests.generator.helpers import run_spec
from tests.proxy.harness import running
from tests.support.services import RedisServer


def test_the_gateway_creates_the_run_from_its_spec_and_refuses_a_changed_one(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec_file = tmp_path / "run-spec.json"
    spec_file.write_text(run_spec(tiny_model_dir, max_staleness=3).model_dump_json())
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        with running_gateway(proxy, "ext", tmp_path, run_spec=spec_file) as url:
            models = httpx.get(f"{url}/v1/models", timeout=10).json()
            assert models["data"][0]["id"] == str(tiny_model_dir)
        assert proxy.client("ext", "viewer").get_run().spec.max_staleness == 3  # created on the proxy
        with running_gateway(proxy, "ext", tmp_path, run_spec=spec_file) as url:  # a restart confirms it
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        changed = tmp_path / "changed.json"
        changed.write_text(run_spec(tiny_model_dir, group_size=8).model_dump_json())
        env = gateway_env(proxy, "ext", tmp_path / "state.json", run_spec=changed, log_level="warning")
        out = subprocess.run(
            [sys.executable, "-m", "bucketrl.cli", "gateway", "--port", "0"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "group_size" in lines[0], out.stderr
