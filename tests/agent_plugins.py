"""Agents for tests/unit/experience/test_agent_rollouts.py, importable by path
(``agent_plugins:<name>_agent``): one that talks two turns, and ones that fail each way an
agent can (raise, hang, a malformed reward, no request at all). Importable as
``agent_plugins``."""

from __future__ import annotations

import math
import time
from typing import Any

# What the good agent was answered, per rollout: [(text, completion_tokens), ...]
ANSWERS: dict[str, list[tuple[str, int]]] = {}


def _client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url, api_key="none", timeout=60, max_retries=0)


def two_turn_agent(base_url: str, row: dict[str, Any]) -> float:
    api = _client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    answers = ANSWERS.setdefault(row["metadata"]["name"], [])
    for _ in range(2):
        reply = api.chat.completions.create(model="tiny", messages=messages)
        message = reply.choices[0].message
        answers.append((message.content, reply.usage.completion_tokens))
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    return 1.0


def raising_agent(base_url: str, row: dict[str, Any]) -> float:
    _client(base_url).completions.create(model="tiny", prompt="Hello", max_tokens=2)
    raise RuntimeError("the agent's tool crashed")


def hanging_agent(base_url: str, row: dict[str, Any]) -> float:
    time.sleep(4.0)
    return 1.0


def string_reward_agent(base_url: str, row: dict[str, Any]) -> Any:
    _client(base_url).completions.create(model="tiny", prompt="Hello", max_tokens=2)
    return "1.0"


def nan_reward_agent(base_url: str, row: dict[str, Any]) -> float:
    _client(base_url).completions.create(model="tiny", prompt="Hello", max_tokens=2)
    return math.nan


def silent_agent(base_url: str, row: dict[str, Any]) -> float:
    return 1.0
