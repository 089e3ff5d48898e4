"""The rolloutlog service: the FastAPI app of DESIGN.md §8, its auth, and the ``rolloutlog`` CLI."""

from rolloutlog.api._app import PUBLIC_PATHS, create_app, route_roles
from rolloutlog.api._auth import Role, Tokens
from rolloutlog.api._settings import DEFAULT_HOST, DEFAULT_PORT, Settings

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "PUBLIC_PATHS",
    "Role",
    "Settings",
    "Tokens",
    "create_app",
    "route_roles",
]
