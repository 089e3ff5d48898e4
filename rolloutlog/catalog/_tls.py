"""TLS to a PostgreSQL catalog, from libpq's URL parameters: ``sslmode`` and ``sslrootcert``
(and ``sslcert``/``sslkey`` for a client certificate), e.g.
``postgresql+asyncpg://user@db.example.com/rolloutlog?sslmode=verify-full&sslrootcert=/ca.pem``.

asyncpg reads these from a DSN of its own but not as ``connect`` arguments, which is how
SQLAlchemy hands it a URL's parameters; so they become the ``ssl`` argument here:

- ``disable``, ``allow``, ``prefer`` (asyncpg's default): passed on as they are;
- ``require``: encrypted, the server's certificate not checked — unless ``sslrootcert`` is
  given, which makes it ``verify-ca`` (as libpq does);
- ``verify-ca``: the certificate must chain to ``sslrootcert`` (else the system's CAs);
- ``verify-full``: that, and the certificate must name the host of the URL.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping

from rolloutlog._tls import TlsFileError, client_context
from rolloutlog.errors import ConfigurationError

__all__ = ["MODES", "PARAMETERS", "ssl_argument"]

MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
#: The URL parameters read here (and not passed to the server as settings).
PARAMETERS = frozenset({"sslmode", "sslrootcert", "sslcert", "sslkey"})


def ssl_argument(query: Mapping[str, str | tuple[str, ...]]) -> str | ssl.SSLContext | None:
    """asyncpg's ``ssl`` argument for a catalog URL's parameters; None when none is given."""
    given = {
        name: value if isinstance(value, str) else value[-1]
        for name, value in query.items()
        if name in PARAMETERS
    }
    if not given:
        return None
    mode = given.get("sslmode", "verify-full" if "sslrootcert" in given else "prefer").lower()
    if mode not in MODES:
        raise ConfigurationError(
            f"catalog URL parameter sslmode={mode!r}: one of {', '.join(MODES)}",
            parameter="sslmode",
        )
    root = given.get("sslrootcert")
    if mode == "require" and root:
        mode = "verify-ca"
    if mode in ("disable", "allow", "prefer"):
        return mode
    try:
        cafile = None if root in (None, "system") else root
        context = client_context(cafile, given.get("sslcert"), given.get("sslkey"))
    except TlsFileError as e:
        files = ", ".join(
            f"{k}={given[k]}" for k in ("sslrootcert", "sslcert", "sslkey") if k in given
        )
        raise ConfigurationError(f"catalog URL TLS files ({files}): {e.reason}") from None
    if mode == "require":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif mode == "verify-ca":
        context.check_hostname = False
    return context
