"""The tool calls in an assistant turn, as the policy writes them (``actor_rollout_ref.rollout.multi_turn.format``).

``hermes`` (Hermes / Qwen2.5 / Qwen3): each call is ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``;
a turn may hold several. A call that cannot be read (bad JSON, not an object, no ``name``, ``arguments`` not an
object, an unclosed tag) is not dropped: it comes back as a :class:`CallError`, which the rollout answers with an
error observation and counts (verl#3070: malformed calls that silently never ran).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FORMATS: tuple[str, ...] = ("hermes",)

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class CallError:
    text: str  # what the policy wrote
    message: str  # why it is not a call, for the error observation


def parse_calls(text: str, *, format: str = "hermes") -> list[ToolCall | CallError]:
    """Every call of ``text`` in order (empty: the turn calls no tool)."""
    if format not in FORMATS:
        raise ValueError(f"tool-call format {format!r}; valid: {', '.join(FORMATS)}")
    out: list[ToolCall | CallError] = []
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        out.append(_call(body) if closed else CallError(text=body, message="<tool_call> is not closed by </tool_call>"))
    return out


def _call(body: str) -> ToolCall | CallError:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return CallError(text=body, message=f"not JSON ({e.msg} at character {e.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return CallError(text=body, message='expected {"name": "<tool>", "arguments": {...}}')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return CallError(text=body, message=f"arguments must be an object, got {type(arguments).__name__}")
    return ToolCall(name=value["name"], arguments=arguments)
