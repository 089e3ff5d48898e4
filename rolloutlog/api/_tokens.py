"""Bearer tokens per role: where they come from and how a presented one is checked.

Roles are ``participant``, ``trainer`` and ``analyst``; ``admin`` holds all three. Tokens come
from a file (JSON or TOML: ``{"trainer": ["…"], "analyst": "…"}``) and/or the environment
(``ROLLOUTLOG_TOKEN_TRAINER=tok1,tok2``, or a file named by ``ROLLOUTLOG_TOKEN_TRAINER_FILE``).
With no token configured at all, authentication is off and the service must listen on loopback
only (``serve`` refuses anything else).

A presented token is compared with *every* configured token using ``hmac.compare_digest``, so
neither the match nor its position leaks through timing.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rolloutlog.api._env import env_value
from rolloutlog.errors import ConfigurationError

__all__ = [
    "ENV_PREFIX",
    "IMPLIES",
    "MIN_TOKEN_LENGTH",
    "Role",
    "Tokens",
    "allows",
    "is_loopback_host",
]

#: Tokens shorter than this are refused at start-up: a guessable token is no protection.
MIN_TOKEN_LENGTH = 16
ENV_PREFIX = "ROLLOUTLOG_TOKEN_"


class Role(enum.StrEnum):
    PARTICIPANT = "participant"
    TRAINER = "trainer"
    ANALYST = "analyst"
    ADMIN = "admin"


#: What each role may do beyond its own routes: a trainer reads what an analyst reads (it must
#: see its checkpoints and runs); admin holds every role.
IMPLIES: Mapping[Role, frozenset[Role]] = {
    Role.PARTICIPANT: frozenset({Role.PARTICIPANT}),
    Role.TRAINER: frozenset({Role.TRAINER, Role.ANALYST}),
    Role.ANALYST: frozenset({Role.ANALYST}),
    Role.ADMIN: frozenset(Role),
}


def allows(granted: frozenset[Role], needed: Role) -> bool:
    """Whether tokens of the ``granted`` roles may use a route that needs ``needed``."""
    return any(needed in IMPLIES[role] for role in granted)


@dataclass(frozen=True)
class Tokens:
    """The configured tokens: role → tokens (as bytes, for ``compare_digest``)."""

    by_role: Mapping[Role, tuple[bytes, ...]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """False when no token is configured: authentication is off (loopback only)."""
        return any(self.by_role.values())

    def roles_of(self, presented: str) -> frozenset[Role]:
        """The roles a presented token grants (empty when it matches none)."""
        candidate = presented.encode()
        granted: set[Role] = set()
        for role, tokens in self.by_role.items():
            for token in tokens:
                # No early exit: every comparison runs whatever matched before.
                if hmac.compare_digest(candidate, token):
                    granted.add(role)
        return frozenset(granted)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str) -> Tokens:
        by_role: dict[Role, list[bytes]] = {}
        for name, value in mapping.items():
            try:
                role = Role(name.lower())
            except ValueError:
                raise ConfigurationError(
                    f"{source}: unknown role {name!r} (roles: {', '.join(r.value for r in Role)})"
                ) from None
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise ConfigurationError(f"{source}: {name} must be a token or a list of tokens")
            for token in values:
                if len(token) < MIN_TOKEN_LENGTH:
                    raise ConfigurationError(
                        f"{source}: a {name} token is shorter than {MIN_TOKEN_LENGTH} characters"
                    )
                by_role.setdefault(role, []).append(token.encode())
        return cls({role: tuple(tokens) for role, tokens in by_role.items()})

    @classmethod
    def from_file(cls, path: str | Path) -> Tokens:
        """Read a JSON (``.json``) or TOML (anything else) token file."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ConfigurationError(f"cannot read the token file {path}: {e}") from e
        try:
            mapping = orjson.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
        except (orjson.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigurationError(f"the token file {path} is not valid: {e}") from e
        if not isinstance(mapping, dict):
            raise ConfigurationError(f"the token file {path} must map roles to tokens")
        return cls.from_mapping(mapping, str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Tokens:
        """``ROLLOUTLOG_TOKEN_<ROLE>`` (or the file ``ROLLOUTLOG_TOKEN_<ROLE>_FILE`` names),
        comma- or newline-separated for several tokens."""
        mapping: dict[str, list[str]] = {}
        for role in Role:
            value = env_value(ENV_PREFIX + role.value.upper(), environ) or ""
            tokens = [t.strip() for t in value.replace("\n", ",").split(",") if t.strip()]
            if tokens:
                mapping[role.value] = tokens
        return cls.from_mapping(mapping, "environment")

    def merged(self, other: Tokens) -> Tokens:
        roles = set(self.by_role) | set(other.by_role)
        return Tokens(
            {r: self.by_role.get(r, ()) + other.by_role.get(r, ()) for r in sorted(roles)}
        )

    @classmethod
    def load(
        cls, path: str | Path | None = None, environ: Mapping[str, str] | None = None
    ) -> Tokens:
        """The file's tokens (when given) plus the environment's."""
        tokens = cls.from_env(environ)
        return cls.from_file(path).merged(tokens) if path is not None else tokens


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "testclient"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_host(host: str) -> bool:
    """True for an address only this machine can reach (``serve`` without tokens needs one)."""
    return _is_loopback(host.strip("[]"))
