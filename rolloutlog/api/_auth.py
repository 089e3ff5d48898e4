"""The dependency every route declares its role with (``require(role)`` or ``public``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rolloutlog.api._tokens import Role, Tokens, allows, is_loopback_host
from rolloutlog.errors import Forbidden, Unauthorized

__all__ = ["AuthDependency", "Role", "Tokens", "authorize", "public", "require"]

_bearer = HTTPBearer(auto_error=False, description="A token of the route's role (or admin).")

AuthDependency = Callable[..., Awaitable[None]]


def require(role: Role) -> AuthDependency:
    """The dependency a route declares its role with (``admin`` passes every check)."""

    async def check(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        tokens: Tokens = request.app.state.tokens
        if not tokens.enabled:
            # No tokens: ``serve`` listens on loopback only; refuse anyone else regardless
            # (say, an ASGI server started by hand on another address).
            client = request.client.host if request.client is not None else ""
            if not is_loopback_host(client):
                raise Forbidden(
                    "no tokens are configured: only loopback clients are served",
                    role=role.value,
                )
            return
        if credentials is None or not credentials.credentials:
            raise Unauthorized("a bearer token is required", role=role.value)
        granted = tokens.roles_of(credentials.credentials)
        if not granted:
            raise Unauthorized("the bearer token is not valid", role=role.value)
        if not allows(granted, role):
            raise Forbidden(
                f"this route needs the {role.value} role",
                role=role.value,
                granted=sorted(r.value for r in granted),
            )

    check.role = role  # type: ignore[attr-defined]  # read by route_roles()
    return check


async def authorize(request: Request, check: AuthDependency) -> None:
    """Run a ``require(role)`` check as its dependency would (for a route that solves none)."""
    await check(request, await _bearer(request))


async def public() -> None:
    """The dependency of routes open to everyone (health, readiness, metrics)."""


public.role = None  # type: ignore[attr-defined]


def declared_roles(dependencies: Iterable[Any]) -> list[Role | None]:
    """The roles declared by a route's dependencies (``None`` for ``public``)."""
    return [dep.call.role for dep in dependencies if hasattr(dep.call, "role")]
