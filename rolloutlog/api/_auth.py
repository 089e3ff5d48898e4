"""The dependency every route declares its role with (``require(role)`` or ``public``), and the
checks of the runs a request names (its path's ``{run}``, a body's runs).

A token holds its role for every run or for those its scope names (``_tokens.RunScope``): a
route whose path names a run (``/v1/runs/{run}/…``) needs the role on that run, a request that
names more (creating a run, forking one into another) needs it on every one of them
(``authorize_runs``), and a listing shows what the token holds the role for (``runs_of``). A
token out of its scope gets ``403 forbidden``, whether the run exists or not, and a reply names
another run (a fork's source) only if the token holds a role on it (``runs_known``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rolloutlog.api._tokens import FULL_ACCESS, Access, Role, RunScope, Tokens, is_loopback_host
from rolloutlog.errors import Forbidden, Unauthorized

__all__ = [
    "ANALYST",
    "CHECKS",
    "PARTICIPANT",
    "PUBLIC",
    "TRAINER",
    "AuthDependency",
    "Role",
    "Tokens",
    "access_if_any",
    "authorize",
    "authorize_runs",
    "public",
    "require",
    "runs_known",
    "runs_of",
]

_bearer = HTTPBearer(auto_error=False, description="A token of the route's role (or admin).")

AuthDependency = Callable[..., Awaitable[None]]


def require(role: Role) -> AuthDependency:
    """The dependency a route declares its role with (``admin`` passes every check); a path
    that names a run (``{run}``) needs the role on that run."""

    async def check(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        run = request.path_params.get("run")
        _access(request, _presented(credentials), role, () if run is None else (run,))

    check.role = role  # type: ignore[attr-defined]  # read by route_roles()
    return check


async def authorize(request: Request, check: AuthDependency) -> None:
    """Run a ``require(role)`` check as its dependency would (for a route that solves none)."""
    await check(request, await _bearer(request))


async def authorize_runs(request: Request, role: Role, runs: Iterable[str]) -> Access:
    """What the request's token holds, once it is known to hold ``role`` on every one of
    ``runs`` (``401``/``403`` otherwise): the check of a request that names runs in its body
    (the run it creates; a fork's source and target)."""
    return _access(request, _presented(await _bearer(request)), role, tuple(runs))


async def runs_of(request: Request, role: Role) -> RunScope:
    """The runs the request's token holds ``role`` for (every run for an unscoped token)."""
    return (await authorize_runs(request, role, ())).runs_for(role)


async def runs_known(request: Request) -> RunScope:
    """The runs whose names a reply may show the request's token: those it holds any role
    for (every run for an unscoped token). A fork's source out of them is not named."""
    return (await authorize_runs(request, Role.ANALYST, ())).runs_held()


async def access_if_any(request: Request) -> Access:
    """What the request's token holds, if anything, for a public route that shows more to a
    token (no grant for a missing or unknown token: never a refusal)."""
    tokens: Tokens = request.app.state.tokens
    if not tokens.enabled:
        return FULL_ACCESS
    presented = _presented(await _bearer(request))
    return _lookup(request, tokens, presented) if presented else Access()


def _presented(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return credentials.credentials if credentials is not None else None


def _lookup(request: Request, tokens: Tokens, presented: str) -> Access:
    """What ``presented`` holds, compared with the configured tokens once per request (a route's
    role dependency and its check of the runs in its body ask again)."""
    known: tuple[str, Access] | None = getattr(request.state, "token_access", None)
    if known is not None and known[0] == presented:  # the same request's own header
        return known[1]
    access = tokens.access_of(presented)
    request.state.token_access = (presented, access)
    return access


def _access(request: Request, presented: str | None, role: Role, runs: tuple[str, ...]) -> Access:
    tokens: Tokens = request.app.state.tokens
    if not tokens.enabled:
        # No tokens: ``serve`` listens on loopback only; refuse anyone else regardless
        # (say, an ASGI server started by hand on another address).
        client = request.client.host if request.client is not None else ""
        if not is_loopback_host(client):
            raise Forbidden(
                "no tokens are configured: only loopback clients are served", role=role.value
            )
        return FULL_ACCESS
    if not presented:
        raise Unauthorized("a bearer token is required", role=role.value)
    access = _lookup(request, tokens, presented)
    if not access.grants:
        raise Unauthorized("the bearer token is not valid", role=role.value)
    if not access.allows(role):
        raise Forbidden(
            f"this route needs the {role.value} role",
            role=role.value,
            granted=sorted(r.value for r in access.roles),
        )
    for run in runs:
        if not access.allows(role, run):
            raise Forbidden(
                f"this token holds the {role.value} role for other runs, not {run!r}",
                role=role.value,
                run=run,
            )
    return access


async def public() -> None:
    """The dependency of routes open to everyone (health, readiness, metrics)."""


public.role = None  # type: ignore[attr-defined]

#: Each role's check (``authorize(request, CHECKS[role])`` where no dependency is solved).
CHECKS: dict[Role, AuthDependency] = {role: require(role) for role in Role}
#: The ``dependencies=`` of a route, by the role it needs (``PUBLIC``: none).
PARTICIPANT = [Depends(CHECKS[Role.PARTICIPANT])]
TRAINER = [Depends(CHECKS[Role.TRAINER])]
ANALYST = [Depends(CHECKS[Role.ANALYST])]
PUBLIC = [Depends(public)]


def declared_roles(dependencies: Iterable[Any]) -> list[Role | None]:
    """The roles declared by a route's dependencies (``None`` for ``public``)."""
    return [dep.call.role for dep in dependencies if hasattr(dep.call, "role")]
