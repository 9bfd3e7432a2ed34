"""``docker compose up`` without Docker: the compose services' own environments, run as real processes, train.

    .venv/bin/python -m pytest -q -m slow tests/deploy/test_compose_topology.py

Each service of ``docker-compose.yml`` runs its exact command with its exact environment (interpolated from
``.env.example``); only what Docker would provide is mapped to this machine: service names become the test's
real Redis and S3 (moto) servers, the ``models`` volume a temp directory that ``model-init``'s own command
fills, bind mounts their repo files. The trainer is limited to a few steps (``BUCKETRL_MAX_STEPS``, the only
added setting) so the test ends; then it must exit 0 having published versions that the generator produced
rollouts for, and the generator must exit 0 on SIGTERM.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.support import (
    ENV_EXAMPLE,
    ROOT,
    ServiceProcess,
    bind_mounts,
    compose_proxy_args,
    compose_proxy_env,
    load_compose,
    read_env_file,
    service_env,
    wait_http_ok,
    with_secrets,
)
from tests.support.services import free_port

pytestmark = pytest.mark.slow


def test_compose_services_train_together(redis_server, moto_server, tmp_path: Path) -> None:
    env_file = with_secrets(read_env_file(ENV_EXAMPLE))  # the proxy refuses .env.example's placeholders
    compose = load_compose(ROOT / "docker-compose.yml", env=env_file)
    services = compose["services"]
    volume_root = tmp_path / "volumes"

    def local(path: str) -> str:
        """A container path on the `models` volume -> the temp directory standing in for that volume."""
        return str(volume_root / path.lstrip("/")) if path.startswith("/models") else path

    # model-init: its own entrypoint + command, with the volume path mapped.
    init = services["model-init"]
    cmd = [sys.executable if init["entrypoint"][0] == "python" else init["entrypoint"][0], *init["entrypoint"][1:]]
    subprocess.run([*cmd, *map(local, init["command"])], check=True, timeout=300, cwd=tmp_path)

    env = compose_proxy_env(compose, redis_server.url, moto_server.endpoint, port := free_port())
    moto_server.create_bucket(env["BUCKETRL_BUCKET_URL"].removeprefix("s3://").split("/")[0])
    proxy = ServiceProcess(compose_proxy_args(compose, port), env, tmp_path)
    base = f"http://127.0.0.1:{port}"
    workers: dict[str, ServiceProcess] = {}
    try:
        wait_http_ok(f"{base}/readyz", proxy)
        for name in ("trainer", "generator"):
            svc = services[name]
            wenv = service_env(svc)
            wenv["BUCKETRL_PROXY_URL"] = base
            mounts = bind_mounts(svc)
            for key, value in list(wenv.items()):
                if value in mounts:  # a bind-mounted file: the repo file, with volume paths inside mapped
                    text = mounts[value].read_text().replace('"/models/', f'"{volume_root}/models/')
                    (tmp_path / f"{name}-{mounts[value].name}").write_text(text)
                    wenv[key] = str(tmp_path / f"{name}-{mounts[value].name}")
                elif value.startswith("/cache"):
                    wenv[key] = str(tmp_path / name / value.lstrip("/"))
            if name == "trainer":
                wenv.update(BUCKETRL_MAX_STEPS="2", BUCKETRL_CHECKPOINT_EVERY="1")
            (tmp_path / name).mkdir(exist_ok=True)
            workers[name] = ServiceProcess(list(svc["command"]), wenv, tmp_path / name)

        trainer, generator = workers["trainer"], workers["generator"]
        deadline = time.monotonic() + 420
        while trainer.proc.poll() is None:
            # In compose `restart: on-failure` would restart a dead generator; here it is a failure to report.
            assert generator.proc.poll() is None, f"generator exited:\n{generator.output()}"
            assert time.monotonic() < deadline, f"no 2 steps in time:\n{trainer.output()}\n---\n{generator.output()}"
            time.sleep(1)
        assert trainer.proc.returncode == 0, trainer.output()

        viewer = env_file["VIEWER_TOKEN"]
        run = service_env(services["trainer"])["BUCKETRL_RUN"]
        status = httpx.get(f"{base}/v1/runs/{run}/status", headers={"Authorization": f"Bearer {viewer}"}, timeout=10)
        assert status.status_code == 200, status.text
        body = status.json()
        assert body["latest_version"] >= 2, json.dumps(body)[:2000]  # v1 + at least one trained version
        assert body["trainer"]["step"] == 2, json.dumps(body)[:2000]
    finally:
        codes = {name: w.stop(timeout_s=60) for name, w in workers.items()}
        proxy_code = proxy.stop()
    assert codes.get("generator") == 0, workers["generator"].output()
    assert proxy_code == 0, proxy.output()
