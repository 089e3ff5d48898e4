"""Dataset rows whose model turns are scripted for the fake backend (``metadata.fake_script``),
for NeMo Gym's ``example_session_state_mgmt`` (the counter) and ``example_multi_step``; the
demo, the benchmark and the tests collect them."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["counter_row", "steps_row"]


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": "",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        },
    }


def _params(prompt: str, tools: list[dict[str, Any]], script: list[Any]) -> dict[str, Any]:
    return {
        "input": [{"role": "user", "content": prompt}],
        "tools": tools,
        "metadata": {"fake_script": json.dumps(script)},
    }


def counter_row(index: int, *, right: bool = True, agent: str = "counter_agent") -> dict[str, Any]:
    """Add two numbers to a counter seeded at ``index`` and read it; the reward is 1.0 when the
    counter ends at the expected count (``right=False``: the script adds one too few)."""
    a, b = index + 1, index + 2
    script = [
        {
            "calls": [
                {"call": "increment_counter", "arguments": {"count": a}},
                {"call": "increment_counter", "arguments": {"count": b if right else b - 1}},
            ]
        },
        {"call": "get_counter_value", "arguments": {}},
        {"say": f"the count is {index + a + b}"},
    ]
    tools = [
        _tool("increment_counter", {"count": {"type": "integer", "description": ""}}),
        _tool("get_counter_value", {}),
    ]
    prompt = f"counter task {index}: add {a} then add {b} then get the count"
    return {
        "responses_create_params": _params(prompt, tools, script),
        "expected_count": index + a + b,
        "initial_count": index,
        "agent_ref": {"name": agent},
    }


def steps_row(index: int, *, right: bool = True, agent: str = "steps_agent") -> dict[str, Any]:
    """Look up two synonyms' values, then extract them; the reward is 1.0 when the extracted
    values are the expected ones (``right=False``: the script swaps them)."""
    synonyms = [f"Word{index}a", f"Word{index}b"]
    values = [sum(map(ord, s)) for s in synonyms]
    extracted = values if right else values[::-1]
    script = [
        {"calls": [{"call": "get_synonym_value", "arguments": {"synonym": s}} for s in synonyms]},
        {"call": "extract_synonym_values", "arguments": {"synonym_values": extracted}},
        {"say": "done"},
    ]
    tools = [
        _tool("get_synonym_value", {"synonym": {"type": "string", "description": ""}}),
        _tool(
            "extract_synonym_values",
            {"synonym_values": {"type": "array", "items": {"type": "integer"}, "description": ""}},
        ),
    ]
    prompt = f"steps task {index}: get the values of {synonyms[0]} and {synonyms[1]}"
    return {
        "id": index,
        "responses_create_params": _params(prompt, tools, script),
        "expected_synonym_values": values,
        "expected_synonyms": synonyms,
        "minefield_label": "Mine",
        "minefield_label_value": 0,
        "agent_ref": {"name": agent},
    }
