"""The OpenAPI document made readable: every route under one tag, its role in its description,
and Swagger UI served from files on this machine (no CDN: ``/docs`` works offline)."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

from rolloutlog.api._auth import PUBLIC, declared_roles
from rolloutlog.api._tokens import IMPLIES, Role

__all__ = ["DOCS_ASSETS", "TAGS", "document", "install_docs", "tag_of"]

#: Where the Swagger UI bundle is served from (the files ship in the
#: ``fastapi-offline`` wheel; only its static directory is used).
DOCS_ASSETS = "/docs/assets"
_ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"

TAGS = [
    {"name": "runs", "description": "Runs, their participants and the controller."},
    {"name": "events", "description": "Appending events, and reading one back in full."},
    {"name": "checkpoints", "description": "Taking checkpoints; their manifests."},
    {
        "name": "restores",
        "description": "Restores, their plans, and the projections they hand out.",
    },
    {
        "name": "analysts",
        "description": "Read-only views: episodes and their histories, statistics, projector lag.",
    },
    {"name": "operations", "description": "Liveness, readiness, metrics and these documents."},
]


def tag_of(method: str, path: str) -> str:
    """The tag of a route, from its path."""
    if not path.startswith("/v1/"):
        return "operations"
    if path.endswith("/events") or "/events/" in path:
        return "events"
    if "/restores" in path or path.endswith("/projection"):
        return "restores"
    if "/checkpoints" in path:
        return "checkpoints"
    if any(part in path for part in ("/episodes", "/stats", "/projector", "/quarantine")):
        return "analysts"
    return "runs"


def _role_line(role: Role | None) -> str:
    if role is None:
        return "**Role:** none (public)."
    holders = [r.value for r in Role if role in IMPLIES[r] and r is not role]
    also = f" (or {', '.join(holders)})" if holders else ""
    return f"**Role:** `{role.value}`{also}."


def document(app: FastAPI) -> None:
    """Tag every API route and state its role; call once every route is in place."""
    app.openapi_tags = TAGS
    for route in app.routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        roles = declared_roles(route.dependant.dependencies)
        method = sorted(route.methods or {"GET"})[0]
        route.tags = [tag_of(method, route.path)]
        line = _role_line(roles[0] if roles else None)
        body = route.description or ""
        if not body.startswith("**Role:**"):
            route.description = f"{line}\n\n{body}".rstrip()
    app.openapi_schema = None


def install_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) with its assets served locally; the app is created with
    ``docs_url=None, redoc_url=None`` so that FastAPI's CDN pages are not added. (No ReDoc: its
    bundle loads a logo from cdn.redoc.ly, with no option to turn it off.)"""
    app.mount(DOCS_ASSETS, StaticFiles(directory=_ASSETS_DIR), name="docs-assets")

    @app.get("/docs", include_in_schema=False, dependencies=PUBLIC)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="rolloutlog API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False, dependencies=PUBLIC)
    async def swagger_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
