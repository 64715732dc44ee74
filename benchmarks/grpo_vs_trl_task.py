"""The task of ``bench_grpo_vs_trl.py``, shared by both frameworks: prompts, reward, and our
environment (which also records every response's length in tokens).

Kept apart from the harness so our environment actor imports only this and nemo_rl, and the
harness can check its prerequisites before importing anything that may be missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.interfaces import EnvironmentReturn
from nemo_rl.environments.reward_fn_environment import RewardFnEnvironment


def prompt_texts(num: int) -> list[str]:
    """The first ``num`` user messages, in the order both frameworks read them."""
    return [f"Write a long number after {i}." for i in range(num)]


def digit_share(prompt: Any, response: str, answer: Any, metadata: Any) -> float:
    """The reward: the share of ``response``'s characters that are digits (0 when empty).
    A random model's longer responses more often hold a digit, so it also favours length."""
    return sum(ch.isdigit() for ch in response) / max(len(response), 1)


def leading_digit(prompt: Any, response: str, answer: Any, metadata: Any) -> float:
    """The reward of the skewed-length case: 1 when ``response`` starts with a digit (leading
    spaces aside), else 0. Unlike :func:`digit_share` it does not grow with the response's
    length, so training does not push the early EOS away."""
    return float(response.lstrip()[:1].isdigit())


REWARDS = {"digit_share": digit_share, "leading_digit": leading_digit}


class LengthRecordingEnvironment(RewardFnEnvironment):
    """One of :data:`REWARDS` as our environment; each :meth:`step` also appends one JSON line
    to ``lengths_path``: the list of the batch's response lengths in tokens (the last
    assistant message's ``token_ids``, EOS included), in the batch's order.

    Args:
        reward: a name in :data:`REWARDS`.
        lengths_path: the file to append to (created if missing).
    """

    def __init__(self, reward: str, lengths_path: str) -> None:
        super().__init__(f"{__name__}:{reward}")
        self.lengths_path = Path(lengths_path)

    @classmethod
    def check_arguments(cls, where: str, *args: Any, **kwargs: Any) -> None:
        """Only ``reward`` (a name in :data:`REWARDS`) and ``lengths_path`` (a string)."""
        if (set(kwargs) != {"reward", "lengths_path"} or kwargs["reward"] not in REWARDS
                or not isinstance(kwargs["lengths_path"], str)):
            raise ValueError(
                f"{where}: takes exactly reward (one of {sorted(REWARDS)}) and lengths_path "
                f"(a file path), got {kwargs}"
            )

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """The reward of each reply; the replies' lengths appended to ``lengths_path``."""
        lengths = [len(log[-1]["token_ids"]) for log in message_log_batch]
        with self.lengths_path.open("a") as out:
            out.write(json.dumps(lengths) + "\n")
        return super().step(message_log_batch, metadata)


def split_steps(lengths: list[int], samples_per_step: int) -> list[list[int]]:
    """Per-sample lengths in generation order (each framework's generation or environment
    calls may cut a step's batch into pieces), cut into steps of ``samples_per_step``."""
    if len(lengths) % samples_per_step:
        raise ValueError(
            f"{len(lengths)} recorded response lengths are not whole steps of {samples_per_step}"
        )
    return [lengths[i : i + samples_per_step] for i in range(0, len(lengths), samples_per_step)]


def read_step_lengths(path: Path, samples_per_step: int) -> list[list[int]]:
    """The lengths a :class:`LengthRecordingEnvironment` recorded, per step (:func:`split_steps`)."""
    lines = path.read_text().splitlines()
    return split_steps([n for line in lines for n in json.loads(line)], samples_per_step)
