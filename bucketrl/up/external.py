"""``bucketrl up --external-trainer [--gateway-port PORT]``: the deployment without bucketrl's trainer.

Someone else trains: TRL's ``AsyncGRPOTrainer`` (``docs/trl.md``), which reaches its inference server only through
``vllm_server_base_url``. ``up`` then creates the run itself (the spec in ``<dir>/run_spec.json``, as the trainer
would: ``PUT /runs/<run>``, a local dataset uploaded), starts the generators serving completion jobs instead of
the run's prompts, and with ``--gateway-port`` starts ``bucketrl gateway`` beside them:

- its trainer token publishes the versions TRL loads, and a generator token (``BUCKETRL_LEASE_TOKEN``) leases the
  versions TRL can still name, so the proxy's GC follows TRL's staleness window, not the run spec's;
- its name book is ``<dir>/gateway-state.json``: a gateway restarted by ``up`` (or a resumed ``up``) still answers
  the names it published;
- a port-0 gateway keeps the port it got for its restarts: the URL TRL holds stays right;
- its URL goes to ``<dir>/endpoint.json`` under ``"gateway"`` once it listens.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from bucketrl.client import ProxyClient
from bucketrl.preflight import ConfigError
from bucketrl.trainer.exits import ConfigError as TrainerConfigError
from bucketrl.trainer.run_setup import ensure_run
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.up.processes import bucketrl_command

if TYPE_CHECKING:
    from bucketrl.up.cluster import LocalCluster

GATEWAY_STATE = "gateway-state.json"
GATEWAY_URL_FILE = "gateway.url"


def check_port_free(port: int, option: str) -> None:
    """A fixed port already taken stops ``up`` before it writes anything (0 is always free)."""
    if port == 0:
        return
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ConfigError(
                f"{option} {port}: 127.0.0.1:{port} is in use ({exc.strerror}); pick another port, or 0 for any"
            ) from None


def create_run(cluster: LocalCluster) -> None:
    """What bucketrl's trainer does at its start, done by ``up``: create or confirm the run from ``run_spec.json``
    (``dataset.size`` counted when missing) and upload a local dataset. The generators read the spec's base model,
    LoRA and staleness window; the dataset is only checked by them (TRL sends its own prompts)."""
    upload = cluster.cfg.upload_path
    settings = TrainerSettings(
        proxy_url=cluster.proxy_url,
        token=cluster.tokens["trainer"],
        run=cluster.cfg.run,
        run_spec=str(cluster.dir / "run_spec.json"),
        dataset_file=str(upload) if upload is not None else "",
    )
    client = ProxyClient(cluster.proxy_url, cluster.cfg.run, cluster.tokens["trainer"])
    try:
        ensure_run(settings, client)
    except TrainerConfigError as exc:
        raise ConfigError(str(exc)) from None
    finally:
        client.close()


def gateway_env(cluster: LocalCluster) -> dict[str, str]:
    return {
        "BUCKETRL_PROXY_URL": cluster.proxy_url,
        "BUCKETRL_TOKEN": cluster.tokens["trainer"],
        "BUCKETRL_LEASE_TOKEN": cluster.tokens["generator"],
        "BUCKETRL_RUN": cluster.cfg.run,
        "BUCKETRL_HOST": "127.0.0.1",
        "BUCKETRL_GATEWAY_STATE": str(cluster.dir / GATEWAY_STATE),
        "BUCKETRL_LOG_LEVEL": "warning",
    }


def gateway_argv(port: int, url_file: Path) -> list[str]:
    return bucketrl_command("gateway", "--port", str(port), "--url-file", str(url_file))


def gateway_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False
