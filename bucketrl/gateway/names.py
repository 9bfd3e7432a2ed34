"""The adapter names the gateway has published: ``lora_name`` -> run version, kept in a small JSON file.

vLLM forgets its adapters when it restarts; TRL would then fail on the next request that names one. The gateway
writes the book (atomically: temp file + rename) after a version is committed and before it answers the load, so
a restarted gateway answers every name it ever acknowledged. A crash after the commit but before the write is
covered by the publisher, which recognises the latest version's sha256 as the same adapter and adopts it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field


class NameEntry(BaseModel):
    version: int = Field(ge=1)
    sha256: str
    unloaded: bool = False


class NameBookFile(BaseModel):
    run: str
    names: dict[str, NameEntry] = Field(default_factory=dict)


class NameBook:
    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        self.run = run
        self.data = NameBookFile(run=run)
        if path.exists():
            loaded = NameBookFile.model_validate_json(path.read_text())
            if loaded.run != run:
                raise ValueError(f"{path} holds the names of run {loaded.run!r}, not {run!r}: use another file")
            self.data = loaded

    def get(self, name: str) -> NameEntry | None:
        return self.data.names.get(name)

    def loaded(self) -> dict[str, NameEntry]:
        return {k: v for k, v in self.data.names.items() if not v.unloaded}

    def put(self, name: str, entry: NameEntry) -> None:
        self.data.names[name] = entry
        self._save()

    def unload(self, name: str) -> bool:
        entry = self.data.names.get(name)
        if entry is None or entry.unloaded:
            return False
        self.data.names[name] = entry.model_copy(update={"unloaded": True})
        self._save()
        return True

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(self.data.model_dump(), fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
