"""`bucketrl proxy` (placeholder until the proxy service lands)."""

import typer


def proxy_command() -> None:
    """Not implemented yet."""
    raise typer.Exit(code=2)
