"""Bearer tokens per role, each for every run or for some (a scope): where they come from and
how a presented one is checked.

Roles are ``participant``, ``trainer`` and ``analyst``; ``admin`` holds all three. A token holds
its role for every run, or only for the runs its scope names: exact names (``run-1``) and
prefixes (``exp-*``). Tokens come from a file (JSON or TOML: ``{"trainer": ["…"], "analyst":
"…"}``, where an entry may also be ``{"token": "…", "runs": ["exp-*"]}``) and/or the
environment (``ROLLOUTLOG_TOKEN_TRAINER=tok1,tok2``, or a file named by
``ROLLOUTLOG_TOKEN_TRAINER_FILE``; a line ``TOKEN:RUN,PREFIX-*`` is one token with its scope).
With no token configured at all, authentication is off and the service must listen on loopback
only (``serve`` refuses anything else).

A presented token is compared with *every* configured token using ``hmac.compare_digest``, so
neither the match nor its position leaks through timing. No error about a token names it, nor
any part of it: a mistake is placed by its role and its position among that role's tokens.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rolloutlog.api._env import env_value
from rolloutlog.errors import ConfigurationError

__all__ = [
    "ENV_PREFIX",
    "EVERY_RUN",
    "FULL_ACCESS",
    "IMPLIES",
    "MIN_TOKEN_LENGTH",
    "Access",
    "Role",
    "RunScope",
    "TokenEntry",
    "Tokens",
    "is_loopback_host",
]

#: Tokens shorter than this are refused at start-up: a guessable token is no protection.
MIN_TOKEN_LENGTH = 16
ENV_PREFIX = "ROLLOUTLOG_TOKEN_"
#: Ends a prefix in a scope (``exp-*``: every run whose name begins ``exp-``).
WILDCARD = "*"


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


@dataclass(frozen=True)
class RunScope:
    """The runs a token holds its role for: exact names and name prefixes, or every run."""

    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    every: bool = False

    def covers(self, run: str) -> bool:
        return self.every or run in self.names or run.startswith(self.prefixes)

    def union(self, other: RunScope) -> RunScope:
        if self.every or other.every:
            return EVERY_RUN
        return RunScope(self.names | other.names, tuple({*self.prefixes, *other.prefixes}))

    @classmethod
    def parse(cls, patterns: Sequence[str], where: str) -> RunScope:
        """A scope from run names and prefixes (``exp-*``; ``*`` alone: every run). A pattern
        that is neither is refused; ``where`` places it (the pattern is not echoed: it may be
        part of a token written in an older format)."""
        from rolloutlog.core import run_name_problem  # only when a scope is configured

        names: set[str] = set()
        prefixes: set[str] = set()
        if not patterns:
            raise ConfigurationError(f"{where}: a scope names at least one run or prefix")
        for pattern in patterns:
            if pattern == WILDCARD:
                return EVERY_RUN
            stem = pattern.removesuffix(WILDCARD) if isinstance(pattern, str) else ""
            if run_name_problem(stem) is not None:
                raise ConfigurationError(
                    f"{where}: a scope is run names and prefixes ending in {WILDCARD} "
                    f"(a run name is 1-100 letters, digits and '._-', starting alphanumeric)"
                )
            (prefixes if pattern.endswith(WILDCARD) else names).add(stem)
        return cls(frozenset(names), tuple(sorted(prefixes)))

    def __str__(self) -> str:
        if self.every:
            return WILDCARD
        return ",".join([*sorted(self.names), *(p + WILDCARD for p in self.prefixes)])


#: The scope of a token configured without one.
EVERY_RUN = RunScope(every=True)
#: The scope of no grant at all.
NO_RUN = RunScope()


@dataclass(frozen=True)
class Access:
    """What a presented token holds: each matching entry's role and scope."""

    grants: tuple[tuple[Role, RunScope], ...] = ()

    @property
    def roles(self) -> frozenset[Role]:
        return frozenset(role for role, _ in self.grants)

    def allows(self, needed: Role, run: str | None = None) -> bool:
        """Whether the token holds ``needed`` (for ``run``, when one is named)."""
        return any(
            needed in IMPLIES[role] and (run is None or scope.covers(run))
            for role, scope in self.grants
        )

    def runs_held(self) -> RunScope:
        """The runs the token holds any role for: the run names a reply may show it (a run
        named only by a fork's lineage is left out of a reply to a token that holds none)."""
        found = NO_RUN
        for _, scope in self.grants:
            found = found.union(scope)
        return found

    def runs_for(self, needed: Role) -> RunScope:
        """The runs the token holds ``needed`` for (``NO_RUN`` when none)."""
        found = NO_RUN
        for role, scope in self.grants:
            if needed in IMPLIES[role]:
                found = found.union(scope)
        return found


#: What a request holds when no token is configured (loopback only): everything.
FULL_ACCESS = Access(((Role.ADMIN, EVERY_RUN),))


@dataclass(frozen=True)
class TokenEntry:
    """One configured token: its bytes (for ``compare_digest``), its role and its scope."""

    token: bytes
    role: Role
    scope: RunScope = EVERY_RUN

    def __repr__(self) -> str:  # never the token
        return f"TokenEntry(role={self.role.value!r}, scope={str(self.scope)!r})"


@dataclass(frozen=True)
class Tokens:
    """The configured tokens, each with its role and scope."""

    entries: tuple[TokenEntry, ...] = field(default=())

    @property
    def enabled(self) -> bool:
        """False when no token is configured: authentication is off (loopback only)."""
        return bool(self.entries)

    def access_of(self, presented: str) -> Access:
        """What a presented token holds (no grant when it matches none)."""
        candidate = presented.encode()
        grants = []
        for entry in self.entries:
            # No early exit: every comparison runs whatever matched before.
            if hmac.compare_digest(candidate, entry.token):
                grants.append((entry.role, entry.scope))
        return Access(tuple(grants))

    def roles_of(self, presented: str) -> frozenset[Role]:
        """The roles a presented token grants (empty when it matches none), on some run."""
        return self.access_of(presented).roles

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str) -> Tokens:
        """Tokens from ``role: token | [token | {"token": …, "runs": [...]}, …]``."""
        entries: list[TokenEntry] = []
        for name, value in mapping.items():
            try:
                role = Role(name.lower())
            except ValueError:
                raise ConfigurationError(
                    f"{source}: unknown role {name!r} (roles: {', '.join(r.value for r in Role)})"
                ) from None
            values = [value] if isinstance(value, str | dict) else value
            if not isinstance(values, list):
                raise ConfigurationError(f"{source}: {name} must be a token or a list of tokens")
            for index, item in enumerate(values, 1):
                where = f"{source}: {name} token {index}"
                token, scope = _entry(item, where)
                entries.append(TokenEntry(token.encode(), role, scope))
        return cls(tuple(entries))

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
        """``ROLLOUTLOG_TOKEN_<ROLE>`` (or the file ``ROLLOUTLOG_TOKEN_<ROLE>_FILE`` names):
        tokens separated by commas or newlines, or a line ``TOKEN:RUN,PREFIX-*,…`` for a token
        scoped to those runs."""
        mapping: dict[str, list[Any]] = {}
        for role in Role:
            variable = ENV_PREFIX + role.value.upper()
            items = list(_env_entries(env_value(variable, environ) or "", variable))
            if items:
                mapping[role.value] = items
        return cls.from_mapping(mapping, "environment")

    def merged(self, other: Tokens) -> Tokens:
        return Tokens(self.entries + other.entries)

    @classmethod
    def load(
        cls, path: str | Path | None = None, environ: Mapping[str, str] | None = None
    ) -> Tokens:
        """The file's tokens (when given) plus the environment's."""
        tokens = cls.from_env(environ)
        return cls.from_file(path).merged(tokens) if path is not None else tokens


def _entry(item: Any, where: str) -> tuple[str, RunScope]:
    """A token and its scope from a token file's or a variable's entry."""
    if isinstance(item, dict):
        token, runs = item.get("token"), item.get("runs")
        unknown = set(item) - {"token", "runs"}
        if unknown or not isinstance(token, str):
            raise ConfigurationError(f"{where}: a scoped token is {{token = …, runs = [...]}}")
        if isinstance(runs, str):
            runs = [runs]
        if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
            raise ConfigurationError(f"{where}: runs must be a list of run names and prefixes")
        scope = RunScope.parse(runs, where)
    elif isinstance(item, str):
        token, scope = item, EVERY_RUN
    else:
        raise ConfigurationError(f"{where}: must be a token or {{token = …, runs = [...]}}")
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(f"{where} is shorter than {MIN_TOKEN_LENGTH} characters")
    return token, scope


def _env_entries(value: str, variable: str) -> Iterable[str | dict[str, Any]]:
    """A variable's entries: ``TOKEN:RUN,PREFIX-*`` on a line is one scoped token; any other
    line holds tokens separated by commas (as before scopes existed)."""
    for number, line in enumerate(value.splitlines(), 1):
        token, colon, runs = line.strip().partition(":")
        if colon:
            if "," in token:
                raise ConfigurationError(
                    f"{variable}: line {number}: a scoped token (TOKEN:RUN,PREFIX-*) goes on a "
                    "line of its own"
                )
            yield {"token": token.strip(), "runs": [r.strip() for r in runs.split(",")]}
        else:
            yield from (t.strip() for t in line.split(",") if t.strip())


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
