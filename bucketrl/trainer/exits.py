"""How a trainer ends: its exit codes and the exceptions that end it (kept apart from the worker so that the rank
primitives, :mod:`bucketrl.trainer.ranks`, and the worker's collaborators can raise them without importing it)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_FENCED = 3


class Stopped(Exception):
    """A stop was requested (SIGTERM) while waiting: wind down."""


class ConfigError(Exception):
    """A setting is wrong: the message says which one."""


class RankFailure(RuntimeError):
    """Under torchrun: a collective across the trainer's ranks failed (a rank died or timed out)."""
