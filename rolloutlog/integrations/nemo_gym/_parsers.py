"""Tool-call parsers: a completed generation's text as the Chat Completions message a backend's
tool parser makes of it, for a terminal cut served from its tokens (``_backend``).

The backend parses tool calls out of the generated text itself (vLLM's ``--tool-call-parser``),
so a policy that serves a call from recorded tokens must parse them the same way: the policy's
``tool_parser`` option names the backend's format, a built-in name or ``"module:function"``
(``function(text) -> (content, [{"name", "arguments"}])``, arguments a JSON string). Tool call
ids are the policy's (a backend's are random): ``call_<hash of the call id and index>``, the
same each time a cut is served.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from rolloutlog.integrations.nemo_gym._config import load_object

__all__ = ["PARSERS", "ToolParser", "UnparsedMarkup", "hermes", "parsed_message", "tool_parser"]

#: text -> (content or None, [{"name": ..., "arguments": <JSON string>}])
ToolParser = Callable[[str], tuple[str | None, list[dict[str, str]]]]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class UnparsedMarkup(ValueError):
    """The text holds tool-call markup the parser could not read."""


def hermes(text: str) -> tuple[str | None, list[dict[str, str]]]:
    """vLLM's ``hermes`` format (Hermes, Qwen): ``<tool_call>{"name": …, "arguments": …}
    </tool_call>``; the content is the text before the first call."""
    start = text.find("<tool_call>")
    if start < 0:
        return (text or None), []
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
            name = str(call["name"])
        except (ValueError, KeyError, TypeError) as e:
            raise UnparsedMarkup(f"a tool call that is not JSON with a name: {body!r}") from e
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        calls.append({"name": name, "arguments": arguments})
    if text.count("<tool_call>") != len(calls):
        raise UnparsedMarkup("an unclosed <tool_call>")
    return (text[:start] or None), calls


#: Built-in parsers, by vLLM's ``--tool-call-parser`` name.
PARSERS: dict[str, ToolParser] = {"hermes": hermes}


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser an option names (None: none configured)."""
    if not name:
        return None
    if name in PARSERS:
        return PARSERS[name]
    parser: ToolParser = load_object(name)
    return parser


def parsed_message(parser: ToolParser, text: str, call_id: str) -> dict[str, Any]:
    """The assistant message of a completed generation (``UnparsedMarkup`` if it cannot be)."""
    content, calls = parser(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": "call_" + hashlib.sha256(f"{call_id}:{i}".encode()).hexdigest()[:24],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for i, call in enumerate(calls)
        ]
    return message
