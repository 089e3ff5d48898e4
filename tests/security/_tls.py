"""TLS for the security tests: a CA and certificates made with the ``openssl`` command in a temp
dir, and a TLS-terminating proxy in front of a plain broker (Tansu 0.6's own TLS listener does
not handshake: its ``--cert``/``--key`` options conflict and the listener answers in the
clear).

The proxy is real TLS end to end on the client's side: Python's ``ssl`` server, the
certificates signed by the test CA; it forwards the decrypted bytes to the broker, whose
metadata advertises the proxy's port, so every connection a client opens (bootstrap, then per
broker) goes through it.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests._services import unavailable


@dataclass(frozen=True)
class Authority:
    """A test CA: ``cert`` (PEM) signs the certificates ``issue`` writes."""

    directory: Path
    name: str

    @property
    def cert(self) -> Path:
        return self.directory / f"{self.name}.pem"

    @property
    def key(self) -> Path:
        return self.directory / f"{self.name}.key"

    def issue(
        self, name: str, *, dns: Sequence[str] = (), ips: Sequence[str] = ()
    ) -> tuple[Path, Path]:
        """A server certificate for these names: (certificate, key), PEM."""
        cert, key = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        request = self.directory / f"{name}.csr"
        extensions = self.directory / f"{name}.ext"
        names = [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]
        extensions.write_text(
            f"subjectAltName={','.join(names)}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        )
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            request,
            "-subj",
            f"/CN={name}",
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            request,
            "-CA",
            self.cert,
            "-CAkey",
            self.key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "2",
            "-extfile",
            extensions,
        )
        return cert, key


def authority(directory: Path, name: str) -> Authority:
    """A new self-signed CA under ``directory`` (skips, or fails in CI, without ``openssl``)."""
    if shutil.which("openssl") is None:
        unavailable("no openssl command to make test certificates with")
    made = Authority(directory, name)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        made.key,
        "-out",
        made.cert,
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return made


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


class TlsProxy:
    """Terminates TLS on ``port`` (loopback) and forwards to ``target`` in the clear, on a loop
    of its own thread (so a service in another process can use it too)."""

    def __init__(self, port: int, target_port: int, cert: Path, key: Path) -> None:
        self.port = port
        self.target_port = target_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        #: Connections whose TLS handshake completed (on the proxy's side).
        self.handshakes = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(
                self._serve,
                "127.0.0.1",
                self.port,
                ssl=self.context,
                ssl_handshake_timeout=10,
            )
        )
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            # The connections' tasks end (closing their transports), then the transports'
            # close callbacks run, before the loop is closed.
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(asyncio.sleep(0.05))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(1 << 16):
                    sink.write(data)
                    await sink.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                sink.close()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            # Both sides closed whatever ended the pumps (a broker that drops a client mid-SASL,
            # the proxy stopped under a live connection): no socket is left for the GC to warn of.
            up_writer.close()
            writer.close()
