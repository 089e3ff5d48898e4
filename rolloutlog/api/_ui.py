"""The analysts' dashboard at ``/ui``: one HTML shell, a stylesheet and three plain scripts
(DOM and API helpers, the charts, the pages; loaded in that order), all served from the package
(nothing from a CDN).

The pages hold no data: the scripts read everything from the REST API with the analyst's
token (typed once, kept in the tab's ``sessionStorage``), so what the dashboard shows is what
the API answers, and the pages themselves are public like ``/docs``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from rolloutlog.api._auth import PUBLIC
from rolloutlog.api._models import EpisodePath, RunPath

__all__ = ["UI_ASSETS", "install_ui"]

UI_ASSETS = "/ui/static"
_DIR = Path(__file__).parent / "ui"


@functools.cache
def _page() -> str:
    return (_DIR / "index.html").read_text()  # once per process: no file I/O per request


def _shell() -> HTMLResponse:
    html = _page()
    return HTMLResponse(
        html,
        headers={
            "Cache-Control": "no-store",
            "Content-Security-Policy": (
                "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'"
            ),
        },
    )


def install_ui(app: FastAPI) -> None:
    """Add the dashboard's pages and assets to ``app``."""
    app.mount(UI_ASSETS, StaticFiles(directory=_DIR / "static"), name="ui-assets")

    @app.get("/ui", include_in_schema=False, dependencies=PUBLIC)
    async def runs_page() -> HTMLResponse:
        return _shell()

    @app.get("/ui/runs/{run}", include_in_schema=False, dependencies=PUBLIC)
    async def run_page(run: RunPath) -> HTMLResponse:
        return _shell()

    @app.get("/ui/runs/{run}/episodes/{episode}", include_in_schema=False, dependencies=PUBLIC)
    async def episode_page(run: RunPath, episode: EpisodePath) -> HTMLResponse:
        return _shell()
