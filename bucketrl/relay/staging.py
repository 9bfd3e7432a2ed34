"""Staged publish, the relay's half: pull each adapter upload's bytes from the home proxy while the trainer is still
sending them, into the cache (``bucketrl/proxy/staging.py`` is the proxy's half).

With ``BUCKETRL_RELAY_STAGING_TOKEN`` (a ``relay`` token at the home proxy) the relay long-polls ``/v1/staging``
and streams every new upload into a cache flight keyed by (run, version, declared sha256), the same key a caller's
download of the committed version uses. So a generator that asks once the version is announced follows that
flight (cut-through) or is served the finished file, instead of waiting for a fetch across the slow link.

Why nothing uncommitted is ever served: the proxy withholds an upload's last byte until its commit, and ends the
stream short when the publish fails, so a flight completes (hashes right, is renamed into the cache) only for a
committed version; a failed one is dropped with its partial file. And the relay serves a version only after the
home proxy answered the caller's own conditional GET (live, with this sha256), staged or not. The relay token
reads staged bytes only: it cannot lease, submit, announce or download committed versions. A relay that
restarts mid-staging deletes its partial file at start and fetches the committed version as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from pydantic import ValidationError

from bucketrl.relay.cache import AdapterCache
from bucketrl.wire.adapters import StagedUpload, StagingList

log = logging.getLogger("bucketrl.relay.staging")

POLL_S = 30.0
BACKOFF_S = 1.0


class StagingFollower:
    def __init__(self, http: httpx.AsyncClient, cache: AdapterCache, token: str) -> None:
        self.http, self.cache = http, cache
        self.auth = {"Authorization": f"Bearer {token}"}
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Long-poll for new uploads for ever (the relay's lifespan cancels it); each one is pulled at once."""
        after, instance = 0, ""
        while True:
            try:
                resp = await self.http.get(
                    "/v1/staging",
                    params={"after": after, "instance": instance, "wait_s": POLL_S},
                    headers=self.auth,
                    timeout=httpx.Timeout(POLL_S + 30.0, connect=10.0),
                )
                if resp.status_code != 200:
                    log.warning("staging: the home proxy answered %d: %s", resp.status_code, resp.text[:200])
                    await asyncio.sleep(BACKOFF_S * 10)
                    continue
                listing = StagingList.model_validate(resp.json())
            except (httpx.HTTPError, ValidationError, ValueError) as exc:
                log.warning("staging: polling the home proxy failed: %r", exc)
                await asyncio.sleep(BACKOFF_S)
                continue
            if not listing.instance:  # staging is off at the home proxy (BUCKETRL_STAGING_MB=0): ask now and then
                await asyncio.sleep(POLL_S)
                continue
            after, instance = listing.seq, listing.instance
            for upload in listing.uploads:
                task = asyncio.create_task(self.pull(upload))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def pull(self, upload: StagedUpload) -> None:
        """One upload's bytes into the cache; a publish that fails (the stream ends short) leaves nothing."""
        try:
            async with self.http.stream("GET", f"/v1/staging/{upload.upload_id}", headers=self.auth) as resp:
                if resp.status_code != 200:
                    return  # settled before we asked: a caller's download fetches the committed version as before

                async def body() -> AsyncIterator[bytes]:
                    async for chunk in resp.aiter_bytes():  # as they come (a chunk size would hold back the tail)
                        yield chunk

                await self.cache.stage(upload.run, upload.version, upload.sha256, body)
        except Exception as exc:  # a failed publish or a dropped link: nothing kept, nothing to do
            log.info("staging: %s v%d not kept: %r", upload.run, upload.version, exc)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task
