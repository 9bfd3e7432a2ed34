"""Every router of the proxy, in mount order. Each module under ``routes/`` exposes ``router: APIRouter``.

Owners: runs, adapters, leases, checkpoints, observe, health (P2); prompts, rollouts (P3); ui (U,
optional: mounted only when ``bucketrl/proxy/routes/ui.py`` exists).
"""

from __future__ import annotations

import importlib
import importlib.util

from fastapi import APIRouter

# Starlette tries routes in mount order until one matches (a regex per route), so the routes every worker
# calls many times a second come first. No two modules' paths overlap, so the order changes no match.
CORE = (
    "rollouts",
    "prompts",
    "leases",
    "adapters",
    "runs",
    "checkpoints",
    "observe",
    "health",
    "evals",
    "completion_jobs",
    "pool",
    "staging",
)
OPTIONAL = ("ui",)


def all_routers() -> list[APIRouter]:
    modules = [importlib.import_module(f"{__name__}.{name}") for name in CORE]
    for name in OPTIONAL:
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            modules.append(importlib.import_module(f"{__name__}.{name}"))
    return [m.router for m in modules]
