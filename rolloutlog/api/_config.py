"""``rolloutlog serve``'s configuration: flags, ``ROLLOUTLOG_*`` variables, ``*_FILE`` files.

One precedence rule for every setting: **a flag given on the command line, else the variable
``ROLLOUTLOG_<NAME>``, else (for the secrets: the log and catalog URLs) the file that
``ROLLOUTLOG_<NAME>_FILE`` names, else the default.** So a deployment can run from the
environment alone, keep passwords out of ``argv`` and ``docker inspect``, and still override one
setting by hand. Tokens keep their own variables (``ROLLOUTLOG_TOKEN_<ROLE>`` and
``…_FILE``, see ``_tokens.py``), added to those of ``--tokens FILE``.

``ServeConfig``'s fields are generated from ``_settings.SETTINGS`` (each setting is declared
once, there). Loaded only by ``serve`` (pydantic-settings is not imported by the client
commands).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Self

from pydantic import AfterValidator, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rolloutlog.api._env import FILE_SUFFIX, PREFIX, SECRET_SETTINGS, env_name, file_value
from rolloutlog.api._settings import SETTINGS, Setting, Settings
from rolloutlog.api._tokens import Tokens
from rolloutlog.errors import ConfigurationError
from rolloutlog.projections import DEFAULT_LEASE_S, default_replica_id

__all__ = ["ServeConfig"]


class _FileVariants(PydanticBaseSettingsSource):
    """The secrets' ``ROLLOUTLOG_<NAME>_FILE`` variables, below the plain variables."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if field_name not in SECRET_SETTINGS:
            return None, field_name, False
        return file_value(env_name(field_name)), field_name, False

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            value, _, _ = self.get_field_value(field, name)
            if value is not None:
                values[name] = value
        return values


class _ServeConfig(BaseSettings):
    """Everything ``serve`` is configured with, by setting name (``_settings.SETTINGS``);
    ``settings()`` is what the app gets."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_ignore_empty=True, frozen=True, extra="ignore"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags (passed as init arguments) > variables > *_FILE; no .env file is read.
        return init_settings, env_settings, _FileVariants(settings_cls)

    @classmethod
    def load(cls, flags: Mapping[str, Any], flag_names: Mapping[str, str]) -> Self:
        """The configuration from the flags given (``setting: value``) and the environment.

        A bad value is a ``ConfigurationError`` naming where it came from (``--port``,
        ``ROLLOUTLOG_PORT`` or ``ROLLOUTLOG_CATALOG_URL_FILE``) — never a secret's value.
        """
        try:
            return cls(**flags)
        except ValidationError as e:
            problems = []
            for error in e.errors():
                field = str(error["loc"][0]) if error["loc"] else ""
                where = _source(field, flags, flag_names)
                got = "" if field in SECRET_SETTINGS else f" (got {error['input']!r})"
                problems.append(f"{where}: {error['msg']}{got}")
            raise ConfigurationError("; ".join(problems)) from None

    def settings(self, tokens: Tokens | None = None) -> Settings:
        """The app's settings, with ``tokens`` (default: ``--tokens FILE``'s and the
        variables', ``Tokens.load``) and the defaults computed at start (the replica's name,
        its lease) filled in."""
        values = self.model_dump()
        given = Settings.from_settings(values)
        # An embedded log has one process at a time (its lock), whatever its port: one
        # replica name, so a restart on another port takes its partitions back at once.
        port = None if given.embedded_log else given.port
        return dataclasses.replace(
            given,
            tokens=Tokens.load(given.tokens_file) if tokens is None else tokens,
            replica_id=given.replica_id or default_replica_id(port),
            address=f"{given.host}:{given.port}",
            lease_s=given.lease_s or DEFAULT_LEASE_S,
        )


def _field(setting: Setting) -> tuple[Any, Any]:
    kind: Any = setting.kind
    if setting.default is None:
        kind = kind | None
    bounds = {
        key: getattr(setting, key)
        for key in ("ge", "gt", "le", "min_length", "max_length")
        if getattr(setting, key) is not None
    }
    if setting.choices is not None:
        kind = Annotated[kind, AfterValidator(_one_of(setting.choices))]
    return kind, Field(setting.flag_default, **bounds)


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value.lower() not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value.lower()

    return check


#: The generated model: one field per setting, named as its flag and variable are.
ServeConfig: type[_ServeConfig] = create_model(  # type: ignore[call-overload]  # the fields' dict
    "ServeConfig",
    __base__=_ServeConfig,
    __module__=__name__,
    __doc__=_ServeConfig.__doc__,
    **{setting.name: _field(setting) for setting in SETTINGS},
)


def _source(field: str, flags: Mapping[str, Any], flag_names: Mapping[str, str]) -> str:
    if field in flags:
        return flag_names.get(field, "--" + field.replace("_", "-"))
    name = env_name(field)
    return name if os.environ.get(name) else name + FILE_SUFFIX
