"""Agents as plug-ins: ``env.<task>.agent_fn`` runs a task's episodes over the engines' endpoint.

The agent is a function named by import path::

    def run(base_url: str, row: dict) -> float

``base_url`` is an OpenAI-compatible base URL (``http://<host>:<port>/rollouts/<id>/v1``) of one
generation engine (``policy.generation.vllm_cfg.expose_http_server``), private to this episode:
the agent talks to it with any OpenAI client (``openai.OpenAI(base_url=base_url,
api_key="none")``), over as many turns and tool calls as it likes, and returns the episode's
reward. ``row`` is the data row as the ``reward_fn`` processor gives it: ``{"prompt", "answer",
"metadata"}`` (the row's other fields). An ``async def`` agent is run on an event loop of its
own. Everything the model generated through that URL is trained, token for token as the engine
generated it (:mod:`nemo_rl.experience.agent_rollouts`).

Failures cost the sample, never the run: an agent that raises, returns anything but a finite
number, or has not returned ``timeout_s`` seconds after it started scores 0 and is counted as
an environment error (``rollout/env_errors``; ``grpo.max_env_error_rate`` applies). A hung agent's
thread cannot be killed; it is abandoned (a daemon thread: its requests still end at the
endpoint's ``http_request_timeout_s``).

The agents of one rollout step run in parallel threads of the environment's actor, so a step
takes about as long as its slowest agent, at most ``timeout_s``
(:data:`MAX_AGENT_TIMEOUT_S` bounds it below the rollout's environment-step limit).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from typing import Any, Callable

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.common import batch_success_metrics
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.utils.plugins import PluginError, load_function

AGENT_FN_SIGNATURE = "fn(base_url, row) -> float"

# The key of a sample's metadata the agent rollout sets to the episode's base URL.
BASE_URL_KEY = "agent_base_url"

# Most seconds an agent may be given: below the rollout's limit on one environment step
# (nemo_rl.experience.rollouts.ENV_STEP_TIMEOUT_S, 300 s), so an agent's timeout, not the
# step's, decides.
MAX_AGENT_TIMEOUT_S = 240.0


def load_agent_fn(path: str, where: str = "agent_fn") -> Callable[..., Any]:
    """The agent at import path ``path``, checked to take two arguments.

    Raises:
        PluginError: naming ``where`` (the recipe field).
    """
    return load_function(path, 2, where, AGENT_FN_SIGNATURE)


def _check_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {value!r}; an agent must return a finite number (the reward)")
    return float(value)


class AgentEnvironment(EnvironmentInterface):
    """Runs ``agent_fn`` once per sample (see the module docstring).

    Args:
        agent_fn: import path ``"package.module:function"`` of the agent.
        timeout_s: seconds an agent may run before its sample scores 0 (an environment error).
    """

    default_processor = "reward_fn"

    def __init__(self, agent_fn: str, timeout_s: float = 120.0) -> None:
        self.agent_fn_path = agent_fn
        self.agent_fn = load_agent_fn(agent_fn)
        self.timeout_s = timeout_s

    @classmethod
    def check_arguments(cls, where: str, *args: Any, **kwargs: Any) -> None:
        """The agent resolves and takes two arguments; ``timeout_s`` is in (0, 240]."""
        load_agent_fn(kwargs["agent_fn"], where)
        timeout = kwargs.get("timeout_s", 120.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            0 < timeout <= MAX_AGENT_TIMEOUT_S
        ):
            raise PluginError(
                f"{where.removesuffix('agent_fn')}timeout_s={timeout!r}: give seconds in "
                f"(0, {MAX_AGENT_TIMEOUT_S:g}]"
            )

    def _call(self, base_url: str, row: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(self.agent_fn):
            return asyncio.run(self.agent_fn(base_url, row))
        return self.agent_fn(base_url, row)

    def run_agents(self, episodes: list[tuple[str, dict[str, Any]]]) -> list[float | str]:
        """Run the agent on every ``(base_url, row)`` in parallel threads; per episode its
        reward, or what went wrong (a string)."""
        results: list[float | str] = [
            f"agent {self.agent_fn_path!r} did not return within timeout_s={self.timeout_s:g}"
        ] * len(episodes)

        def run(i: int, base_url: str, row: dict[str, Any]) -> None:
            try:
                results[i] = _check_reward(self._call(base_url, row))
            except Exception as err:  # noqa: BLE001 - any agent failure costs its sample
                results[i] = f"agent {self.agent_fn_path!r} failed: {err!r}"

        threads = [
            threading.Thread(target=run, args=(i, url, row), daemon=True, name=f"agent-{i}")
            for i, (url, row) in enumerate(episodes)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        return list(results)

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Run each sample's episode; every episode ends. A failed episode's metadata is
        ``{"agent_error": <what went wrong>}``.

        Raises:
            ValueError: a sample has no endpoint (the rollout is not the agent rollout:
                ``policy.generation.vllm_cfg.expose_http_server`` is off).
        """
        episodes = []
        for i, meta in enumerate(metadata):
            if BASE_URL_KEY not in (meta or {}):
                raise ValueError(
                    f"sample {i} has no endpoint to run its agent against; agent tasks need "
                    "policy.generation.vllm_cfg.expose_http_server=true"
                )
            row = {k: v for k, v in meta.items() if k != BASE_URL_KEY}
            episodes.append((meta[BASE_URL_KEY], row))
        results = self.run_agents(episodes)
        rewards = [r if isinstance(r, float) else 0.0 for r in results]
        size = len(results)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(size)],
            metadata=[None if isinstance(r, float) else {"agent_error": r} for r in results],
            next_stop_strings=[None] * size,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(size, dtype=torch.bool),
            answers=[None] * size,
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """``accuracy`` (share of samples with reward >= 1) and ``pass@k``; batch unchanged."""
        return batch, batch_success_metrics(batch)
