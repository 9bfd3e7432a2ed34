"""The gateway as a real process (``python -m bucketrl.cli gateway``) in front of a real proxy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.proxy.harness import TOKENS, ProxyHarness

REPO = Path(__file__).resolve().parents[2]


def gateway_env(proxy: ProxyHarness, run: str, state: Path, **settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    env.update(
        {
            "BUCKETRL_PROXY_URL": proxy.url,
            "BUCKETRL_TOKEN": TOKENS["trainer"],
            "BUCKETRL_RUN": run,
            "BUCKETRL_GATEWAY_STATE": str(state),
            "PYTHONPATH": str(REPO),
        }
    )
    env.update({f"BUCKETRL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


@contextmanager
def running_gateway(
    proxy: ProxyHarness, run: str, tmp: Path, *, state: Path | None = None, **settings: object
) -> Iterator[str]:
    """Start ``bucketrl gateway --port 0``; yield its URL; SIGTERM it on exit."""
    url_file = tmp / f"gateway-{time.monotonic_ns()}.url"
    log_path = tmp / f"{url_file.stem}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bucketrl.cli", "gateway", "--port", "0", "--url-file", str(url_file)],
            env=gateway_env(proxy, run, state or tmp / "gateway-state.json", **settings),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while not url_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start (rc {proc.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield url_file.read_text().strip()
    finally:
        proc.terminate()
        proc.wait(20)
