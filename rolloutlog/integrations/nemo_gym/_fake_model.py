"""The fake inference backend's model: pure functions of a Chat Completions request.

What a call generates depends only on the request's messages (before any assistant message it
continues) and its turn (the number of assistant messages), so a call made again, or continued
from a prefix of its tokens, yields the same tokens and log probabilities.

- **Script.** ``metadata.fake_script`` (a JSON list, carried by a NeMo Gym dataset row's
  ``responses_create_params.metadata``) says what turn k does: ``{"call": name, "arguments":
  {...}}`` calls a tool, ``{"calls": [...]}`` several at once, ``{"say": text}`` answers;
  turns past the script say ``done``. Every
  turn starts with ``metadata.fake_tokens`` (default ``DEFAULT_FILLER``) characters of filler
  text, so long turns stream many tokens before their action.
- **Tokens.** One token per UTF-8 byte (``encode``/``decode``: exact both ways, so a token prefix
  decodes to a text prefix and encodes back to the same tokens). A tool call is generated as
  ``<tool_call>{"name": …, "arguments": …}</tool_call>`` and parsed out of the text, as vLLM's
  ``hermes`` tool parser does (its arguments re-encoded by ``json.dumps``).
- **Log probabilities.** Each token's is a function of the token sequence up to it (the prompt
  under a toy chat template, ``prompt_tokens``, then the generated tokens).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "DEFAULT_FILLER",
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "Turn",
    "decode",
    "encode",
    "parse_output",
    "prompt_tokens",
    "sequence_logprobs",
    "turn_of",
]

TOKEN_OFFSET = 1000
DEFAULT_FILLER = 24
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_WORDS = ("alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "sierra", "tango", "zulu")


def encode(text: str) -> list[int]:
    return [byte + TOKEN_OFFSET for byte in text.encode()]


def decode(token_ids: Sequence[int]) -> str:
    return bytes(int(t) - TOKEN_OFFSET for t in token_ids).decode()


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))


def _digest(*parts: Any) -> bytes:
    return hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).digest()


def sequence_logprobs(tokens: Sequence[int], start: int = 0) -> list[float]:
    """The log probability of each token of a sequence (prompt, then generation) from position
    ``start`` on: a function of the tokens up to and including it, as a model's is, so a call
    generated, continued from a prefix of its tokens, or scored gives each token one value."""
    chain = b""
    values = []
    for position, token in enumerate(tokens):
        chain = hashlib.sha256(chain + int(token).to_bytes(4, "big")).digest()
        if position >= start:
            values.append(-round((int.from_bytes(chain[:2], "big") % 2000 + 1) / 1000, 3))
    return values


@dataclass(frozen=True, slots=True)
class Turn:
    """What one call generates: its text and where it came from."""

    conversation: str
    turn: int
    text: str
    prompt: str

    @property
    def token_ids(self) -> list[int]:
        return encode(self.text)


def _conversation(messages: Sequence[Mapping[str, Any]]) -> str:
    shape = [
        (m.get("role"), _text(m.get("content")), m.get("tool_calls") or None, m.get("tool_call_id"))
        for m in messages
    ]
    return _digest(shape).hex()[:16]


def _script(request: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int]:
    metadata = request.get("metadata") or {}
    raw = metadata.get("fake_script")
    steps = orjson.loads(raw) if isinstance(raw, str) else (raw or [])
    filler = int(metadata.get("fake_tokens", DEFAULT_FILLER))
    return list(steps), filler


def _filler(conversation: str, turn: int, length: int) -> str:
    words: list[str] = []
    seed = _digest(conversation, turn)
    i = 0
    while sum(len(w) + 1 for w in words) <= length:  # joined, at least ``length`` characters
        words.append(_WORDS[seed[i % len(seed)] % len(_WORDS)])
        i += 1
    return " ".join(words)[:length]


def turn_of(request: Mapping[str, Any]) -> tuple[Turn, str]:
    """The turn a request asks for and the prefix it continues (``continue_final_message`` with
    a final assistant message: its content; else "")."""
    messages = list(request.get("messages") or [])
    prefix = ""
    if (
        request.get("continue_final_message")
        and messages
        and messages[-1].get("role") == "assistant"
    ):
        prefix = _text(messages.pop().get("content"))
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    conversation = _conversation(messages)
    steps, filler = _script(request)
    step: dict[str, Any] = steps[turn] if turn < len(steps) else {"say": "done"}
    text = _filler(conversation, turn, filler)
    calls: list[dict[str, Any]] = step.get("calls") or ([step] if "call" in step else [])
    for call in calls:
        named = {"name": call["call"], "arguments": call.get("arguments", {})}
        text += TOOL_OPEN + orjson.dumps(named).decode() + TOOL_CLOSE
    if not calls:
        text += " " + str(step.get("say", "done"))
    first_user = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    return Turn(conversation, turn, text, first_user[:120]), prefix


def parse_output(turn: Turn, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and tool calls of generated ``text``: each ``<tool_call>…</tool_call>`` becomes a
    tool call whose id depends on the turn and its index only."""
    calls: list[dict[str, Any]] = []
    content, _, rest = text.partition(TOOL_OPEN)
    while rest:
        body, _, rest = rest.partition(TOOL_CLOSE)
        call = orjson.loads(body)
        call_id = "call_" + _digest(turn.conversation, turn.turn, len(calls)).hex()[:16]
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
        rest = rest.partition(TOOL_OPEN)[2]
    return (content or None), calls


def prompt_tokens(request: Mapping[str, Any]) -> list[int]:
    """The prompt's tokens under a toy chat template (what ``/tokenize`` returns); with
    ``continue_final_message`` the final assistant message is left open, so its content's
    tokens are the prompt's last tokens."""
    parts: list[str] = []
    tools = request.get("tools")
    if tools:
        parts.append("<|tools|>" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    messages = list(request.get("messages") or [])
    open_last = bool(request.get("continue_final_message"))
    for i, message in enumerate(messages):
        text = f"<|{message.get('role')}|>" + _text(message.get("content"))
        if message.get("tool_calls"):
            text += orjson.dumps(message["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        if not (open_last and i == len(messages) - 1):
            text += "<|end|>"
        parts.append(text)
    if request.get("add_generation_prompt", True) and not open_last:
        parts.append("<|assistant|>")
    return encode("".join(parts))
