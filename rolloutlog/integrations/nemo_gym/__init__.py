"""rolloutlog for unmodified NeMo Gym servers: subclasses, ASGI middleware and config.

Importing this package imports no NeMo Gym module: the collector and the middleware run in any
venv, the launcher imports NeMo Gym when it starts servers. ``python -m
rolloutlog.integrations.nemo_gym`` runs ``launch``, ``overlay``, ``serve``, ``collect`` and ``venv``.
"""

import importlib
from typing import Any

from rolloutlog.integrations.nemo_gym._collector import (
    CollectionReport,
    GymCollector,
    episode_id,
    materialize_rows,
)
from rolloutlog.integrations.nemo_gym._config import GymSettings
from rolloutlog.integrations.nemo_gym._context import (
    CAPTURE_KEY_COOKIE,
    RESTORE_COOKIE,
    RESTORE_HEADER,
    GymContextMiddleware,
    current_gym_session,
    restore_id_of,
    rollout_cookies,
    rollout_headers,
)
from rolloutlog.integrations.nemo_gym._exported import SessionState, StateHooks
from rolloutlog.integrations.nemo_gym._launcher import Launcher, build_app, resolve_config, serve
from rolloutlog.integrations.nemo_gym._resources import attach_resources

#: Names whose modules import NeMo Gym: imported when first used (``load_object`` resolves
#: ``rolloutlog.integrations.nemo_gym:RolloutlogSimpleAgent`` through ``__getattr__``).
_GYM_NAMES = {
    "RolloutServerClient": "rolloutlog.integrations.nemo_gym._agent",
    "RolloutlogSimpleAgent": "rolloutlog.integrations.nemo_gym._agent",
    "RolloutlogVLLMModel": "rolloutlog.integrations.nemo_gym._policy",
}


def __getattr__(name: str) -> Any:
    module = _GYM_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CAPTURE_KEY_COOKIE",
    "RESTORE_COOKIE",
    "RESTORE_HEADER",
    "CollectionReport",
    "GymCollector",
    "GymContextMiddleware",
    "GymSettings",
    "Launcher",
    "SessionState",
    "StateHooks",
    "attach_resources",
    "build_app",
    "current_gym_session",
    "episode_id",
    "materialize_rows",
    "resolve_config",
    "restore_id_of",
    "rollout_cookies",
    "rollout_headers",
    "serve",
    "RolloutServerClient",
    "RolloutlogSimpleAgent",
    "RolloutlogVLLMModel",
]
