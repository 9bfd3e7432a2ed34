"""`bucketrl trainer` (placeholder until the trainer service lands)."""

import typer


def trainer_command() -> None:
    """Not implemented yet."""
    raise typer.Exit(code=2)
