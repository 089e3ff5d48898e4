"""How the Kafka log's clients reach the brokers: TLS (a CA file, a client certificate and key)
and SASL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), from a ``kafka://`` URL's query or keyword
options (the service's ``--kafka-*`` settings).

Every client the backend opens — the producers, the admin client, the control client and the
readers' raw Fetch/ListOffsets clients — is an aiokafka client built with ``client_options()``,
so one setting covers them all. SASL is aiokafka's own implementation (``aiokafka.conn``:
SaslHandshake then SaslAuthenticate, SCRAM per RFC 5802 with the standard library's
``hashlib``/``hmac``), used unchanged on every connection, the readers' included.

Secrets (``sasl_password``, and ``sasl_username``) come as values or, with a ``_file`` suffix,
as the path of a file holding them (Docker and Kubernetes secrets). They never appear in the
log's ``url`` (``public_url``), in an error or in ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rolloutlog._tls import TlsFileError, client_context, reason
from rolloutlog.errors import ConfigurationError

__all__ = ["MECHANISMS", "OPTIONS", "PROTOCOLS", "KafkaSecurity", "public_url"]

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
#: The options (URL query keys and keywords) that say how to connect, not which log it is.
OPTIONS = frozenset(
    {
        "security_protocol",
        "sasl_mechanism",
        "sasl_username",
        "sasl_username_file",
        "sasl_password",
        "sasl_password_file",
        "ssl_cafile",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_check_hostname",
    }
)
_SECRETS = ("sasl_username", "sasl_password")
#: How long ``diagnose`` waits for a TLS handshake.
_PROBE_S = 5.0
#: How long ``diagnose`` waits for its probe's socket to close.
_CLOSE_S = 1.0


@dataclass(frozen=True)
class KafkaSecurity:
    """The security settings of one Kafka log; ``PLAINTEXT`` (nothing) by default."""

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "PLAIN"
    sasl_username: str | None = field(default=None, repr=False)
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> KafkaSecurity:
        """From ``OPTIONS`` (others are ignored): ``*_file`` ones read, all checked. A mistake
        is a ``ConfigurationError`` that names the option, never a secret's value."""
        given = {key: value for key, value in options.items() if value is not None}
        values: dict[str, Any] = {}
        for name in _SECRETS:
            path = given.get(f"{name}_file")
            if name in given:
                values[name] = str(given[name])
            elif path:
                values[name] = _read_secret(f"{name}_file", str(path))
        protocol = str(given.get("security_protocol") or "PLAINTEXT").upper()
        if protocol not in PROTOCOLS:
            raise ConfigurationError(
                f"kafka security_protocol {protocol!r}: one of {', '.join(PROTOCOLS)}"
            )
        mechanism = str(given.get("sasl_mechanism") or "PLAIN").upper()
        if mechanism not in MECHANISMS:
            raise ConfigurationError(
                f"kafka sasl_mechanism {mechanism!r}: one of {', '.join(MECHANISMS)}"
            )
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if given.get(name):
                values[name] = str(given[name])
        check = given.get("ssl_check_hostname", True)
        if isinstance(check, str):
            check = check.lower() not in {"0", "false", "no", "off"}
        security = cls(protocol, mechanism, ssl_check_hostname=bool(check), **values)
        security._check(given)
        return security

    def _check(self, given: Mapping[str, Any]) -> None:
        if self.sasl and (not self.sasl_username or not self.sasl_password):
            raise ConfigurationError(
                f"kafka security_protocol {self.security_protocol} needs sasl_username and "
                "sasl_password (or their _file variants)"
            )
        if not self.sasl and ({"sasl_username", "sasl_password"} & set(self._given_secrets())):
            raise ConfigurationError(
                f"kafka sasl credentials given with security_protocol {self.security_protocol}: "
                "use SASL_SSL (or SASL_PLAINTEXT)"
            )
        tls_given = [
            name for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if given.get(name)
        ]
        if tls_given and not self.tls:
            raise ConfigurationError(
                f"kafka {', '.join(tls_given)} given with security_protocol "
                f"{self.security_protocol}: use SSL or SASL_SSL"
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ConfigurationError("kafka ssl_keyfile needs ssl_certfile")
        if self.tls:
            self.ssl_context()  # unreadable files fail now, naming the file

    def _given_secrets(self) -> list[str]:
        return [name for name in _SECRETS if getattr(self, name)]

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of every connection (None without TLS): certificates checked
        against ``ssl_cafile`` (else the system's CAs), and the host name unless
        ``ssl_check_hostname`` is off."""
        if not self.tls:
            return None
        try:
            context = client_context(self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile)
        except TlsFileError as e:
            if e.which == "ca":
                raise ConfigurationError(
                    f"kafka ssl_cafile {self.ssl_cafile}: {e.reason}"
                ) from None
            files = ", ".join(f for f in (self.ssl_certfile, self.ssl_keyfile) if f)
            raise ConfigurationError(
                f"kafka ssl_certfile/ssl_keyfile {files}: {e.reason}"
            ) from None
        context.check_hostname = self.ssl_check_hostname
        return context

    def client_options(self) -> dict[str, Any]:
        """The keyword arguments of every aiokafka client for these settings."""
        options: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.tls:
            options["ssl_context"] = self.ssl_context()
        if self.sasl:
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = self.sasl_username
            options["sasl_plain_password"] = self.sasl_password
        return options

    def describe(self) -> str:
        """What the log's connections use, for its start line (no secret)."""
        if self.sasl:
            return f"{self.security_protocol} {self.sasl_mechanism}"
        return self.security_protocol

    async def diagnose(self, bootstrap_servers: str) -> str | None:
        """Why one connection to the first bootstrap server fails its TLS handshake or SASL
        authentication, in one line; None when it succeeds, fails otherwise (unreachable) or
        the settings are plain. aiokafka's clients log that cause and raise "Unable to
        bootstrap", which does not tell a wrong CA or password from a broker that is down."""
        if self.security_protocol == "PLAINTEXT":
            return None
        from aiokafka.conn import AIOKafkaConnection

        first = bootstrap_servers.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        conn: AIOKafkaConnection | None = None
        try:
            conn = AIOKafkaConnection(
                host.strip("[]"),
                int(port),
                request_timeout_ms=int(_PROBE_S * 1000),
                **self.client_options(),
            )
            async with asyncio.timeout(_PROBE_S):
                await conn.connect()
        except ssl.SSLError as e:
            return f"TLS handshake with {first} failed: {reason(e)}"
        except (ConnectionRefusedError, TimeoutError, ValueError, socket.gaierror):
            return None  # not a question of TLS or SASL: the broker is unreachable
        except OSError as e:
            if not self.sasl:
                return None
            # Reached, then dropped: a broker drops the connection of a client whose SASL
            # mechanism it does not offer (Tansu does), with an EOF or a reset.
            return f"SASL {self.sasl_mechanism} authentication with {first} failed: {_sasl(e)}"
        except Exception as e:  # what the SASL exchange raised (aiokafka's errors vary)
            return f"SASL {self.sasl_mechanism} authentication with {first} failed: {_sasl(e)}"
        finally:
            if conn is not None:
                await _closed(conn)
        return None


async def _closed(conn: Any) -> None:
    """The probe's connection closed, its socket too (bounded): aiokafka closes a connection
    that failed without waiting for it, and a TLS transport lets its socket go only after its
    shutdown, so a probe that returned at once left the socket open behind it."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_CLOSE_S):
            await conn.close()


def _sasl(error: BaseException) -> str:
    """A failed SASL exchange's cause: aiokafka's SCRAM client looks up the server's proof
    (``v=``) in a final message that holds an error (``e=unknown-user``, ``e=invalid-proof``)
    instead, and raises ``KeyError('v')``."""
    if isinstance(error, KeyError) and error.args == ("v",):
        return "the broker refused the credentials (no server proof in its SCRAM answer)"
    text = str(error)
    # aiokafka's errors start their text with their class name already.
    return text if text.startswith(type(error).__name__) else f"{type(error).__name__}: {text}"


def _read_secret(option: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigurationError(f"kafka {option}: cannot read {path}: {reason(e)}") from None


def public_url(url: str) -> str:
    """``url`` without the options of ``OPTIONS``: how to connect (and the secrets) is not part
    of which log it is, so the log's ``url`` (logged, stored in the catalog beside each run)
    stays the same when a password rotates or TLS is turned on."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    kept = [(key, value) for key, value in query if key not in OPTIONS]
    if len(kept) == len(query):
        return url
    return urlunsplit(parts._replace(query=urlencode(kept, safe=",:/")))
