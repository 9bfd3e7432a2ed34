"""Importable by the proxy's body decoder process (``bucketrl.proxy.decode_pool``): tests see where a body was
decoded, and what happens when the decoder dies."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field


class WhereDecoded(BaseModel):
    pad: str = ""
    # Filled in by the process that validated the body.
    pid: int = Field(default_factory=os.getpid)


def die(raw: bytes | bytearray) -> None:
    """A decoder killed mid-body (the kernel's OOM killer would do this)."""
    os._exit(9)


def echo_len(raw: bytes | bytearray) -> tuple[int, int]:
    return len(raw), os.getpid()
