"""The catalog's backends by URL scheme: ``backend_for`` imports only the module it chooses
(asyncpg is not loaded for a SQLite catalog), and no backend module imports this one."""

from __future__ import annotations

import importlib

from rolloutlog.catalog._backend import Backend
from rolloutlog.errors import CatalogError

__all__ = ["POSTGRES_SCHEMES", "backend_for"]

#: PostgreSQL URLs as operators write them (libpq's ``postgresql://``, the shorter
#: ``postgres://`` of many hosting providers): all of them go through asyncpg.
POSTGRES_SCHEMES = ("postgresql+asyncpg://", "postgresql://", "postgres://")

#: URL scheme -> (module, class, the scheme the backend is given the URL under).
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "sqlite+aiosqlite://": ("rolloutlog.catalog._sqlite", "SQLiteBackend", "sqlite+aiosqlite://"),
    **{
        scheme: ("rolloutlog.catalog._postgres", "PostgresBackend", POSTGRES_SCHEMES[0])
        for scheme in POSTGRES_SCHEMES
    },
}


def backend_for(url: str) -> Backend:
    """The backend for a catalog URL, its module imported only when chosen."""
    scheme = next((s for s in _BACKENDS if url.startswith(s)), None)
    if scheme is None:
        raise CatalogError(
            f"unsupported catalog URL {url!r}: use sqlite+aiosqlite:///PATH or "
            "postgresql://USER@HOST/DB (also postgres://, postgresql+asyncpg://)",
            url=url,
        )
    module, name, canonical = _BACKENDS[scheme]
    backend: type[Backend] = getattr(importlib.import_module(module), name)
    return backend(canonical + url.removeprefix(scheme))
