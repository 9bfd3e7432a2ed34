"""A Lua script called by SHA with a fallback to EVAL (a restarted or wiped Redis forgot its scripts)."""

from __future__ import annotations

import hashlib
from typing import Any

from redis import exceptions as redis_exc


class Lua:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, r: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await r.evalsha(self.sha, len(keys), *keys, *args)
        except redis_exc.NoScriptError:
            return await r.eval(self.source, len(keys), *keys, *args)
