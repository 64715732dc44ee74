"""The environment protocol: judge the latest turn of a batch of conversations.

Environments run as Ray actors; a rollout groups samples by ``task_name`` and calls the
matching environment's :meth:`EnvironmentInterface.step` on its samples only (through
:meth:`~EnvironmentInterface.step_packed`, which receives the conversations' tensors as numpy
arrays, :mod:`nemo_rl.environments.message_wire`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple, Optional

import torch

from nemo_rl.data.interfaces import LLMMessageLogType
from nemo_rl.environments.message_wire import unpack_message_logs
from nemo_rl.utils.fault_injection import fault_at, kill_this_process

# Keys of the named rewards an environment with several rewards returns (``reward/<name>``).
REWARD_COMPONENT_PREFIX = "reward/"


class EnvironmentReturn(NamedTuple):
    """What an environment says about each sample of a step (all lists of length B).

    Attributes:
        observations: the message appended to each conversation next, as
            ``{"role": ..., "content": ...}`` (role "environment", "user" or "tool"); content
            may be "" when there is nothing to say.
        metadata: per-sample state carried to the next step (None when the episode ended).
        next_stop_strings: stop strings for each sample's next generation turn, or None.
        rewards: ``[B]`` float32 reward of this turn, or for an environment with several
            rewards (GDPO) a dict of them, ``{"reward/<name>": [B] float32}``
            (:data:`REWARD_COMPONENT_PREFIX`): the turn's reward is their sum.
        terminateds: ``[B]`` bool, True when the episode ended (answered, solved, failed).
        answers: the answer the environment extracted from the response, or None.
    """

    observations: list[dict[str, str]]
    metadata: list[Optional[dict[str, Any]]]
    next_stop_strings: list[Optional[list[str]]]
    rewards: torch.Tensor | dict[str, torch.Tensor]
    terminateds: torch.Tensor
    answers: list[Optional[str]]


class EnvironmentInterface(ABC):
    """A task's judge (and, for multi-turn tasks, its other party).

    Class attributes a subclass may set:
        default_processor: the data processor of the task's rows when the recipe's section
            names none (a name registered in :data:`nemo_rl.data.processors.PROCESSORS` or an
            import path); "prompt" passes every row field to the environment as metadata.
        required_fields: fields every row of the task must have (after the ``data.prompt_key``
            / ``answer_key`` mapping, so ``"answer"`` is the ground truth); checked when the
            data loads, naming the file and row of the first one missing.
        returns_answers: whether :meth:`step` returns the answer it extracted from each
            response (:attr:`EnvironmentReturn.answers`, None where it found none): what
            ``nemo-rl eval``'s maj@k votes over; maj@k is refused for a task whose environment
            returns none. Default False.
        reward_components: the ``reward/<name>`` keys of the rewards :meth:`step` returns as a
            dict, sorted; () for an environment returning one reward tensor (the default).
            ``grpo.adv_estimator.name: gdpo`` is refused at config time for a task whose
            environment declares fewer than two.
    """

    default_processor: ClassVar[str] = "prompt"
    required_fields: ClassVar[tuple[str, ...]] = ()
    returns_answers: ClassVar[bool] = False
    reward_components: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_arguments(cls, where: str, *args: Any, **kwargs: Any) -> None:
        """Called when the recipe is validated with the arguments the environment will get;
        raise ValueError naming ``where`` (the recipe field) for a bad one. Default: no check."""

    @classmethod
    def returns_answers_with(cls, *args: Any, **kwargs: Any) -> bool:
        """Whether the environment started with these arguments returns answers (see
        ``returns_answers``); for a class where that depends on them. Default:
        ``returns_answers``."""
        return cls.returns_answers

    @classmethod
    def reward_components_with(cls, *args: Any, **kwargs: Any) -> tuple[str, ...] | None:
        """The ``reward/<name>`` keys the environment started with these arguments returns
        (see ``reward_components``); None when only its steps will tell. Default:
        ``reward_components``."""
        return cls.reward_components

    @abstractmethod
    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """Judge the last assistant turn of each conversation.

        Args:
            message_log_batch: B conversations, each ending with an assistant message.
            metadata: B dicts: the sample's ``extra_env_info`` on the first turn, then what
                the previous step returned.
        """

    def step_packed(
        self, packed_message_logs: list[list[dict[str, Any]]], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        """:meth:`step` on conversations sent with their tensors packed
        (:func:`~nemo_rl.environments.message_wire.pack_message_logs`): what a rollout calls
        on an environment actor."""
        if fault_at("environment.step", env=type(self).__name__) == "kill":  # tests only
            kill_this_process()
        return self.step(unpack_message_logs(packed_message_logs), metadata)

    def take_metrics(self) -> dict[str, float]:
        """Counts the environment kept since the last call (e.g. sandbox timeouts), then
        zeroed; the GRPO step logs them as ``env/<task>/<name>``. Default: none."""
        return {}

    @abstractmethod
    def global_post_process_and_metrics(
        self, batch: Any
    ) -> tuple[Any, dict[str, float]]:
        """After a whole rollout: adjust the final batch if needed and return task metrics
        (e.g. accuracy) as ``(batch, {name: value})``."""
