"""A single-turn environment around plain reward functions: ``env.<task>.reward_fn``, or
several named ones, ``env.<task>.reward_fns: {<name>: path, ...}``.

The function is named by import path and called once per sample, inside the environment's
Ray actor, on the batch of samples the rollout sends in one step::

    def score(prompt, response, answer, metadata) -> float

``prompt`` is the row's prompt as in the data (before any template or chat rendering; a list of
messages for chat-format rows), ``response`` the model's reply text, ``answer`` the row's answer
(``data.answer_key``; None when the row has none) and ``metadata`` a dict of every field of the
row but ``prompt``, ``answer`` and ``task_name`` (so a prompt or answer column of another name,
``instruction``, is in it too). Every episode ends after one turn. The rows are prepared by the
``reward_fn`` processor (:func:`nemo_rl.data.processors.reward_fn_processor`).

With ``reward_fns`` each function is called the same way and the environment returns their
scores as named rewards ``{"reward/<name>": [B]}`` (what ``grpo.adv_estimator.name: gdpo``
normalises one by one); the sample's reward is their sum.

An optional ``env.<task>.answer_fn`` is called the same way and returns the answer the response
gives (a string, or None when it gives none): the environment returns it, ``nemo-rl eval``'s
maj@k votes over it and ``samples.jsonl`` records it. Without one the task returns no answers.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.common import (
    batch_success_metrics,
    final_step_return,
    last_assistant_content,
)
from nemo_rl.environments.interfaces import (
    REWARD_COMPONENT_PREFIX,
    EnvironmentInterface,
    EnvironmentReturn,
)
from nemo_rl.utils.plugins import load_function

REWARD_FN_SIGNATURE = "fn(prompt, response, answer, metadata) -> float"
ANSWER_FN_SIGNATURE = "fn(prompt, response, answer, metadata) -> str or None"
# A reward_fns name: what follows "reward/" in the reward's key and metric.
REWARD_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def load_reward_fn(path: str, where: str = "reward_fn") -> Callable[..., Any]:
    """The reward function at import path ``path``, checked to take four arguments.

    Raises:
        nemo_rl.utils.plugins.PluginError: naming ``where`` (the recipe field).
    """
    return load_function(path, 4, where, REWARD_FN_SIGNATURE)


def load_answer_fn(path: str, where: str = "answer_fn") -> Callable[..., Any]:
    """The answer function at import path ``path``, checked to take four arguments.

    Raises:
        nemo_rl.utils.plugins.PluginError: naming ``where`` (the recipe field).
    """
    return load_function(path, 4, where, ANSWER_FN_SIGNATURE)


def load_reward_fns(
    paths: dict[str, str], where: str = "reward_fns"
) -> dict[str, Callable[..., Any]]:
    """``{"reward/<name>": function}`` of ``{name: import path}``, each checked like
    :func:`load_reward_fn`.

    Raises:
        ValueError: no functions, or a name that is not letters, digits, ``_``, ``.``, ``-``.
        nemo_rl.utils.plugins.PluginError: a path, naming ``where.<name>``.
    """
    if not paths:
        raise ValueError(f"{where} is empty; give {{name: 'package.module:function', ...}}")
    functions = {}
    for name, path in sorted(paths.items()):
        if not REWARD_NAME.fullmatch(name):
            raise ValueError(
                f"{where}: reward name {name!r} must be letters, digits, '_', '.' or '-' (it "
                f"becomes the key and metric '{REWARD_COMPONENT_PREFIX}{name}')"
            )
        functions[REWARD_COMPONENT_PREFIX + name] = load_reward_fn(path, f"{where}.{name}")
    return functions


class RewardFnEnvironment(EnvironmentInterface):
    """Scores each sample with user reward functions; usable in-process or as a Ray actor.

    Args:
        reward_fn: import path ``"package.module:function"`` of the function (one reward).
        answer_fn: import path of the function giving each response's answer; None: no
            answers.
        reward_fns: ``{name: import path}`` instead of ``reward_fn``: several rewards, returned
            as ``{"reward/<name>": [B]}``.

    Metadata per sample: ``{"prompt", "answer", "metadata"}`` (the ``reward_fn`` processor's).
    """

    default_processor = "reward_fn"

    def __init__(
        self,
        reward_fn: Optional[str] = None,
        answer_fn: Optional[str] = None,
        reward_fns: Optional[dict[str, str]] = None,
    ) -> None:
        if (reward_fn is None) == (reward_fns is None):
            raise ValueError("RewardFnEnvironment takes exactly one of reward_fn and reward_fns")
        # {key: function}: "reward/<name>" keys with reward_fns, the one key "reward" without
        self.named = reward_fns is not None
        if reward_fns is not None:
            self.reward_fns = load_reward_fns(reward_fns)
            self.reward_fn_paths = {
                REWARD_COMPONENT_PREFIX + name: path for name, path in reward_fns.items()
            }
        else:
            assert reward_fn is not None
            self.reward_fns = {"reward": load_reward_fn(reward_fn)}
            self.reward_fn_paths = {"reward": reward_fn}
        self.answer_fn_path = answer_fn
        self.answer_fn = None if answer_fn is None else load_answer_fn(answer_fn)

    @classmethod
    def check_arguments(cls, where: str, *args: Any, **kwargs: Any) -> None:
        """The functions resolve and take four arguments (``where``: the recipe field of
        ``reward_fn`` or ``reward_fns``)."""
        if kwargs.get("reward_fns") is not None:
            load_reward_fns(kwargs["reward_fns"], where)
        else:
            load_reward_fn(kwargs["reward_fn"], where)
        if kwargs.get("answer_fn") is not None:
            section = where.rsplit(".", 1)[0]
            load_answer_fn(kwargs["answer_fn"], f"{section}.answer_fn")

    @classmethod
    def reward_components_with(cls, *args: Any, **kwargs: Any) -> tuple[str, ...]:
        """``reward/<name>`` of each of ``reward_fns``; () with one ``reward_fn``."""
        names = kwargs.get("reward_fns") or {}
        return tuple(sorted(REWARD_COMPONENT_PREFIX + name for name in names))

    @classmethod
    def returns_answers_with(cls, *args: Any, **kwargs: Any) -> bool:
        """With an ``answer_fn``."""
        return kwargs.get("answer_fn") is not None

    @staticmethod
    def _arguments(i: int, log: LLMMessageLogType, meta: dict[str, Any]) -> tuple[Any, ...]:
        """``(prompt, response, answer, metadata)`` of sample ``i``."""
        if "prompt" not in (meta or {}):
            raise KeyError(
                f"sample {i}: metadata has no 'prompt' (keys: {sorted(meta or {})}); rows of a "
                "reward_fn task need the 'reward_fn' processor (env.<task>.processor)"
            )
        return meta["prompt"], last_assistant_content(log), meta.get("answer"), meta.get("metadata", {})

    def _score(self, key: str, i: int, arguments: tuple[Any, ...]) -> float:
        value = self.reward_fns[key](*arguments)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(
                f"reward function {self.reward_fn_paths[key]!r} returned {value!r} for sample "
                f"{i}; it must return a finite float"
            )
        return float(value)

    def _answer(self, i: int, arguments: tuple[Any, ...]) -> Optional[str]:
        assert self.answer_fn is not None
        value = self.answer_fn(*arguments)
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"answer function {self.answer_fn_path!r} returned {value!r} for sample {i}; "
                "it must return a string, or None when the response gives no answer"
            )
        return value

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Reward (named rewards with ``reward_fns``; and answer, with an ``answer_fn``) of
        each sample's reply; every episode ends.

        Raises:
            ValueError: the reward function returned something other than a finite number, or
                the answer function something other than a string or None.
        """
        arguments = [
            self._arguments(i, log, meta)
            for i, (log, meta) in enumerate(zip(message_log_batch, metadata, strict=True))
        ]
        scores = {
            key: torch.tensor(
                [self._score(key, i, args) for i, args in enumerate(arguments)],
                dtype=torch.float32,
            )
            for key in self.reward_fns
        }
        rewards = scores if self.named else scores["reward"]
        if self.answer_fn is None:
            return final_step_return(rewards)
        return final_step_return(rewards, [self._answer(i, args) for i, args in enumerate(arguments)])

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        """``accuracy`` (share of samples with total reward >= 1) and ``pass@k``; batch
        unchanged."""
        return batch, batch_success_metrics(batch)
