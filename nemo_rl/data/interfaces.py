"""Types of prompt data and of the conversations a rollout builds.

A sample is a :data:`LLMMessageLogType`: the list of its messages in order. Every message keeps
its text and the token ids it contributes to the flat sequence the policy trains on, so token
accounting never re-tokenizes a whole conversation (re-tokenizing can merge tokens across
message boundaries and shift the logprobs of generated tokens).
"""

from __future__ import annotations

from typing import Any, NotRequired, Optional, Protocol, TypedDict

import torch


class Message(TypedDict):
    """One turn of a conversation.

    Attributes:
        role: "system", "user", "assistant", "environment" or "tool".
        content: the turn's text, as rendered into the sequence (chat template included).
        token_ids: ``[n]`` int64 token ids of ``content`` in the flat sequence.
        generation_logprobs: ``[n]`` float32, assistant turns only: the generation engine's
            logprob of each generated token.
    """

    role: str
    content: str
    token_ids: torch.Tensor
    generation_logprobs: NotRequired[torch.Tensor]


LLMMessageLogType = list[Message]


class DatumSpec(TypedDict):
    """One prompt, ready for a rollout.

    Attributes:
        message_log: the prompt's messages (system/user), tokenized.
        length: total tokens of ``message_log``.
        extra_env_info: what the task's environment needs to judge a response (e.g. the
            ground-truth answer); passed to ``EnvironmentInterface.step`` as metadata.
        loss_multiplier: 1.0 to train on this sample, 0.0 to keep it out of the loss (e.g. a
            prompt truncated to fit ``max_seq_length``).
        idx: index of the row in its dataset.
        task_name: which environment judges this sample (a key of ``task_to_env``).
        stop_strings: stop strings for the first generation turn, None for none.
    """

    message_log: LLMMessageLogType
    length: int
    extra_env_info: dict[str, Any]
    loss_multiplier: float
    idx: int
    task_name: str
    stop_strings: NotRequired[Optional[list[str]]]


class TaskDataSpec(TypedDict):
    """How a task's rows become prompts.

    Attributes:
        task_name: the task (and environment) name.
        prompt: a ``str.format`` template with ``{}`` for the row's prompt text, or None.
        system_prompt: system message text, or None.
    """

    task_name: str
    prompt: Optional[str]
    system_prompt: Optional[str]


class TaskDataProcessFnCallable(Protocol):
    """Turns one dataset row into a :class:`DatumSpec`."""

    def __call__(
        self,
        datum_dict: dict[str, Any],
        task_data_spec: TaskDataSpec,
        tokenizer: Any,
        max_seq_length: int,
        idx: int,
    ) -> DatumSpec: ...
