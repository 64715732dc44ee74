"""Agents for tests/unit/experience/test_agent_rollouts.py and
tests/functional/test_agent_rollout_paths.py, importable by path (``agent_plugins:<name>_agent``):
one that talks two turns (and one that also writes what it was answered to a file, for runs
whose environments live in Ray actors), and ones that fail each way an agent can (raise, hang,
a malformed reward, no request at all). Importable as ``agent_plugins``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

# What the good agent was answered, per rollout: [(text, completion_tokens), ...]
ANSWERS: dict[str, list[tuple[str, int]]] = {}


def _client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url, api_key="none", timeout=60, max_retries=0)


def _two_turns(base_url: str, prompt: str) -> list[tuple[str, int]]:
    """Two chat turns (the second after a user's "More."): ``[(text, completion_tokens)]``."""
    api = _client(base_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    answers = []
    for _ in range(2):
        reply = api.chat.completions.create(model="tiny", messages=messages)
        message = reply.choices[0].message
        answers.append((message.content, reply.usage.completion_tokens))
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    return answers


def two_turn_agent(base_url: str, row: dict[str, Any]) -> float:
    ANSWERS.setdefault(row["metadata"]["name"], []).extend(_two_turns(base_url, row["prompt"]))
    return 1.0


def recording_two_turn_agent(base_url: str, row: dict[str, Any]) -> float:
    """Two turns; writes ``[[text, completion_tokens], ...]`` to
    ``<row's record_dir>/<rollout id>.json`` (the id from ``base_url``,
    ``.../rollouts/<id>/v1``). Reward: 1 when the first answer has an even number of tokens
    (a reward that varies within a group)."""
    answers = _two_turns(base_url, row["prompt"])
    rollout_id = base_url.rstrip("/").split("/")[-2]
    path = Path(row["metadata"]["record_dir"]) / f"{rollout_id}.json"
    path.write_text(json.dumps(answers))
    return float(answers[0][1] % 2 == 0)


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
