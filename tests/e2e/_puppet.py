"""A participant process the crash suite drives step by step (``python -m tests.e2e._puppet``).

It hosts SDK participants (``rolloutlog.participants``) over one transport and executes one JSON
command per stdin line, answering each with one JSON line on stdout. Between two commands it is
idle, so the test knows exactly what it has made durable when it SIGKILLs it: a hold point
without sleeps. Commands:

- ``{"op": "open", "transport": "http"|"kafka", "url", "token", "log_url"?}``
- ``{"op": "participant", "name", "kind", "id", "options"?}`` → the registered epoch
- ``{"op": "call", "target", "method", "args"?, "kwargs"?, "as"?}`` → the method's result
  (awaited when it is a coroutine; an object without a JSON form is kept under ``as``)
- ``{"op": "get", "target", "attr", "as"?}`` → an attribute (kept under ``as``)
- ``{"op": "restores", "url", "token"}`` then ``call`` on target ``restores``
- ``{"op": "exit"}``
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import sys
from typing import Any

import orjson

from rolloutlog.participants import (
    Agent,
    Environment,
    HttpTransport,
    KafkaTransport,
    Policy,
    Resources,
    Restores,
    Transport,
)

KINDS: dict[str, Any] = {
    "environment": Environment,
    "agent": Agent,
    "policy": Policy,
    "resources": Resources,
}


def jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return jsonable(value._asdict())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return {"object": type(value).__name__}


class Puppet:
    def __init__(self) -> None:
        self.transport: Transport | None = None
        self.objects: dict[str, Any] = {}

    async def handle(self, command: dict[str, Any]) -> Any:
        op = command["op"]
        if op == "open":
            if command["transport"] == "kafka":
                self.transport = KafkaTransport(
                    command["log_url"], url=command["url"], token=command["token"]
                )
            else:
                self.transport = HttpTransport(command["url"], token=command["token"])
            await self.transport.start()
            return None
        if op == "participant":
            assert self.transport is not None
            cls = KINDS[command["kind"]]
            participant = cls(
                self.transport, command["run"], command["id"], **command.get("options", {})
            )
            self.objects[command["name"]] = participant
            return await participant.register()
        if op == "restores":
            self.objects["restores"] = Restores(command["url"], token=command["token"])
            return None
        if op == "call":
            target = self.objects[command["target"]]
            method = getattr(target, command["method"])
            result = method(*command.get("args", []), **command.get("kwargs", {}))
            if inspect.isawaitable(result):
                result = await result
            if inspect.isasyncgen(result):
                result = [item async for item in result]
            if command.get("as"):
                self.objects[command["as"]] = result
            return jsonable(result)
        if op == "get":  # an attribute of an object (kept under ``as``, when given)
            value = getattr(self.objects[command["target"]], command["attr"])
            if command.get("as"):
                self.objects[command["as"]] = value
            return jsonable(value)
        raise ValueError(f"unknown op {op!r}")

    async def close(self) -> None:
        if "restores" in self.objects:
            await self.objects["restores"].close()
        if self.transport is not None:
            await self.transport.stop()


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    puppet = Puppet()
    out = sys.stdout.buffer
    while line := await reader.readline():
        command = orjson.loads(line)
        if command["op"] == "exit":
            break
        try:
            reply = {"ok": True, "result": await puppet.handle(command)}
        except Exception as e:  # reported to the test, which decides
            reply = {
                "ok": False,
                "error": type(e).__name__,
                "code": getattr(e, "code", None),
                "message": str(e),
            }
        out.write(orjson.dumps(reply) + b"\n")
        out.flush()
    await puppet.close()


if __name__ == "__main__":
    asyncio.run(main())
