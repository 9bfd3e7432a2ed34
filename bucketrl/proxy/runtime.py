"""Process-level tuning of a serving proxy (``bucketrl proxy``), applied once its app has started.

CPython's cyclic garbage collector was the largest single cost of a loaded proxy: a rollout submit allocates
thousands of objects (8 x 256 token ids and logprobs), so the default first-generation threshold (700
allocations) ran a collection several times per request, and every few of those walked the whole heap of
FastAPI, pydantic and redis-py objects built at start-up. ``bench/proxy_load.py`` measured 1.06 ms of proxy
CPU per request with the defaults and 0.76 ms with :func:`tune_gc` (32 clients).

Only the serving process does this (``create_app(serving=True)``): a test process that builds many apps keeps
CPython's defaults.
"""

from __future__ import annotations

import gc

# Collect the youngest generation every 20k net allocations instead of 700: request garbage is freed by
# reference counting anyway; the collector only has to find cycles, which are rare on the request path.
GEN0_THRESHOLD = 20_000


def tune_gc() -> None:
    """Freeze what start-up built (modules, the app, pools) out of the collector's sight, then raise gen 0."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
