"""``bucketrl agent-router``: one URL for agents, spreading episodes over every generator's endpoint
(:mod:`bucketrl.router.app`).

    BUCKETRL_OPENAI_TOKEN=<the generators' token> bucketrl agent-router --port 8200 \\
        --backend http://gen-0:8100 --backend http://gen-1:8100 [--endpoint-file endpoint.json --run myrun]
    bucketrl agent-router --host 0.0.0.0 --port 8200 --backend-dns generator:8100   # every replica of a service

With ``--endpoint-file`` the router's URL and the token go under "openai" in that JSON file once a generator
answers through it (``bucketrl up --openai-port`` runs it so). Starlette and uvicorn are imported inside the
command so ``bucketrl --help`` stays instant.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import httpx
import typer

from bucketrl.envs.files import merge_json_file

READY_POLL_S = 0.5


def agent_router_command(
    backend: Annotated[
        list[str] | None,
        typer.Option(help="A generator's exposed endpoint (its URL, without /v1); once per generator."),
    ] = None,
    backend_dns: Annotated[
        list[str] | None,
        typer.Option(
            help="HOST:PORT whose addresses are generators' endpoints, re-resolved every 5 s (Compose's service "
            "name, Kubernetes' headless Service)."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free one).")] = 8200,
    endpoint_file: Annotated[
        Path | None, typer.Option(help='Write the router\'s URL and token under "openai" here once it serves.')
    ] = None,
    run: Annotated[str, typer.Option(help="The run's name, for the endpoint file.")] = "",
) -> None:
    """Serve one OpenAI-compatible URL for agents in front of every generator's endpoint."""
    import uvicorn

    from bucketrl.router.app import Router, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        router = Router(backend or [], dns=backend_dns or [])
    except ValueError as exc:
        typer.echo(f"bucketrl agent-router: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections from here on wait in the backlog until uvicorn serves them
    url = f"http://{host}:{sock.getsockname()[1]}"
    typer.echo(f"bucketrl agent-router: {url} -> {', '.join(router.static + router.dns)}")
    if endpoint_file is not None:
        token = os.environ.get("BUCKETRL_OPENAI_TOKEN", "")
        args = (url, token, router.static + router.dns, endpoint_file, run)
        threading.Thread(target=_announce, args=args, daemon=True, name="announce").start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = uvicorn.Config(create_app(router), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def _announce(url: str, token: str, backends: list[str], path: Path, run: str) -> None:
    """Write the endpoint file once a generator answers through the router, so that an agent reading it is served
    (as a generator writes its own only once it serves)."""
    headers = {"Authorization": f"Bearer {token}"}
    while True:
        try:
            if httpx.get(f"{url}/v1/models", headers=headers, timeout=5.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(READY_POLL_S)
    info = {
        "base_url": f"{url}/v1",
        "token": token,
        "episodes_url": f"{url}/v1/episodes",
        "run": run,
        "worker_id": "agent-router",
        "generators": backends,
    }
    merge_json_file(path, {"openai": info})
    logging.getLogger(__name__).info("endpoint for agents: %s/v1 (token in %s)", url, path)
