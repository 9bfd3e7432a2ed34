"""``endpoint.json``: written by two processes (``bucketrl up`` with the proxy's address, the exposing generator
with the agents' endpoint), each merging its own keys, atomically, readable by the owner only (a bearer token)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def merge_json_file(path: Path, update: dict[str, Any], *, drop: tuple[str, ...] = ()) -> None:
    """Set ``update``'s keys (and remove ``drop``) in the JSON object at ``path``, created if missing."""
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    for key in drop:
        data.pop(key, None)
    data.update(update)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
