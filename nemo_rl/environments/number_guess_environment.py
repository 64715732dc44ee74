"""A multi-turn game: guess the secret integer; after each guess the environment says
"higher", "lower" or "correct".

Metadata per sample: ``{"secret": int}`` plus optional ``"low"``/``"high"`` (the range, shown
in the reminder when no guess is found). The environment adds ``"turn"`` (guesses made so far).
A guess is the integer inside ``<guess>...</guess>`` (the closing tag may be missing, as a stop
string is usually cut from the text), else the last integer in the response. Solving on guess
t earns ``max(0, 1 - turn_penalty * (t - 1))``; the episode ends when solved or after
``max_turns`` guesses (reward 0).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.common import (
    batch_success_metrics,
    last_assistant_content,
    tagged_text,
)
from nemo_rl.environments.config import NumberGuessEnvConfig
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn

GUESS_STOP_STRINGS = ["</guess>"]
_INTEGER = re.compile(r"-?\d+")


def extract_guess(text: str) -> Optional[int]:
    """The integer guessed in ``text`` (see the module docstring), or None."""
    inner = tagged_text(text, "guess")
    numbers = _INTEGER.findall(inner if inner is not None else text)
    return int(numbers[-1]) if numbers else None


class NumberGuessEnvironment(EnvironmentInterface):
    """The guessing game's other party; usable in-process or as a Ray actor."""

    default_processor = "prompt"
    required_fields = ("secret",)
    returns_answers = True

    def __init__(self, cfg: Optional[NumberGuessEnvConfig] = None) -> None:
        self.cfg = cfg or NumberGuessEnvConfig()

    def _play(self, text: str, meta: dict[str, Any]) -> tuple[str, float, bool, Optional[int]]:
        """One guess: ``(observation, reward, terminated, guess)``."""
        turn = int(meta.get("turn", 0)) + 1
        meta["turn"] = turn
        guess = extract_guess(text)
        secret = int(meta["secret"])
        if guess == secret:
            return "correct", max(0.0, 1.0 - self.cfg.turn_penalty * (turn - 1)), True, guess
        if guess is None:
            span = f" between {meta['low']} and {meta['high']}" if "low" in meta else ""
            observation = f"no guess found; answer with <guess>N</guess>{span}"
        else:
            observation = "higher" if secret > guess else "lower"
        return observation, 0.0, turn >= self.cfg.max_turns, guess

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Answer each sample's latest guess.

        Raises:
            KeyError: a sample's metadata has no ``secret``.
        """
        observations, new_metadata, rewards, terminateds, answers = [], [], [], [], []
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True)):
            if "secret" not in (meta or {}):
                raise KeyError(
                    f"sample {i}: metadata has no 'secret' (keys: {sorted(meta or {})}); the "
                    "number_guess task's data processor must set extra_env_info['secret']"
                )
            state = dict(meta)
            observation, reward, done, guess = self._play(last_assistant_content(log), state)
            observations.append({"role": "environment", "content": observation})
            new_metadata.append(None if done else state)
            rewards.append(reward)
            terminateds.append(done)
            answers.append(None if guess is None else str(guess))
        size = len(observations)
        return EnvironmentReturn(
            observations=observations,
            metadata=new_metadata,
            next_stop_strings=[list(GUESS_STOP_STRINGS)] * size,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminateds, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """``accuracy``: fraction solved (reward > 0), ``pass@k`` by ``idx``; batch unchanged."""
        return batch, batch_success_metrics(batch, threshold=1e-6)
