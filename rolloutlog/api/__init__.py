"""The rolloutlog service: the FastAPI app of docs/design.md §8, its auth, and the ``rolloutlog`` CLI.

Names are imported on first use, so that the CLI's client commands start without loading the
server's stack (FastAPI, SQLAlchemy, the projector).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutlog.api._app import PUBLIC_PATHS, create_app, route_roles
    from rolloutlog.api._settings import DEFAULT_HOST, DEFAULT_PORT, Settings
    from rolloutlog.api._tokens import Role, Tokens

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

_WHERE = {
    "PUBLIC_PATHS": "_app",
    "create_app": "_app",
    "route_roles": "_app",
    "DEFAULT_HOST": "_settings",
    "DEFAULT_PORT": "_settings",
    "Settings": "_settings",
    "Role": "_tokens",
    "Tokens": "_tokens",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rolloutlog.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rolloutlog.api.{module}"), name)
    globals()[name] = value
    return value
