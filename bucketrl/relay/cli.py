"""``bucketrl relay``: a regional relay in front of the home proxy (see ``bucketrl/relay/__init__.py``).

    BUCKETRL_CA_FILE=/etc/bucketrl/ca.pem bucketrl relay --upstream https://proxy.home.example:8000 \\
        --cache-dir /var/cache/bucketrl-relay --cache-max-bytes 4000000000 --host 0.0.0.0 --port 8001 \\
        --tls-cert-file /etc/bucketrl/relay.pem --tls-key-file /etc/bucketrl/relay.key

Generators of the region then use ``BUCKETRL_PROXY_URL=https://relay:8001,https://proxy.home.example:8000`` (the
home proxy second: their fallback while the relay is down). The relay verifies its upstream the way a worker
does (``BUCKETRL_CA_FILE`` or the system store; plain HTTP off loopback only with ``BUCKETRL_INSECURE_HTTP=1``):
it carries the callers' tokens. Starlette and uvicorn are imported inside the command so ``bucketrl --help``
stays instant.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from bucketrl import errors
from bucketrl.relay.settings import RelaySettings
from bucketrl.tls import TransportSecurity


def relay_command(
    upstream: Annotated[
        str | None, typer.Option(help="The home proxy's URL (BUCKETRL_RELAY_UPSTREAM_URL).", show_default=False)
    ] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Adapter cache (BUCKETRL_RELAY_CACHE_DIR).")] = None,
    cache_max_bytes: Annotated[
        int | None, typer.Option(help="Cache cap, LRU eviction (BUCKETRL_RELAY_CACHE_MAX_BYTES; 0 = none).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (BUCKETRL_RELAY_HOST; default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (BUCKETRL_RELAY_PORT; default 8001).")] = None,
    tls_cert_file: Annotated[
        str | None, typer.Option(help="PEM certificate chain: serve HTTPS (BUCKETRL_RELAY_TLS_CERT_FILE).")
    ] = None,
    tls_key_file: Annotated[str | None, typer.Option(help="PEM private key (BUCKETRL_RELAY_TLS_KEY_FILE).")] = None,
    max_pending: Annotated[
        int | None, typer.Option(help="Requests waiting on the home proxy before 503s (BUCKETRL_RELAY_MAX_PENDING).")
    ] = None,
    presigned: Annotated[
        bool | None, typer.Option("--presigned", help="Adapters straight from S3 (BUCKETRL_RELAY_PRESIGNED).")
    ] = None,
) -> None:
    """Run a regional relay: adapters from a local cache, every other call forwarded to the home proxy."""
    import uvicorn

    from bucketrl.relay.app import create_app

    given = {
        "upstream_url": upstream,
        "cache_dir": cache_dir,
        "cache_max_bytes": cache_max_bytes,
        "host": host,
        "port": port,
        "tls_cert_file": tls_cert_file,
        "tls_key_file": tls_key_file,
        "max_pending": max_pending,
        "presigned": presigned,
    }
    try:
        settings = RelaySettings(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = errors.settings_problems(exc)
        hint = " (--upstream or BUCKETRL_RELAY_UPSTREAM_URL)" if "upstream_url" in problems else ""
        typer.echo(f"bucketrl relay: {problems}{hint}", err=True)
        raise typer.Exit(code=2) from exc
    security = TransportSecurity.from_env()
    try:
        security.check(settings.upstream_url)
    except ValueError as exc:
        typer.echo(f"bucketrl relay: upstream: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings.cache_dir.mkdir(parents=True, exist_ok=True)
    uvicorn.run(
        create_app(settings, security),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        ssl_certfile=settings.tls_cert_file or None,
        ssl_keyfile=settings.tls_key_file or None,
    )
