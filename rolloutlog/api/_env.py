"""Configuration from ``ROLLOUTLOG_*`` environment variables, and their ``*_FILE`` variants.

A secret (a catalog URL with its password, a token) can be handed over as a file instead of a
value, as Docker and Kubernetes secrets are: ``ROLLOUTLOG_CATALOG_URL_FILE=/run/secrets/catalog``
reads the value from that file, its surrounding whitespace (the trailing newline) stripped. The
variable itself wins over its ``*_FILE`` variant, and a flag wins over both (see ``serve``).
Kept free of heavy imports: the CLI's client commands read the token through it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rolloutlog.errors import ConfigurationError

__all__ = ["FILE_SUFFIX", "PREFIX", "SECRET_SETTINGS", "env_name", "env_value", "file_value"]

PREFIX = "ROLLOUTLOG_"
FILE_SUFFIX = "_FILE"
#: ``serve``'s settings that may hold a password (or a user name), hence also read from a
#: ``*_FILE``.
SECRET_SETTINGS = frozenset(
    {"log_url", "catalog_url", "kafka_sasl_username", "kafka_sasl_password"}
)


def env_name(setting: str) -> str:
    """The variable of a ``serve`` setting: ``catalog_url`` → ``ROLLOUTLOG_CATALOG_URL``."""
    return PREFIX + setting.upper()


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable ``name``, else the contents of the file ``name_FILE`` names, else None.

    An empty variable counts as unset (``VAR=`` in an env file).
    """
    env = os.environ if environ is None else environ
    return env.get(name) or file_value(name, env)


def file_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The contents of the file that ``name_FILE`` names (None when it is unset or empty).

    An unreadable file is a configuration mistake, raised with the variable's name rather than
    passed over silently.
    """
    env = os.environ if environ is None else environ
    path = env.get(name + FILE_SUFFIX)
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigurationError(f"{name}{FILE_SUFFIX}: cannot read {path}: {e}") from e
