"""``rolloutlog serve``'s configuration: flags, ``ROLLOUTLOG_*`` variables, ``*_FILE`` files.

One precedence rule for every setting: **a flag given on the command line, else the variable
``ROLLOUTLOG_<NAME>``, else (for the secrets: the log and catalog URLs) the file that
``ROLLOUTLOG_<NAME>_FILE`` names, else the default.** So a deployment can run from the
environment alone, keep passwords out of ``argv`` and ``docker inspect``, and still override one
setting by hand. Tokens keep their own variables (``ROLLOUTLOG_TOKEN_<ROLE>`` and
``…_FILE``, see ``_tokens.py``), added to those of ``--tokens FILE``.

Loaded only by ``serve`` (pydantic-settings is not imported by the client commands).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rolloutlog.api._env import FILE_SUFFIX, PREFIX, SECRET_SETTINGS, env_name, file_value
from rolloutlog.api._settings import (
    DEFAULT_DATA_DIR,
    DEFAULT_HOST,
    DEFAULT_PORT,
    LOG_LEVELS,
    MIB,
    Settings,
)
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


class ServeConfig(BaseSettings):
    """Everything ``serve`` is configured with; ``settings()`` is what the app gets."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_ignore_empty=True, frozen=True, extra="ignore"
    )

    data_dir: Path = DEFAULT_DATA_DIR
    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    log_url: str | None = None
    catalog_url: str | None = None
    tokens: Path | None = None
    keep_committed: PositiveInt = Settings.keep_committed
    max_body_mb: PositiveInt = Settings.max_events_bytes // MIB
    validation_workers: NonNegativeInt = Settings.validation_workers
    log_level: str = "info"
    access_log: bool = False
    shutdown_timeout: NonNegativeFloat = Settings.drain_timeout_s
    header_timeout: PositiveFloat = Settings.header_timeout_s
    body_timeout: PositiveFloat = Settings.body_timeout_s
    min_body_rate: NonNegativeInt = Settings.min_body_rate
    max_connections: PositiveInt | None = Settings.max_connections
    reserved_connections: NonNegativeInt = Settings.reserved_connections
    max_inflight_appends: PositiveInt = Settings.max_inflight_appends
    replica_id: str | None = Field(None, min_length=1, max_length=200)
    lease_s: PositiveFloat = DEFAULT_LEASE_S

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return value.lower()

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
    def load(cls, flags: Mapping[str, Any], flag_names: Mapping[str, str]) -> ServeConfig:
        """The configuration from the flags given (``field: value``) and the environment.

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

    def settings(self, tokens: Tokens) -> Settings:
        log_url = self.log_url or ""
        embedded = "://" not in log_url or log_url.startswith("embedded://")  # as ``open_log``
        return Settings(
            data_dir=self.data_dir,
            log_url=self.log_url,
            catalog_url=self.catalog_url,
            tokens=tokens,
            keep_committed=self.keep_committed,
            max_events_bytes=self.max_body_mb * MIB,
            drain_timeout_s=self.shutdown_timeout,
            validation_workers=self.validation_workers,
            header_timeout_s=self.header_timeout,
            body_timeout_s=self.body_timeout,
            min_body_rate=self.min_body_rate,
            max_connections=self.max_connections,
            reserved_connections=self.reserved_connections,
            max_inflight_appends=self.max_inflight_appends,
            # An embedded log has one process at a time (its lock), whatever its port: one
            # replica name, so a restart on another port takes its partitions back at once.
            replica_id=self.replica_id or default_replica_id(None if embedded else self.port),
            address=f"{self.host}:{self.port}",
            lease_s=self.lease_s,
        )


def _source(field: str, flags: Mapping[str, Any], flag_names: Mapping[str, str]) -> str:
    if field in flags:
        return flag_names.get(field, "--" + field.replace("_", "-"))
    name = env_name(field)
    return name if os.environ.get(name) else name + FILE_SUFFIX
