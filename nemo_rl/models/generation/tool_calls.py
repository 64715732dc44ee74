"""Tool calls in the Qwen/Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The chat endpoint (:mod:`nemo_rl.models.generation.vllm.http_server`) turns the blocks a
response holds into the OpenAI ``tool_calls`` field; the text outside them is the message's
``content``. A block that is not a JSON object with a string ``name`` and an object (or JSON
text of an object) ``arguments`` is not dropped and does not fail the request: it becomes a
call of the reserved tool :data:`INVALID_TOOL_CALL` whose arguments say what was wrong, so an
agent answers it with an error observation like any unknown tool
(:func:`tool_error_message`), and the model learns from a failed call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# The tool name a malformed call is reported under; its arguments are {"raw", "error"}.
INVALID_TOOL_CALL = "invalid_tool_call"

# A block closed by its tag, or left open at the end of the text (a response cut at its token
# limit inside a call).
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedResponse:
    """A response split into its text and its tool calls.

    Attributes:
        content: the text outside the ``<tool_call>`` blocks, stripped ("" when none).
        tool_calls: OpenAI ``tool_calls`` entries ``{"id", "type": "function", "function":
            {"name", "arguments": JSON text}}``, in the order of the blocks.
        malformed: how many of them are :data:`INVALID_TOOL_CALL` (unparseable blocks).
    """

    content: str
    tool_calls: list[dict[str, Any]]
    malformed: int


def _parse_block(raw: str) -> tuple[str, dict[str, Any]] | str:
    """``(name, arguments)`` of one block's inner text, or why it is malformed."""
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at character {err.pos})"
    if not isinstance(call, dict):
        return f"a JSON {type(call).__name__}, not an object with 'name' and 'arguments'"
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return "no string 'name'"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"'arguments' is a JSON {type(arguments).__name__}, not an object"
    return name, arguments


def parse_tool_calls(text: str, call_id_prefix: str) -> ParsedResponse:
    """Split ``text`` (a response, decoded) into content and tool calls; call ``k`` gets the
    id ``f"{call_id_prefix}_{k}"``."""
    calls: list[dict[str, Any]] = []
    malformed = 0
    for k, match in enumerate(_BLOCK.finditer(text)):
        raw = match.group(1).strip()
        parsed = _parse_block(raw)
        if isinstance(parsed, str):
            malformed += 1
            name, arguments = INVALID_TOOL_CALL, {"raw": raw, "error": parsed}
        else:
            name, arguments = parsed
        calls.append(
            {
                "id": f"{call_id_prefix}_{k}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
    content = _BLOCK.sub("", text).strip()
    return ParsedResponse(content=content, tool_calls=calls, malformed=malformed)


def render_tool_calls(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """The Hermes text of an assistant message with ``tool_calls`` (what a chat template
    without tool support is given): the content, then one block per call."""
    blocks = []
    for call in tool_calls:
        function = call.get("function", {})
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        body = json.dumps({"name": function.get("name"), "arguments": arguments})
        blocks.append(f"<tool_call>{body}</tool_call>")
    return "".join([content, *blocks])


def tool_error_message(call: dict[str, Any]) -> str | None:
    """The observation for a malformed call (an :data:`INVALID_TOOL_CALL` entry), or None for
    a well-formed one."""
    function = call.get("function", {})
    if function.get("name") != INVALID_TOOL_CALL:
        return None
    details = json.loads(function.get("arguments", "{}"))
    return f"error: the tool call could not be parsed: {details.get('error', 'malformed')}"
