"""`bucketrl up` (placeholder until the up service lands)."""

import typer


def up_command() -> None:
    """Not implemented yet."""
    raise typer.Exit(code=2)
