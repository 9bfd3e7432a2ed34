"""The per-app context every route reaches through ``CtxDep``: settings, Redis, the bucket, telemetry.

One ``ProxyContext`` is built by the app's lifespan (``bucketrl.proxy.app.create_app``) and stored on
``app.state.ctx``; nothing here is a module-level singleton, so several apps (tests, replicas in one
process) never share state except through Redis and the bucket, exactly like separate replicas.

One setting is per process, not per app: ``http_protocol.HEADER_TIMEOUT_S``, which ``create_app(serving=True)``
sets from the settings, because uvicorn builds its HTTP protocol objects itself from a class named by import
string and hands them no app state. Only ``bucketrl proxy`` (one app per process) serves that way; apps built for
tests keep uvicorn's own protocol.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bucketrl.proxy.identity import IdentityState

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from bucketrl.proxy.adapter_cache import AdapterCache
    from bucketrl.proxy.auth import TokenAuth
    from bucketrl.proxy.bucket_meter import BucketMeter
    from bucketrl.proxy.notify import Notifier
    from bucketrl.proxy.settings import ProxySettings
    from bucketrl.proxy.staging import Staging
    from bucketrl.proxy.state.cleanup import BatchCleaner
    from bucketrl.proxy.telemetry import Telemetry
from bucketrl.storage.base import BucketStore


@dataclass
class ProxyContext:
    settings: ProxySettings
    # decode_responses=False: values are bytes; decode where a str is meant.
    redis: aioredis.Redis
    store: BucketStore
    telemetry: Telemetry
    auth: TokenAuth
    # Fans Redis pub/sub version announcements out to waiting long-polls (one subscription per app).
    notifier: Notifier | None = None
    # Deletes settled rollout batch objects off the request path (``state/cleanup.py``); set by the lifespan.
    cleaner: BatchCleaner | None = None
    # Adapter tars recently served (one bucket read per version per replica); None when disabled.
    adapter_cache: AdapterCache | None = None
    # Adapter uploads under way, readable by relays before their commit (``staging.py``); None when off.
    staging: Staging | None = None
    # Bucket requests and bytes per run and link, not yet in Redis (``bucket_meter.py``; the run's cost).
    meter: BucketMeter | None = None
    # Serialises rebuilds inside this app (several requests may notice a wiped Redis at once).
    rebuild_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Whether the bucket is this deployment's (``identity.py``); set by the lifespan.
    identity: IdentityState = field(default_factory=IdentityState)
    # Extra per-app objects other areas hang on the context (e.g. P3's queue helpers), by name.
    extras: dict[str, object] = field(default_factory=dict)
