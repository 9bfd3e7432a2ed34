"""`bucketrl generator` (placeholder until the generator service lands)."""

import typer


def generator_command() -> None:
    """Not implemented yet."""
    raise typer.Exit(code=2)
