"""Whole conversations for supervised training: chat rows (SFT) and preference pairs (DPO).

A chat row holds a list of ``{"role", "content"}`` messages (NeMo RL's ``messages`` key); it
becomes a :class:`~nemo_rl.data.interfaces.DatumSpec` whose message log is the conversation
rendered by the chat template (:func:`~nemo_rl.data.templates.render_conversation_texts`), so
:func:`~nemo_rl.data.llm_message_utils.message_logs_to_flat`'s ``token_mask`` selects exactly
the assistant tokens.

A preference row holds a prompt and a chosen and a rejected reply, in either form:

- ``{"prompt": P, "chosen": C, "rejected": R}`` (key names configurable), P a text or a list of
  messages, C and R a text or a list of assistant-side messages;
- NeMo RL's ``{"context": [messages], "completions": [{"rank": 0, "completion": [messages]},
  {"rank": 1, "completion": [messages]}]}``: the lowest rank is chosen, the next rejected.

A conversation longer than ``max_seq_length`` tokens is cut and gets ``loss_multiplier`` 0; a
pair with either side cut gets 0 on both, so pairs stay whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import Dataset

from nemo_rl.data.datasets import Rows, check_rows_have
from nemo_rl.data.files import DataError
from nemo_rl.data.interfaces import DatumSpec, Message
from nemo_rl.data.llm_message_utils import rl_collate_fn
from nemo_rl.data.processors import message_log_length
from nemo_rl.data.templates import (
    ChatMessages,
    check_chat_messages,
    render_conversation_texts,
    tokenize_text,
    truncate_message_log,
)
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

# Task name of supervised rows (they have no environment).
SUPERVISED_TASK = "sft"


def conversation_datum(
    messages: ChatMessages, tokenizer: Any, max_seq_length: int, idx: int, where: str
) -> DatumSpec:
    """One conversation as a :class:`DatumSpec` (``loss_multiplier`` 0 when cut).

    Raises:
        DataError: naming ``where`` when the messages are malformed or have no assistant
            message (nothing to train on).
    """
    try:
        check_chat_messages(messages, where)
        texts = render_conversation_texts(tokenizer, messages)
    except ValueError as err:
        raise DataError(str(err) if where in str(err) else f"{where}: {err}") from None
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    log = [
        Message(role=role, content=text, token_ids=tokenize_text(tokenizer, text))
        for role, text in texts
    ]
    length, multiplier = message_log_length(log), 1.0
    if length > max_seq_length:
        log, length, multiplier = truncate_message_log(log, max_seq_length, tokenizer), max_seq_length, 0.0
    return DatumSpec(
        message_log=log,
        length=length,
        extra_env_info={},
        loss_multiplier=multiplier,
        idx=idx,
        task_name=SUPERVISED_TASK,
        stop_strings=None,
    )


class ChatDataset(Dataset):
    """Chat rows (SFT): row ``i``'s ``messages_key`` field as a :class:`DatumSpec`.

    Args:
        rows: row dicts (a list or a ``datasets.Dataset``); each must have ``messages_key``
            (checked here, naming the row and ``config_key``).
        tokenizer: HF tokenizer with a chat template.
        max_seq_length: conversations longer than this (tokens) are cut and kept out of the loss.
        messages_key: field holding the messages.
        config_key: the config key naming ``messages_key``, for error messages.
        source: the rows' origin (a path), for error messages.
    """

    def __init__(
        self,
        rows: Rows,
        tokenizer: Any,
        max_seq_length: int,
        messages_key: str = "messages",
        config_key: str = "data.chat_key",
        source: str = "dataset",
    ) -> None:
        check_rows_have(rows, messages_key, config_key, source)
        self.rows, self.tokenizer, self.max_seq_length = rows, tokenizer, max_seq_length
        self.messages_key, self.source = messages_key, source

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> DatumSpec:
        messages = self.rows[idx][self.messages_key]
        where = f"{self.source}: row {idx}"
        return conversation_datum(messages, self.tokenizer, self.max_seq_length, idx, where)


def _as_messages(value: Any, role: str) -> ChatMessages:
    """A text as one ``role`` message; a list of messages as is."""
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def preference_triple(
    row: Mapping[str, Any], keys: tuple[str, str, str], where: str
) -> tuple[ChatMessages, ChatMessages, ChatMessages]:
    """``(prompt, chosen, rejected)`` messages of a preference row in either format (see the
    module docstring); ``keys`` are the (prompt, chosen, rejected) field names.

    Raises:
        DataError: naming ``where`` and the missing field.
    """
    if "context" in row and "completions" in row:
        completions = sorted(row["completions"], key=lambda c: c["rank"])
        if len(completions) < 2:
            raise DataError(f"{where}: 'completions' needs two ranked completions")
        return row["context"], completions[0]["completion"], completions[1]["completion"]
    for key in keys:
        if row.get(key) is None:
            raise DataError(
                f"{where}: no field {key!r}; a preference row needs {list(keys)} (set "
                "data.prompt_key / chosen_key / rejected_key) or NeMo RL's 'context' and "
                "'completions'"
            )
    prompt, chosen, rejected = (row[k] for k in keys)
    return (
        _as_messages(prompt, "user"),
        _as_messages(chosen, "assistant"),
        _as_messages(rejected, "assistant"),
    )


class PreferenceDataset(Dataset):
    """Preference rows (DPO): row ``i`` as its (chosen, rejected) pair of :class:`DatumSpec`,
    each the prompt followed by one reply.

    Args:
        rows: row dicts in either format of the module docstring.
        tokenizer: HF tokenizer with a chat template.
        max_seq_length: a pair with a side longer than this is kept out of the loss.
        keys: (prompt, chosen, rejected) field names of the flat format.
        source: the rows' origin (a path), for error messages.
    """

    def __init__(
        self,
        rows: Rows,
        tokenizer: Any,
        max_seq_length: int,
        keys: tuple[str, str, str] = ("prompt", "chosen", "rejected"),
        source: str = "dataset",
    ) -> None:
        self.rows, self.tokenizer, self.max_seq_length = rows, tokenizer, max_seq_length
        self.keys, self.source = keys, source
        for idx in range(len(rows)):  # missing fields fail now, not mid-run
            preference_triple(rows[idx], keys, f"{source}: row {idx}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> tuple[DatumSpec, DatumSpec]:
        where = f"{self.source}: row {idx}"
        prompt, chosen, rejected = preference_triple(self.rows[idx], self.keys, where)
        pair = tuple(
            conversation_datum(
                [*prompt, *reply], self.tokenizer, self.max_seq_length, idx, where
            )
            for reply in (chosen, rejected)
        )
        multiplier = min(d["loss_multiplier"] for d in pair)
        for datum in pair:
            datum["loss_multiplier"] = multiplier
        return pair


def preference_collate_fn(pairs: Sequence[tuple[DatumSpec, DatumSpec]]) -> BatchedDataDict:
    """``P`` pairs as one batch of ``2P`` rows, chosen at even rows and rejected at odd rows
    (row 2i chosen, 2i+1 rejected: the layout :class:`~nemo_rl.algorithms.loss.DPOLossFn`
    reads); fields as :func:`~nemo_rl.data.llm_message_utils.rl_collate_fn`."""
    return rl_collate_fn([datum for pair in pairs for datum in pair])
