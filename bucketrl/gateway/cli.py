"""``bucketrl gateway``: a vLLM-compatible server for TRL's ``AsyncGRPOTrainer``, backed by a bucketrl run.

    BUCKETRL_PROXY_URL=http://proxy:8000 BUCKETRL_TOKEN=<trainer token> BUCKETRL_RUN=myrun bucketrl gateway --port 8100

then ``AsyncGRPOConfig(vllm_server_base_url="http://127.0.0.1:8100", ...)``. Run it beside the trainer: it reads
the adapter directories TRL names. Every setting is a ``BUCKETRL_*`` variable (``bucketrl/gateway/settings.py``).
FastAPI and uvicorn are imported inside the command so ``bucketrl --help`` stays instant.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from bucketrl import errors
from bucketrl.gateway.settings import GatewaySettings


def gateway_command(
    host: Annotated[str | None, typer.Option(help="Bind address (BUCKETRL_HOST; default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (BUCKETRL_PORT; default 8100; 0: any free one).")] = None,
    run: Annotated[str | None, typer.Option(help="The run (BUCKETRL_RUN).")] = None,
    url_file: Annotated[
        Path | None, typer.Option(help="Write the URL the gateway serves on here once it listens (for scripts).")
    ] = None,
) -> None:
    """Serve vLLM's routes for TRL's AsyncGRPOTrainer: adapter loads publish versions, completions go to the pool."""
    import uvicorn

    from bucketrl.gateway.app import create_app

    overrides = {k: v for k, v in {"host": host, "port": port, "run": run}.items() if v is not None}
    settings = GatewaySettings(**overrides)  # type: ignore[arg-type]
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings)
    except (errors.BucketRLError, ValueError) as exc:
        typer.echo(f"bucketrl gateway: run {settings.run!r} on {settings.proxy_url}: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)  # connections from here on wait in the backlog until uvicorn serves them
    url = f"http://{settings.host}:{sock.getsockname()[1]}"
    typer.echo(f"bucketrl gateway: serving run {settings.run!r} on {url}")
    if url_file is not None:
        url_file.write_text(url + "\n")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = uvicorn.Config(app, log_level=settings.log_level, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
