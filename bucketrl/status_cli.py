"""`bucketrl status` (placeholder until issue 5 lands)."""

import typer


def status_command() -> None:
    """Not implemented yet."""
    raise typer.Exit(code=2)
