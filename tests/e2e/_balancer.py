"""A minimal TCP load balancer for the replica tests: each connection goes to the next backend
round robin, skipping a backend that refuses the connection (a killed replica), so clients see
one address whichever replica is up. A connection already open to a replica that dies breaks
(the client's retries reconnect through another). What a deployment puts in front of replicas
(nginx, HAProxy, a cloud balancer) does the same with health checks.

    python -m tests.e2e._balancer PORT HOST:PORT [HOST:PORT ...]
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


async def serve(port: int, backends: list[tuple[str, int]]) -> None:
    turn = itertools.cycle(range(len(backends)))

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = next(turn)
        for index in range(len(backends)):
            host, backend_port = backends[(first + index) % len(backends)]
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(host, backend_port)
            except OSError:
                continue  # down: the next one
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
            return
        writer.close()  # no backend up: the client sees the connection close

    server = await asyncio.start_server(accept, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    port = int(sys.argv[1])
    backends = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in sys.argv[2:]]
    asyncio.run(serve(port, backends))


if __name__ == "__main__":
    main()
