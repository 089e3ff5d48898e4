"""rolloutlog's settings for NeMo Gym servers, read from the NeMo Gym config itself.

A NeMo Gym config names its servers at the top level (``<instance>: {<server type>: {<impl>:
{entrypoint, ...}}}``). rolloutlog adds a top-level ``rolloutlog:`` dict for the run and, in a
server's own dict, a ``rolloutlog:`` dict for that server (NeMo Gym ignores both: a top-level
dict that is no server is skipped, and server configs ignore unknown keys)::

    rolloutlog:
      url: http://127.0.0.1:8750        # else ROLLOUTLOG_URL
      run: nemo-run-1                   # else ROLLOUTLOG_RUN
      token: ...                        # else ROLLOUTLOG_TOKEN
      kafka: kafka://127.0.0.1:9092     # optional: participants append straight to Kafka
    counter:
      resources_servers:
        example_session_state_mgmt:
          entrypoint: app.py
          domain: agent
          rolloutlog: {mode: restart_only, verify: wait}

Without a run (neither ``rolloutlog.run`` nor ``ROLLOUTLOG_RUN``) servers run as NeMo Gym runs
them, with nothing attached.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutlog.participants import HttpTransport, KafkaTransport, Transport
from rolloutlog.wire import DEFAULT_URL

__all__ = ["SERVER_TYPES", "GymSettings", "load_object", "server_dict", "server_instances"]

#: NeMo Gym's server types (the second level of a server instance's config).
SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")
#: The key of rolloutlog's dicts in a NeMo Gym config.
KEY = "rolloutlog"


def server_instances(config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """``{instance name: (server type, impl dir name)}`` of every server a config starts (those
    with an ``entrypoint``), in config order."""
    found: dict[str, tuple[str, str]] = {}
    for name, value in config.items():
        if not isinstance(value, Mapping) or len(value) == 0:
            continue
        server_type = next(iter(value))
        impls = value[server_type]
        if server_type not in SERVER_TYPES or not isinstance(impls, Mapping) or len(impls) == 0:
            continue
        impl = next(iter(impls))
        if isinstance(impls[impl], Mapping) and "entrypoint" in impls[impl]:
            found[str(name)] = (str(server_type), str(impl))
    return found


def server_dict(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """The inner config dict of server instance ``name`` (entrypoint, host, port, ...)."""
    server_type, impl = server_instances(config)[name]
    inner: Mapping[str, Any] = config[name][server_type][impl]
    return inner


def load_object(path: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ValueError(f"expected 'module:attribute', got {path!r}")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class GymSettings:
    """What one NeMo Gym server needs to be a rolloutlog participant."""

    url: str
    run: str
    participant_id: str
    kind: str
    token: str | None = None
    kafka: str | None = None
    #: The server's own ``rolloutlog:`` dict (``mode``, ``verify``, ``server_class``, ...).
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], name: str, env: Mapping[str, str] | None = None
    ) -> GymSettings | None:
        """The settings of server instance ``name`` (None when no run is configured)."""
        env = os.environ if env is None else env
        run_wide: Mapping[str, Any] = config.get(KEY) or {}
        own: Mapping[str, Any] = server_dict(config, name).get(KEY) or {}
        run = own.get("run") or run_wide.get("run") or env.get("ROLLOUTLOG_RUN")
        if not run:
            return None
        server_type, _ = server_instances(config)[name]
        return cls(
            url=str(run_wide.get("url") or env.get("ROLLOUTLOG_URL") or DEFAULT_URL),
            run=str(run),
            participant_id=str(own.get("id") or name),
            kind=server_type,
            token=run_wide.get("token") or env.get("ROLLOUTLOG_TOKEN"),
            kafka=run_wide.get("kafka") or env.get("ROLLOUTLOG_KAFKA"),
            options=dict(own),
        )

    def transport(self) -> Transport:
        """A transport to the service (HTTP), or straight to Kafka when ``kafka`` is set."""
        if self.kafka:
            return KafkaTransport(self.kafka, url=self.url, token=self.token)
        return HttpTransport(self.url, token=self.token)
