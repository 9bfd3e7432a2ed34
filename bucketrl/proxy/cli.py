"""``bucketrl proxy``: serve the proxy with uvicorn.

    BUCKETRL_REDIS_URL=redis://127.0.0.1:6379/0 BUCKETRL_BUCKET_URL=file:///var/lib/bucketrl \\
    BUCKETRL_TOKENS="trainer:t,generator:g,viewer:v" bucketrl proxy --host 0.0.0.0 --port 8000

Every setting is a ``BUCKETRL_*`` environment variable (``bucketrl/proxy/settings.py``); ``--host``,
``--port``, ``--log-level``, ``--tls-cert-file`` and ``--tls-key-file`` override theirs (given a certificate and
key, the proxy serves HTTPS only; docs/deploy.md "TLS"). Responses leave in one socket write each
(``http_protocol.py``). ``--workers N`` runs N processes on the port: the proxy
is stateless, so they are simply N replicas (a way to use more cores of one machine). ``--rebuild``
restores runs, versions and checkpoint pointers from the bucket's manifests into Redis before serving
(after a Redis loss). FastAPI, uvicorn and Redis are imported inside the command so ``bucketrl --help``
stays instant.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Annotated

import typer
from pydantic import ValidationError

from bucketrl import errors
from bucketrl.proxy.settings import ProxySettings


def proxy_command(
    host: Annotated[str | None, typer.Option(help="Bind address (BUCKETRL_HOST; default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (BUCKETRL_PORT; default 8000).")] = None,
    rebuild: Annotated[
        bool, typer.Option("--rebuild", help="Restore Redis state from the bucket manifests before serving.")
    ] = False,
    log_level: Annotated[str | None, typer.Option(help="uvicorn log level (BUCKETRL_LOG_LEVEL).")] = None,
    tls_cert_file: Annotated[
        str | None, typer.Option(help="PEM certificate chain: serve HTTPS (BUCKETRL_TLS_CERT_FILE).")
    ] = None,
    tls_key_file: Annotated[str | None, typer.Option(help="PEM private key (BUCKETRL_TLS_KEY_FILE).")] = None,
    workers: Annotated[
        int, typer.Option(min=1, help="Processes serving the port (each a stateless replica sharing Redis).")
    ] = 1,
) -> None:
    """Run the proxy: the REST control plane over Redis and the bucket."""

    import uvicorn

    from bucketrl.proxy.app import create_app

    overrides: dict[str, object] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if log_level is not None:
        overrides["log_level"] = log_level
    if tls_cert_file is not None:
        overrides["tls_cert_file"] = tls_cert_file
    if tls_key_file is not None:
        overrides["tls_key_file"] = tls_key_file
    if rebuild:
        overrides["rebuild_forced"] = True
    try:
        settings = ProxySettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:  # a bad BUCKETRL_* value (a negative price): say which, no traceback
        typer.echo(f"bucketrl proxy: bad settings: {errors.settings_problems(exc)}", err=True)
        raise typer.Exit(code=2) from exc
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings, serving=True)
    except ValueError as exc:
        typer.echo(f"bucketrl proxy: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the handler that was
    # installed before it: make that an orderly exit (0 for SIGTERM, as Kubernetes and compose expect).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    http = _http_protocol()
    # The same protocol serves HTTPS: asyncio's SSL transport sits under the coalescing wrapper (http_protocol.py).
    cert, key = settings.tls_cert_file or None, settings.tls_key_file or None
    if workers == 1:
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=False,
            http=http,
            limit_concurrency=settings.max_connections,
            timeout_graceful_shutdown=settings.shutdown_grace_s,
            ssl_certfile=cert,
            ssl_keyfile=key,
        )
        return
    # Several processes: each builds its own app from the environment, so pass the overrides that way.
    for name, value in overrides.items():
        os.environ[f"BUCKETRL_{name.upper()}"] = str(value)
    uvicorn.run(
        "bucketrl.proxy.app:serving_app",
        factory=True,
        workers=workers,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        http=http,
        limit_concurrency=settings.max_connections,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        ssl_certfile=cert,
        ssl_keyfile=key,
    )


def _http_protocol() -> str:
    """uvicorn's httptools protocol sending each response in one write (``http_protocol.py``), if installed."""
    try:
        from bucketrl.proxy.http_protocol import HTTP_PROTOCOL
    except ImportError:  # no httptools: uvicorn picks its pure-Python h11 protocol
        return "auto"
    return HTTP_PROTOCOL
