"""The TLS client context of every connection the service opens to its stores (Kafka, the
PostgreSQL catalog): certificates checked against a CA file (else the system's CAs), and a
client certificate when given. A file that cannot be read fails as ``TlsFileError``, naming
which, in its own words, for the caller's one-line refusal."""

from __future__ import annotations

import ssl

__all__ = ["TlsFileError", "client_context", "reason"]


class TlsFileError(Exception):
    """A TLS file could not be read: ``which`` is ``"ca"`` or ``"cert"``, ``reason`` its cause."""

    def __init__(self, which: str, reason: str) -> None:
        super().__init__(reason)
        self.which = which
        self.reason = reason


def client_context(
    cafile: str | None, certfile: str | None = None, keyfile: str | None = None
) -> ssl.SSLContext:
    """A context that checks the server's certificate (and host name: the caller may turn that
    off), with ``certfile``/``keyfile`` as the client's certificate when given."""
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as e:
        raise TlsFileError("ca", reason(e)) from None
    if certfile:
        try:
            context.load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as e:
            raise TlsFileError("cert", reason(e)) from None
    return context


def reason(error: BaseException) -> str:
    """An ``ssl``/OS error's own words, without errno noise."""
    if isinstance(error, ssl.SSLCertVerificationError) and error.verify_message:
        return f"certificate verify failed: {error.verify_message}"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error)
