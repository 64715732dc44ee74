"""A single-turn environment around a plain reward function, ``env.<task>.reward_fn``.

The function is named by import path and called once per sample, inside the environment's
Ray actor, on the batch of samples the rollout sends in one step::

    def score(prompt, response, answer, metadata) -> float

``prompt`` is the row's prompt as in the data (before any template or chat rendering; a list of
messages for chat-format rows), ``response`` the model's reply text, ``answer`` the row's answer
(``data.answer_key``; None when the row has none) and ``metadata`` a dict of the row's other
fields. Every episode ends after one turn. The rows are prepared by the ``reward_fn`` processor
(:func:`nemo_rl.data.processors.reward_fn_processor`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.common import (
    batch_success_metrics,
    final_step_return,
    last_assistant_content,
)
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.utils.plugins import load_function

REWARD_FN_SIGNATURE = "fn(prompt, response, answer, metadata) -> float"


def load_reward_fn(path: str, where: str = "reward_fn") -> Callable[..., Any]:
    """The reward function at import path ``path``, checked to take four arguments.

    Raises:
        nemo_rl.utils.plugins.PluginError: naming ``where`` (the recipe field).
    """
    return load_function(path, 4, where, REWARD_FN_SIGNATURE)


class RewardFnEnvironment(EnvironmentInterface):
    """Scores each sample with a user reward function; usable in-process or as a Ray actor.

    Args:
        reward_fn: import path ``"package.module:function"`` of the function.

    Metadata per sample: ``{"prompt", "answer", "metadata"}`` (the ``reward_fn`` processor's).
    """

    default_processor = "reward_fn"

    def __init__(self, reward_fn: str) -> None:
        self.reward_fn_path = reward_fn
        self.reward_fn = load_reward_fn(reward_fn)

    @classmethod
    def check_arguments(cls, where: str, *args: Any, **kwargs: Any) -> None:
        """The function resolves and takes four arguments."""
        load_reward_fn(kwargs["reward_fn"], where)

    def _score(self, i: int, log: LLMMessageLogType, meta: dict[str, Any]) -> float:
        if "prompt" not in (meta or {}):
            raise KeyError(
                f"sample {i}: metadata has no 'prompt' (keys: {sorted(meta or {})}); rows of a "
                "reward_fn task need the 'reward_fn' processor (env.<task>.processor)"
            )
        value = self.reward_fn(
            meta["prompt"], last_assistant_content(log), meta.get("answer"), meta.get("metadata", {})
        )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(
                f"reward function {self.reward_fn_path!r} returned {value!r} for sample {i}; "
                "it must return a finite float"
            )
        return float(value)

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Reward of each sample's reply; every episode ends.

        Raises:
            ValueError: the function returned something other than a finite number.
        """
        rewards = [
            self._score(i, log, meta)
            for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True))
        ]
        return final_step_return(torch.tensor(rewards, dtype=torch.float32))

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """``accuracy`` (share of samples with reward >= 1) and ``pass@k``; batch unchanged."""
        return batch, batch_success_metrics(batch)
