"""A calculator agent (``env.<task>.agent_fn: nemo_rl.environments.calculator_agent:run``).

The agent plug-in of ``configs/grpo_agent_calculator_tiny_cpu.yaml``, and an example of one: it
talks to the policy over the engines' OpenAI-compatible endpoint with the ``openai`` client,
offers one tool, ``calc`` (``{"expression": "53 * 22"}``: integer arithmetic, evaluated by the
calculator environment's safe evaluator), answers each tool call with a ``tool`` message, and
scores the final reply: 1.0 when its ``<answer>N</answer>`` (or, without the tag, its last
number) equals the row's ``answer``, else 0. A malformed tool call
(:data:`~nemo_rl.models.generation.tool_calls.INVALID_TOOL_CALL`), an unknown tool or an
expression that does not evaluate is answered with an ``error: ...`` observation, and the
episode goes on: the model sees its failed call. At most :data:`MAX_TURNS` requests; an
episode whose conversation outgrows the engine's context (the endpoint's 400 with code
``context_length_exceeded``, after long failed calls) ends there and scores 0, like a rollout cut
at its length limit: the model's failure, not the environment's (no ``rollout/env_errors``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from nemo_rl.environments.calculator_environment import evaluate_expression, format_number
from nemo_rl.environments.common import tagged_text
from nemo_rl.models.generation.interfaces import PromptTooLongError
from nemo_rl.models.generation.tool_calls import tool_error_message

MAX_TURNS = 3

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer arithmetic expression (+, -, *, parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def answer_tool_call(call: dict[str, Any]) -> str:
    """The observation for one OpenAI tool call: the value, or ``error: ...``."""
    malformed = tool_error_message(call)
    if malformed is not None:
        return malformed
    function = call["function"]
    if function["name"] != "calc":
        return f"error: unknown tool {function['name']!r}; the only tool is 'calc'"
    expression = json.loads(function["arguments"]).get("expression")
    if not isinstance(expression, str):
        return "error: calc needs {\"expression\": \"<arithmetic>\"}"
    try:
        return format_number(evaluate_expression(expression))
    except Exception as err:  # noqa: BLE001 - the model's expression failed: tell it
        return f"error: {err}"


def final_answer(text: str) -> str | None:
    """The reply's ``<answer>`` text, else its last integer; None when it has neither."""
    tagged = tagged_text(text, "answer")
    if tagged is not None:
        return tagged
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def run(base_url: str, row: dict[str, Any]) -> float:
    """One episode (see the module docstring); the reward."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=60.0, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TURNS):
        try:
            response = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS
            )
        except BadRequestError as err:
            if err.code == PromptTooLongError.openai_code:
                return 0.0
            raise
        message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            answer = final_answer(message.get("content") or "")
            return float(answer is not None and answer.strip() == str(row["answer"]).strip())
        for call in calls:
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": answer_tool_call(call)}
            )
    return 0.0
