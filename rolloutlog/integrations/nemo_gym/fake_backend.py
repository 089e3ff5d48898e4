"""A fake OpenAI-compatible inference backend for NeMo Gym's ``vllm_model`` (tests and demos).

``python -m rolloutlog.integrations.nemo_gym.fake_backend --port P --call-log FILE`` serves what
``vllm_model`` calls, deterministically and without a model (``_fake_model``: a script carried in
the request's ``metadata.fake_script``, one token per byte):

- ``POST /v1/chat/completions``: with ``logprobs`` and ``return_tokens_as_token_ids`` each token
  as ``token_id:N`` with its log probability (vLLM's form); ``stream: true`` streams Server-Sent
  Events at ``--token-rate`` tokens/s (a request's ``metadata.fake_token_rate`` overrides it;
  ``stream_options.include_usage`` adds the usage chunk);
  ``continue_final_message: true`` continues the final assistant message's text (vLLM's
  semantics: only the new text comes back, tool calls parsed from it), and ``prompt_logprobs``
  returns each prompt token's log probability (vLLM's top-level ``prompt_logprobs``);
- ``POST /v1/completions``: only vLLM's scoring form (``prompt`` token ids, ``echo: true``,
  ``max_tokens: 0``): the sequence's ``prompt_logprobs``, no token generated;
- ``POST /tokenize`` (``{"tokens": [...]}``) and ``POST /detokenize`` (``{"prompt": text}``),
  as vLLM serves them beside ``/v1``; ``GET /v1/models``, ``GET /health``.

**The call log survives the crash of its callers:** this process appends one JSON line per
model call when it starts (``{"event": "start", "n", "conversation", "turn", "continued",
"stream", "prompt"}``) and one when it ends (``{"event": "end", "n", "generated",
"finish_reason", "aborted"}``), each written with one ``write`` on an ``O_APPEND`` file.
``read_call_log`` pairs them. A scoring request appends one ``{"event": "score", "tokens",
"turn", "prompt"}`` line (``read_scores``): a prefill, not a model call. Tokenizer routes
(``/tokenize``, ``/detokenize``) run no model and are not logged.

**Holds** park a call deterministically: ``POST /fake/holds {"match": text, "turn": k,
"after_tokens": n}`` parks the next call whose first user message contains ``match`` (at turn
``k``, if given) once it has generated ``n`` tokens (a streamed call has sent them);
``GET /fake/held?wait_s=`` waits until one is parked; ``POST /fake/release`` releases them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rolloutlog.integrations.nemo_gym._fake_model import (
    TOOL_CLOSE,
    TOOL_OPEN,
    Turn,
    decode,
    encode,
    parse_output,
    prompt_tokens,
    sequence_logprobs,
    turn_of,
)

__all__ = ["CallLog", "FakeBackend", "read_call_log", "read_scores"]


#: Tokens per streamed event (a hold after n tokens parks at the first multiple of it >= n).
STREAM_STEP = 8


class CallLog:
    """Appends one JSON line per event with a single ``write`` (O_APPEND: whole lines)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        os.write(self._fd, orjson.dumps({**record, "t": time.time()}) + b"\n")

    def close(self) -> None:
        os.close(self._fd)


def read_call_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The model calls of a call log, in start order: each start line merged with its end line
    (``generated``, ``finish_reason``, ``aborted``; absent while the call runs)."""
    calls: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_bytes().splitlines():
        record = orjson.loads(line)
        event = record.pop("event")
        if event == "start":
            calls[record["n"]] = record
        elif event == "end" and record["n"] in calls:
            calls[record["n"]].update(record)
    return list(calls.values())


def read_scores(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The scoring requests of a call log (``{"tokens", "turn", "prompt"}``, in order): a
    prefill of a sequence for its log probabilities, no token generated."""
    records = (orjson.loads(line) for line in Path(path).read_bytes().splitlines())
    return [r for r in records if r.pop("event") == "score"]


@dataclass
class _Hold:
    match: str
    turn: int | None
    after_tokens: int
    remaining: int = 1
    parked: list[dict[str, Any]] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)


class FakeBackend:
    """The backend's state: its call log, the calls so far, and the armed holds."""

    def __init__(
        self, call_log: CallLog, *, token_rate: float = 4000.0, model: str = "fake"
    ) -> None:
        self.log = call_log
        self.token_rate = token_rate
        self.model = model
        self.calls = 0
        self.holds: list[_Hold] = []
        self._parked = asyncio.Condition()

    # -- holds -------------------------------------------------------------------------------

    async def park(self, turn: Turn, generated: int) -> None:
        for hold in self.holds:
            if (
                hold.remaining > 0
                and hold.match in turn.prompt
                and hold.turn in (None, turn.turn)
                and generated >= hold.after_tokens
            ):
                hold.remaining -= 1
                hold.parked.append({"prompt": turn.prompt, "turn": turn.turn, "tokens": generated})
                async with self._parked:
                    self._parked.notify_all()
                await hold.released.wait()
                return

    async def wait_parked(self, wait_s: float) -> list[dict[str, Any]]:
        async with self._parked:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._parked.wait_for(lambda: any(h.parked for h in self.holds)), wait_s
                )
        return [p for h in self.holds for p in h.parked]

    def release(self) -> None:
        for hold in self.holds:
            hold.released.set()
        self.holds = []

    # -- generation --------------------------------------------------------------------------

    def _begin(self, request: Mapping[str, Any], turn: Turn, prefix: str, stream: bool) -> int:
        self.calls += 1
        self.log.write(
            {
                "event": "start",
                "n": self.calls,
                "conversation": turn.conversation,
                "turn": turn.turn,
                "continued": len(encode(prefix)),
                "stream": stream,
                "prompt": turn.prompt,
            }
        )
        return self.calls

    def _rate(self, request: Mapping[str, Any]) -> float:
        """The request's token rate: its ``metadata.fake_token_rate``, else the backend's."""
        return float((request.get("metadata") or {}).get("fake_token_rate") or self.token_rate)

    async def _pace(self, request: Mapping[str, Any], count: int) -> None:
        """Generating ``count`` tokens takes their time at the request's token rate."""
        await asyncio.sleep(count / self._rate(request))

    def completion(
        self, request: Mapping[str, Any]
    ) -> tuple[Turn, str, list[int], str, list[float]]:
        """The turn, the prefix continued, the new tokens (after ``max_tokens``), the finish
        reason and the new tokens' log probabilities."""
        turn, prefix = turn_of(request)
        if not turn.text.startswith(prefix):
            raise ValueError(
                "continue_final_message: the final message is not a prefix of the turn"
            )
        new = encode(turn.text[len(prefix) :])
        limit = request.get("max_tokens") or request.get("max_completion_tokens")
        finish = "stop"
        if limit is not None and len(new) > int(limit):
            new, finish = new[: int(limit)], "length"
        elif TOOL_OPEN in decode(new):
            finish = "tool_calls"
        prompt = prompt_tokens(request)
        return turn, prefix, new, finish, sequence_logprobs([*prompt, *new], len(prompt))

    @staticmethod
    def token_logprobs(values: list[float], start: int, tokens: list[int]) -> list[dict[str, Any]]:
        """Entries of the new tokens from index ``start`` (``values``: theirs, from 0)."""
        return [
            {
                "token": f"token_id:{token}",
                "logprob": values[start + i],
                "bytes": [token - 1000],
                "top_logprobs": [],
            }
            for i, token in enumerate(tokens)
        ]

    @staticmethod
    def prompt_logprobs(tokens: list[int]) -> list[Any]:
        """vLLM's ``prompt_logprobs`` of a prompt's tokens: None for the first token, then
        ``{id: {"logprob", "rank", "decoded_token"}}`` (a continued prefix's tokens get the log
        probabilities they were generated with: one function of the sequence)."""
        values = sequence_logprobs(tokens, 1)
        return [
            None,
            *(
                {str(t): {"logprob": v, "rank": 1, "decoded_token": f"token_id:{t}"}}
                for t, v in zip(tokens[1:], values, strict=True)
            ),
        ]

    def _message(self, turn: Turn, new: list[int]) -> dict[str, Any]:
        content, calls = parse_output(turn, decode(new))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message

    def _usage(self, request: Mapping[str, Any], new: list[int]) -> dict[str, int]:
        prompt = len(prompt_tokens(request))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(new),
            "total_tokens": prompt + len(new),
        }

    async def complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        turn, prefix, new, finish, values = self.completion(request)
        n = self._begin(request, turn, prefix, False)
        await self.park(turn, 0)
        await self._pace(request, len(new))
        await self.park(turn, len(new))
        choice: dict[str, Any] = {
            "index": 0,
            "message": self._message(turn, new),
            "finish_reason": finish,
            "logprobs": None,
        }
        if request.get("logprobs"):
            choice["logprobs"] = {"content": self.token_logprobs(values, 0, new)}
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(request, new),
        }
        if request.get("prompt_logprobs") is not None:
            reply["prompt_logprobs"] = self.prompt_logprobs(prompt_tokens(request))
        self.log.write(
            {
                "event": "end",
                "n": n,
                "generated": len(new),
                "finish_reason": finish,
                "aborted": False,
            }
        )
        return reply

    def score(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's scoring form of ``/v1/completions`` (``prompt`` token ids, ``echo``,
        ``max_tokens: 0``): the sequence's ``prompt_logprobs``, nothing generated; logged as a
        ``score`` line (not a model call: no token is generated)."""
        tokens = request.get("prompt")
        if not (
            request.get("echo") and request.get("max_tokens") == 0 and isinstance(tokens, list)
        ):
            raise ValueError(
                "this backend's /v1/completions only scores token ids (echo, max_tokens 0)"
            )
        ids = [int(t) for t in tokens]
        text = decode(ids)
        user = text.partition("<|user|>")[2].partition("<|end|>")[0]
        turn = text.count("<|assistant|>") - 1
        self.log.write({"event": "score", "tokens": len(ids), "turn": turn, "prompt": user[:120]})
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "prompt_logprobs": self.prompt_logprobs(ids),
        }
        return {
            "id": f"cmpl-score-{self.calls}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)},
        }

    async def stream(self, request: Mapping[str, Any]) -> AsyncIterator[bytes]:
        turn, prefix, new, finish, values = self.completion(request)
        n = self._begin(request, turn, prefix, True)
        sent, aborted = 0, True
        base = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "model": self.model}

        def event(delta: dict[str, Any], top: dict[str, Any] | None = None, **extra: Any) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
            chunk = {**base, "created": int(time.time()), "choices": [choice], **(top or {})}
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        try:
            await self.park(turn, 0)
            first = None  # vLLM sends the prompt's log probabilities with the first chunk
            if request.get("prompt_logprobs") is not None:
                first = {"prompt_logprobs": self.prompt_logprobs(prompt_tokens(request))}
            yield event({"role": "assistant", "content": ""}, first)
            text = decode(new)
            # the content is what precedes the first tool call's markup (``_fake_model``)
            content_end = text.find(TOOL_OPEN) if TOOL_OPEN in text else len(text)
            calls_sent = 0
            step = STREAM_STEP
            # paced against a clock, so that the sleeps' overshoots do not add up: a streamed
            # call takes as long as the same call unstreamed
            clock = time.monotonic()
            while sent < len(new):
                piece = new[sent : sent + step]
                clock += len(piece) / self._rate(request)
                await asyncio.sleep(max(0.0, clock - time.monotonic()))
                visible = text[sent : min(sent + len(piece), content_end)]
                delta: dict[str, Any] = {"content": visible} if visible else {}
                closed = text[: sent + len(piece)].count(TOOL_CLOSE)
                if closed > calls_sent:
                    _, calls = parse_output(turn, text[: sent + len(piece)])
                    delta["tool_calls"] = [
                        {"index": i, **call} for i, call in enumerate(calls) if i >= calls_sent
                    ]
                    calls_sent = closed
                logprobs = None
                if request.get("logprobs"):
                    logprobs = {"content": self.token_logprobs(values, sent, piece)}
                yield event(delta, logprobs=logprobs)
                sent += len(piece)
                parked = time.monotonic()
                await self.park(turn, sent)
                clock += time.monotonic() - parked  # a parked call's pace resumes after it
            yield event({}, finish_reason=finish)
            options = request.get("stream_options") or {}
            if options.get("include_usage"):
                usage = {
                    **base,
                    "created": int(time.time()),
                    "choices": [],
                    "usage": self._usage(request, new),
                }
                yield b"data: " + orjson.dumps(usage) + b"\n\n"
            yield b"data: [DONE]\n\n"
            aborted = False
        finally:
            end = {"event": "end", "n": n, "generated": sent, "finish_reason": finish}
            self.log.write({**end, "aborted": aborted})


def backend_app(backend: FakeBackend) -> Starlette:
    """The backend's routes (module docstring)."""

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        try:
            if body.get("stream"):
                backend.completion(body)  # refuse a bad request before the stream starts
                return StreamingResponse(backend.stream(body), media_type="text/event-stream")
            return _json(await backend.complete(body))
        except ValueError as e:
            return _json({"object": "error", "message": str(e), "code": 400}, 400)

    async def completions(request: Request) -> Response:
        try:
            return _json(backend.score(orjson.loads(await request.body())))
        except ValueError as e:
            return _json({"object": "error", "message": str(e), "code": 400}, 400)

    async def tokenize(request: Request) -> Response:
        body = orjson.loads(await request.body())
        tokens = encode(body["prompt"]) if "prompt" in body else prompt_tokens(body)
        return _json({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        body = orjson.loads(await request.body())
        return _json({"prompt": decode(body["tokens"])})

    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [{"id": backend.model, "object": "model"}]})

    async def health(request: Request) -> Response:
        return _json({"calls": backend.calls})

    async def add_hold(request: Request) -> Response:
        body = orjson.loads(await request.body())
        backend.holds.append(
            _Hold(str(body.get("match", "")), body.get("turn"), int(body.get("after_tokens", 0)))
        )
        return _json({"holds": len(backend.holds)})

    async def held(request: Request) -> Response:
        wait_s = float(request.query_params.get("wait_s", "0"))
        return _json({"parked": await backend.wait_parked(wait_s)})

    async def release(request: Request) -> Response:
        backend.release()
        return _json({"released": True})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/fake/holds", add_hold, methods=["POST"]),
            Route("/fake/held", held, methods=["GET"]),
            Route("/fake/release", release, methods=["POST"]),
        ]
    )


def _json(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status, media_type="application/json")


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--call-log", required=True, help="the JSONL file calls are appended to")
    parser.add_argument("--token-rate", type=float, default=4000.0, help="tokens per second")
    parser.add_argument("--model", default="fake")
    args = parser.parse_args(argv)
    backend = FakeBackend(CallLog(args.call_log), token_rate=args.token_rate, model=args.model)
    uvicorn.run(backend_app(backend), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
