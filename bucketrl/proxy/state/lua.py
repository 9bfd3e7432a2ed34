"""A Lua script called by SHA with a fallback to EVAL (a restarted or wiped Redis forgot its scripts).

The scripts live in ``scripts/*.lua`` beside this module (package data), each read once, when the module that
runs it is imported: :meth:`Lua.load` joins the files it is given in order, so a script can start with shared
functions (``queued_groups.lua``, ``queue_common.lua``, ``now.lua``) the way an include would.

A client carrying a :class:`~bucketrl.proxy.redis_mux.RedisMux` (``bucketrl_mux``: the proxy's) sends the
call on that shared pipelined connection; when it fails, or is resting after a failure, through the pool."""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from redis import exceptions as redis_exc

SCRIPTS = resources.files(__package__).joinpath("scripts")


class Lua:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    @classmethod
    def load(cls, *names: str) -> Lua:
        """The script made of these files of ``scripts/``, joined in order (shared functions first)."""
        return cls("".join(SCRIPTS.joinpath(name).read_text(encoding="utf-8") for name in names))

    async def __call__(self, r: Any, keys: list[str], args: list[Any]) -> Any:
        mux = getattr(r, "bucketrl_mux", None)
        if mux is not None and mux.available:
            try:
                try:
                    return await mux.execute("EVALSHA", self.sha, len(keys), *keys, *args)
                except redis_exc.NoScriptError:
                    return await mux.execute("EVAL", self.source, len(keys), *keys, *args)
            except (redis_exc.ConnectionError, redis_exc.TimeoutError, OSError):
                pass  # the shared connection failed: through the pool (whose retry re-sends, as it always has)
        try:
            return await r.evalsha(self.sha, len(keys), *keys, *args)
        except redis_exc.NoScriptError:
            return await r.eval(self.source, len(keys), *keys, *args)
