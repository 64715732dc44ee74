"""Tool calls in the Qwen/Hermes format: parsed into OpenAI ``tool_calls``; a malformed call
becomes a call of the reserved ``invalid_tool_call`` tool that the calculator agent answers
with an error observation (never an exception)."""

from __future__ import annotations

import json

import pytest

from nemo_rl.environments.calculator_agent import answer_tool_call
from nemo_rl.models.generation.tool_calls import (
    INVALID_TOOL_CALL,
    parse_tool_calls,
    render_tool_calls,
    tool_error_message,
)


def test_well_formed_calls_become_tool_calls_and_the_rest_is_content() -> None:
    text = (
        'Let me compute. <tool_call>{"name": "calc", "arguments": {"expression": "2 * 3"}}'
        '</tool_call><tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}'
    )
    parsed = parse_tool_calls(text, "call_x")
    assert parsed.content == "Let me compute."
    assert parsed.malformed == 0
    assert [c["id"] for c in parsed.tool_calls] == ["call_x_0", "call_x_1"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [
        {"expression": "2 * 3"}, {"expression": "1"},
    ]
    assert parsed.tool_calls[0]["function"]["name"] == "calc"
    assert tool_error_message(parsed.tool_calls[0]) is None
    assert answer_tool_call(parsed.tool_calls[0]) == "6"


@pytest.mark.parametrize(
    "block, why",
    [
        ('{"name": "calc", "arguments": {', "not valid JSON"),
        ('["calc"]', "a JSON list"),
        ('{"arguments": {}}', "no string 'name'"),
        ('{"name": "calc", "arguments": "not json"}', "not JSON"),
        ('{"name": "calc", "arguments": 3}', "a JSON int"),
    ],
)
def test_a_malformed_call_is_an_observation_for_the_model(block: str, why: str) -> None:
    parsed = parse_tool_calls(f"<tool_call>{block}</tool_call>", "c")
    assert parsed.malformed == 1 and parsed.content == ""
    (call,) = parsed.tool_calls
    assert call["function"]["name"] == INVALID_TOOL_CALL
    assert json.loads(call["function"]["arguments"])["raw"] == block
    observation = answer_tool_call(call)
    assert observation.startswith("error: the tool call could not be parsed: ")
    assert why in observation


def test_render_gives_the_hermes_text_of_a_structured_message() -> None:
    calls = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"e": "1"}}</tool_call>',
                             "c").tool_calls
    assert render_tool_calls("Hi", calls) == (
        'Hi<tool_call>{"name": "calc", "arguments": {"e": "1"}}</tool_call>'
    )
