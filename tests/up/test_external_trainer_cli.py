"""``bucketrl up --external-trainer --gateway-port PORT`` run as a user runs it, a subprocess read by what it prints.

A bad combination stops with exit 2, one line on stderr and no run directory; a good one starts Redis, the proxy and
the gateway (no trainer), writes the gateway's URL under "gateway" in endpoint.json, restarts a killed gateway on the
same port, and stops every service on SIGTERM with exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _up(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", *args]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--gateway-port", "0"], "--gateway-port serves an external trainer"),
        (["--external-trainer", "--max-steps", "3"], "--max-steps is read by bucketrl's own trainer"),
        (["--external-trainer", "--reward", "math"], "--reward is read by bucketrl's own trainer"),
        (["--external-trainer", "--gateway-port", "70000"], "--gateway-port"),
    ],
)
def test_a_bad_combination_is_one_line_and_changes_nothing(tmp_path: Path, args: list[str], says: str) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(_up(run_dir, *args), capture_output=True, text=True, timeout=60, cwd=REPO, env=_env())
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in out.stderr, out.stderr
    assert not run_dir.exists()


def _up_on_a_busy_gateway_port(run_dir: Path) -> tuple[int, subprocess.CompletedProcess[str]]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = _up(run_dir, "--external-trainer", "--gateway-port", str(port))
        return port, subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, env=_env())


def test_a_gateway_port_in_use_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port, out = _up_on_a_busy_gateway_port(run_dir)
    assert out.returncode == 2, out
    assert out.stderr.strip() == (
        f"bucketrl up: --gateway-port {port}: 127.0.0.1:{port} is in use (Address already in use); "
        "pick another port, or 0 for any"
    )
    assert not run_dir.exists()


def test_an_own_trainer_runs_saved_options_do_not_block_an_external_trainer(tmp_path: Path) -> None:
    """A --dir an own-trainer `up` made keeps that trainer's options (up_options.json); with --external-trainer they
    are not this run's and are dropped, not reported as if the user had typed them (here the busy port is next)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "up_options.json").write_text(json.dumps({"max_steps": 5, "lr": 0.01, "generators": 1}))
    port, out = _up_on_a_busy_gateway_port(run_dir)
    assert out.returncode == 2, out
    assert "is read by bucketrl's own trainer" not in out.stderr, out.stderr  # before: "--max-steps is read by ..."
    assert f"--gateway-port {port}: 127.0.0.1:{port} is in use" in out.stderr, out.stderr


def _wait(predicate: object, timeout_s: float, what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"up exited {proc.returncode} waiting for {what}"
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _gateway(run_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((run_dir / "endpoint.json").read_text()).get("gateway")
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow  # ~20 s: the preflight reads the tiny model, then Redis, the proxy and the gateway start
def test_up_serves_the_gateway_until_sigterm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = _up(run_dir, "--external-trainer", "--gateway-port", "0", "--generators", "0")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=_env())
    try:
        _wait(lambda: _gateway(run_dir) is not None, 120, "the gateway in endpoint.json", proc)
        first = _gateway(run_dir)
        assert first is not None
        url = str(first["url"])
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        info = httpx.get(f"{url}/server_info", params={"config_format": "json"}, timeout=5).json()
        assert info["vllm_config"]["lora_config"]["max_lora_rank"] >= 1
        pids = json.loads((run_dir / "services.json").read_text())
        assert set(pids) == {"redis", "proxy", "gateway"}  # no trainer: the external one trains
        # A killed gateway comes back on the same port (TRL keeps the URL it was given).
        os.kill(int(pids["gateway"]), signal.SIGKILL)
        _wait(lambda: (_gateway(run_dir) or {}).get("pid") not in (None, first["pid"]), 90, "a new gateway", proc)
        again = _gateway(run_dir)
        assert again is not None and again["url"] == url
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        pids = json.loads((run_dir / "services.json").read_text())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out
    assert f"gateway    {url}" in out  # what a TRL user copies into vllm_server_base_url
    assert "external trainer: the run's latest version is v0" in out
    assert not [name for name, pid in pids.items() if _alive(int(pid))]
