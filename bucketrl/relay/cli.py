"""``bucketrl relay``: a regional relay in front of the home proxy (see ``bucketrl/relay/__init__.py``).

    bucketrl relay --upstream https://proxy.home.example:8000 --cache-dir /var/cache/bucketrl-relay \\
        --host 0.0.0.0 --port 8001

Generators of the region then use ``BUCKETRL_PROXY_URL=http://relay:8001,https://proxy.home.example:8000`` (the
home proxy second: their fallback while the relay is down). Starlette and uvicorn are imported inside the
command so ``bucketrl --help`` stays instant.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from bucketrl import errors
from bucketrl.relay.settings import RelaySettings


def relay_command(
    upstream: Annotated[
        str | None, typer.Option(help="The home proxy's URL (BUCKETRL_RELAY_UPSTREAM_URL).", show_default=False)
    ] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Adapter cache (BUCKETRL_RELAY_CACHE_DIR).")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (BUCKETRL_RELAY_HOST; default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (BUCKETRL_RELAY_PORT; default 8001).")] = None,
) -> None:
    """Run a regional relay: adapters from a local cache, every other call forwarded to the home proxy."""
    import uvicorn

    from bucketrl.relay.app import create_app

    given = {"upstream_url": upstream, "cache_dir": cache_dir, "host": host, "port": port}
    try:
        settings = RelaySettings(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = errors.settings_problems(exc)
        typer.echo(f"bucketrl relay: {problems} (--upstream or BUCKETRL_RELAY_UPSTREAM_URL)", err=True)
        raise typer.Exit(code=2) from exc
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings.cache_dir.mkdir(parents=True, exist_ok=True)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False
    )
