"""``Annotated`` dependencies: each handler's signature says what it needs.

=====================  ===========================================================================
``CtxDep``             the app's :class:`~bucketrl.proxy.context.ProxyContext`
``RunId``              the ``{run}`` path parameter, validated (no ``/``, ``..``; 422 otherwise)
``AnyRole``            any valid token (viewer, generator, trainer, admin); 401 without one
``TrainerRole``        trainer (or admin); 403 otherwise
``GeneratorRole``      generator (or admin)
``WorkerRole``         trainer or generator (or admin)
``ViewerRole``         viewer, generator or trainer (or admin): read-only routes
``RunDep``             :class:`RunRef` (name + :class:`~bucketrl.wire.RunSpec`); 404 on an unknown run. Read
                       from Redis on every request (no cache: after a Redis wipe the first request must see
                       the run missing and rebuild it, not act on a cached spec over empty state).
``EpochDep``           the caller's ``X-Trainer-Epoch``, checked against the current epoch: 409 ``fenced``
                       when older. The check here is early rejection only: a write must re-check the
                       epoch atomically with its commit (see ``state/versions.py``'s Lua), because a new
                       trainer can register between this check and the commit.
=====================  ===========================================================================

Use ``require("trainer", "generator")`` for any other role combination.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request

from bucketrl import errors
from bucketrl.proxy.auth import Principal
from bucketrl.proxy.context import ProxyContext
from bucketrl.wire import RunSpec
from bucketrl.wire.common import ID_PATTERN


async def get_ctx(request: Request) -> ProxyContext:
    return request.app.state.ctx


CtxDep = Annotated[ProxyContext, Depends(get_ctx)]

RunId = Annotated[
    str,
    Path(pattern=ID_PATTERN, description="Run id: letters, digits, '_', '.', '-'; starts with a letter or digit."),
]


async def get_principal(ctx: CtxDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    return ctx.auth.authenticate(authorization)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require(*roles: str) -> Callable[[Principal], Coroutine[Any, Any, Principal]]:
    """A dependency admitting ``roles`` (admin always); 403 naming the caller's role otherwise."""

    # Every dependency is ``async def``: FastAPI runs a plain ``def`` in the thread pool, a thread hop per call.
    async def dependency(principal: PrincipalDep) -> Principal:
        if not principal.may(*roles):
            raise errors.Forbidden(f"role {principal.role!r} may not call this route (needs {' or '.join(roles)})")
        return principal

    dependency.__name__ = "require_" + "_or_".join(roles)
    return dependency


AnyRole = PrincipalDep
TrainerRole = Annotated[Principal, Depends(require("trainer"))]
GeneratorRole = Annotated[Principal, Depends(require("generator"))]
WorkerRole = Annotated[Principal, Depends(require("trainer", "generator"))]
ViewerRole = Annotated[Principal, Depends(require("viewer", "generator", "trainer"))]


@dataclass(frozen=True)
class RunRef:
    run: str
    spec: RunSpec


async def get_run(ctx: CtxDep, run: RunId) -> RunRef:
    from bucketrl.proxy.state import runs

    spec = await runs.get_spec(ctx.redis, run)
    if spec is None:
        # A wiped Redis answers "unknown run" for every run until rebuilt: rebuild now rather than at the
        # maintenance loop's next pass (cheap when Redis still knows other runs: one SCARD).
        from bucketrl.proxy import rebuild

        if await rebuild.rebuild_if_wiped(ctx):
            spec = await runs.get_spec(ctx.redis, run)
    if spec is None:
        raise errors.NotFound(f"unknown run {run!r}: create it with PUT /v1/runs/{run}", code="unknown_run")
    return RunRef(run, spec)


RunDep = Annotated[RunRef, Depends(get_run)]


async def get_epoch(
    ctx: CtxDep,
    run: RunId,
    x_trainer_epoch: Annotated[
        int | None, Header(ge=1, description="Fencing epoch from POST /v1/runs/{run}/trainer.")
    ] = None,
) -> int:
    from bucketrl.proxy.state import runs

    if x_trainer_epoch is None:
        raise errors.Invalid(
            f"header X-Trainer-Epoch is required for trainer writes: register with POST /v1/runs/{run}/trainer"
        )
    current = await runs.trainer_epoch(ctx.redis, run)
    runs.check_epoch(run, x_trainer_epoch, current)
    return x_trainer_epoch


EpochDep = Annotated[int, Depends(get_epoch)]
