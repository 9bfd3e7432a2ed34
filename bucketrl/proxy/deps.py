"""``Annotated`` dependencies: each handler's signature says what it needs.

=====================  ===========================================================================
``run_scope``          not a parameter: the app-wide dependency (``create_app``) that runs before every
                       route's own: on a route with a ``{run}`` path parameter it authenticates the caller
                       and answers 403 when the token's run scope excludes the run, before the run is looked
                       up (so an out-of-scope run answers the same whether it exists or not) and before any
                       body is read. A route added later is covered without declaring anything.
``CtxDep``             the app's :class:`~bucketrl.proxy.context.ProxyContext`
``RunId``              the ``{run}`` path parameter, validated (no ``/``, ``..``; 422 otherwise)
``AnyRole``            any token of a run's caller (viewer, generator, trainer, admin; not relay); 401 without one
``TrainerRole``        trainer (or admin); 403 otherwise
``GeneratorRole``      generator (or admin)
``WorkerRole``         trainer or generator (or admin)
``ViewerRole``         viewer, generator or trainer (or admin): read-only routes
``StagingReader``      relay or generator (or admin): reads the staged adapter uploads of its runs
                       (``routes/staging.py``): a regional relay, or a generator that fetches from the proxy itself
``RunDep``             :class:`RunRef` (name + :class:`~bucketrl.wire.RunSpec`); 404 on an unknown run. Read
                       from Redis on every request (no cache: after a Redis wipe the first request must see
                       the run missing and rebuild it, not act on a cached spec over empty state).
                       ``resolve_run`` does the same for routes that need the run only when their own
                       script finds something missing (version leases: an unknown run has no leases;
                       rollout submit and ack, whose scripts read the spec or need it only to restore).
``EpochDep``           the caller's ``X-Trainer-Epoch``, checked against the current epoch: 409 ``fenced``
                       when older. The check here is early rejection only: a write must re-check the
                       epoch atomically with its commit (see ``state/versions.py``'s Lua), because a new
                       trainer can register between this check and the commit.
``EpochHeaderDep``     the header only (422 without it), no Redis read: for a route whose script fences
                       atomically anyway (rollout ack: one round trip less).
=====================  ===========================================================================

Use ``require("trainer", "generator")`` for any other role combination.

Cost: FastAPI solves a dependency's own sub-dependencies again every time it appears (only the final call
is cached), and each solve walks the request's parameters. So these dependencies take the ``Request``
itself rather than ``CtxDep``: the trees stay one level deep (a trainer write solves 5 nodes, not 12, plus
the app-wide ``run_scope``, which authenticates once for the role dependency after it: ``request.state``).
Every one is ``async def`` (a plain ``def`` costs a thread-pool hop per request). ``RunDep`` reads the
spec and the trainer epoch in one Redis round trip and leaves the epoch for ``EpochDep``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request, Security
from fastapi.security import HTTPBearer

from bucketrl import errors
from bucketrl.proxy import rebuild
from bucketrl.proxy.auth import Principal
from bucketrl.proxy.context import ProxyContext
from bucketrl.proxy.state import runs
from bucketrl.proxy.state.locks import fenced_or_restoring
from bucketrl.wire import RunSpec
from bucketrl.wire.common import ID_PATTERN, MAX_WIRE_INT


async def get_ctx(request: Request) -> ProxyContext:
    return request.app.state.ctx


CtxDep = Annotated[ProxyContext, Depends(get_ctx)]

RunId = Annotated[
    str,
    Path(pattern=ID_PATTERN, description="Run id: letters, digits, '_', '.', '-'; starts with a letter or digit."),
]


# Documents bearer auth in the OpenAPI schema (securitySchemes + each operation's security). Its own check is
# off (auto_error=False): TokenAuth reads the header itself, for its precise 401 messages. A declared
# ``Header()`` parameter instead would cost a FastAPI parameter solve on every request.
BEARER = HTTPBearer(
    auto_error=False,
    description="`Authorization: Bearer <token>`; tokens and roles come from BUCKETRL_TOKENS / BUCKETRL_TOKENS_FILE.",
)
BearerScheme = Annotated[Any, Security(BEARER)]


# request.state key: the caller, authenticated once per request (by run_scope or the first role dependency).
_PRINCIPAL = "bucketrl_principal"


def authenticate(request: Request) -> Principal:
    principal: Principal | None = getattr(request.state, _PRINCIPAL, None)
    if principal is None:
        principal = request.app.state.ctx.auth.authenticate(request.headers.get("authorization"))
        setattr(request.state, _PRINCIPAL, principal)
    return principal


async def run_scope(request: Request) -> None:
    """403 for a caller whose token's run scope excludes the route's ``{run}`` (see the module docstring)."""
    run = request.path_params.get("run")
    if run is None:
        return
    principal = authenticate(request)
    if not principal.may_run(str(run)):
        scope = "|".join(principal.runs or ())
        raise errors.Forbidden(
            f"this {principal.role} token is limited to runs {scope!r}; run {str(run)[:80]!r} is not one of them"
        )


async def get_principal(request: Request, _scheme: BearerScheme) -> Principal:
    return authenticate(request)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


# A relay's staging token put where a worker's token belongs (BUCKETRL_TOKEN) is the likely mistake behind a 403.
RELAY_HINT = (
    ": this is a relay token (BUCKETRL_RELAY_STAGING_TOKEN), which reads staged uploads only; "
    "give this worker a token of its own role"
)


def require(*roles: str) -> Callable[..., Coroutine[Any, Any, Principal]]:
    """A dependency admitting ``roles`` (admin always); 401 without a valid token, 403 naming the caller's
    role otherwise. It authenticates itself (no ``PrincipalDep`` sub-dependency: see the module docstring)."""

    async def dependency(request: Request, _scheme: BearerScheme) -> Principal:
        principal = authenticate(request)
        if not principal.may(*roles):
            hint = RELAY_HINT if principal.role == "relay" else ""
            needs = " or ".join(roles)
            raise errors.Forbidden(f"role {principal.role!r} may not call this route (needs {needs}){hint}")
        return principal

    dependency.__name__ = "require_" + "_or_".join(roles)
    return dependency


# Any caller of the runs: a relay's token reads staged uploads only (routes/staging.py), nothing of a run.
AnyRole = Annotated[Principal, Depends(require("viewer", "generator", "trainer"))]
TrainerRole = Annotated[Principal, Depends(require("trainer"))]
GeneratorRole = Annotated[Principal, Depends(require("generator"))]
WorkerRole = Annotated[Principal, Depends(require("trainer", "generator"))]
ViewerRole = Annotated[Principal, Depends(require("viewer", "generator", "trainer"))]
# A generator may read its runs' uploads under way: it may read every committed adapter of them anyway, and the
# held-back last byte (bucketrl/proxy/staging.py) means it never holds a whole uncommitted version.
StagingReader = Annotated[Principal, Depends(require("relay", "generator"))]


@dataclass(frozen=True)
class RunRef:
    run: str
    spec: RunSpec


# request.state key: the trainer epoch read together with the spec by get_run (same Redis round trip).
_EPOCH_SEEN = "bucketrl_trainer_epoch"
_RUN_ID = re.compile(ID_PATTERN)


async def get_run(request: Request, run: RunId) -> RunRef:
    ref, epoch = await _resolve(request.app.state.ctx, run)
    setattr(request.state, _EPOCH_SEEN, (run, epoch))
    return ref


RunDep = Annotated[RunRef, Depends(get_run)]


async def resolve_run(ctx: ProxyContext, run: str) -> RunRef:
    """What ``RunDep`` gives (404 ``unknown_run``; a wiped Redis is rebuilt first), for a route that looks
    its run up only when its own Redis script says something is missing (one round trip less otherwise)."""
    return (await _resolve(ctx, run))[0]


async def resolve_run_and_epoch(ctx: ProxyContext, run: str) -> tuple[RunRef, int]:
    """``resolve_run`` and the current trainer epoch (same round trip)."""
    return await _resolve(ctx, run)


async def _resolve(ctx: ProxyContext, run: str) -> tuple[RunRef, int]:
    spec, epoch = await runs.get_spec_and_epoch(ctx.redis, run)
    if spec is None:
        # A wiped Redis answers "unknown run" for every run until rebuilt: rebuild now rather than at the
        # maintenance loop's next pass (cheap when Redis still knows other runs: one SCARD).
        if await rebuild.rebuild_if_wiped(ctx):
            spec, epoch = await runs.get_spec_and_epoch(ctx.redis, run)
        if spec is None and await rebuild.rebuilding(ctx):
            raise errors.Unavailable(f"run {run!r} is being restored from the bucket; retry", retry_after=1)
    if spec is None:
        raise errors.NotFound(f"unknown run {run!r}: create it with PUT /v1/runs/{run}", code="unknown_run")
    return RunRef(run, spec), epoch


EpochHeader = Annotated[
    int | None, Header(ge=1, le=MAX_WIRE_INT, description="Fencing epoch from POST /v1/runs/{run}/trainer.")
]


def _require_epoch(run: str, x_trainer_epoch: int | None) -> int:
    if x_trainer_epoch is None:
        raise errors.Invalid(
            f"header X-Trainer-Epoch is required for trainer writes: register with POST /v1/runs/{run}/trainer"
        )
    return x_trainer_epoch


async def get_epoch(request: Request, x_trainer_epoch: EpochHeader = None) -> int:
    # ``{run}`` is declared (and validated) by RunDep, which trainer writes always carry first; an id that
    # failed that validation gets its own 422, so it is not looked up here.
    run = str(request.path_params.get("run", ""))
    seen = getattr(request.state, _EPOCH_SEEN, None)
    if (seen is None or seen[0] != run) and not _RUN_ID.match(run):
        return x_trainer_epoch or 0
    x_trainer_epoch = _require_epoch(run, x_trainer_epoch)
    if seen is not None and seen[0] == run:
        current = seen[1]  # read by RunDep in this request, in the same round trip as the spec
    else:
        current = await runs.trainer_epoch(request.app.state.ctx.redis, run)
    if current == 0:  # no epoch at all: a Redis that lost the run (503 until rebuilt), or truly never issued
        raise await fenced_or_restoring(request.app.state.ctx.redis, run, x_trainer_epoch, 0, "(never issued)")
    runs.check_epoch(run, x_trainer_epoch, current)
    return x_trainer_epoch


EpochDep = Annotated[int, Depends(get_epoch)]


async def get_epoch_header(request: Request, x_trainer_epoch: EpochHeader = None) -> int:
    return _require_epoch(str(request.path_params.get("run", "")), x_trainer_epoch)


# The header only (422 without it): for a route whose own Redis script fences the epoch atomically.
EpochHeaderDep = Annotated[int, Depends(get_epoch_header)]
