"""Per-task processors: one dataset row -> one :class:`~nemo_rl.data.interfaces.DatumSpec`.

Rows reaching a processor carry the canonical keys ``"prompt"`` (and ``"answer"`` when the
dataset has answers) whatever the source's own column names were (see
:mod:`nemo_rl.data.datasets`). A prompt longer than ``max_seq_length`` tokens is cut to
``max_seq_length`` and gets ``loss_multiplier`` 0, so it never trains the policy.
"""

from __future__ import annotations

from typing import Any

from nemo_rl.data.files import DataError
from nemo_rl.data.interfaces import (
    DatumSpec,
    LLMMessageLogType,
    Message,
    TaskDataProcessFnCallable,
    TaskDataSpec,
)
from nemo_rl.data.templates import (
    build_prompt_message_log,
    check_chat_messages,
    prompt_chat_messages,
    render_conversation_texts,
    tokenize_text,
    truncate_message_log,
)
from nemo_rl.utils.plugins import load_function


def message_log_length(message_log: LLMMessageLogType) -> int:
    """Total tokens of a conversation."""
    return sum(int(m["token_ids"].numel()) for m in message_log)


def _prompt_datum(
    datum_dict: dict[str, Any],
    task_data_spec: TaskDataSpec,
    tokenizer: Any,
    max_seq_length: int,
    idx: int,
    extra_env_info: dict[str, Any],
) -> DatumSpec:
    message_log = build_prompt_message_log(
        tokenizer, datum_dict["prompt"], task_data_spec["prompt"], task_data_spec["system_prompt"]
    )
    length = message_log_length(message_log)
    loss_multiplier = 1.0
    if length > max_seq_length:
        message_log = truncate_message_log(message_log, max_seq_length, tokenizer)
        length, loss_multiplier = max_seq_length, 0.0
    return DatumSpec(
        message_log=message_log,
        length=length,
        extra_env_info=extra_env_info,
        loss_multiplier=loss_multiplier,
        idx=idx,
        task_name=datum_dict.get("task_name") or task_data_spec["task_name"],
        stop_strings=None,
    )


def math_data_processor(
    datum_dict: dict[str, Any],
    task_data_spec: TaskDataSpec,
    tokenizer: Any,
    max_seq_length: int,
    idx: int,
) -> DatumSpec:
    """A math problem: the prompt, judged against ``extra_env_info["ground_truth"]``.

    Raises:
        KeyError: when the row has no ``"answer"`` (set ``data.answer_key``).
    """
    if datum_dict.get("answer") is None:
        raise KeyError(
            f"row {idx} has no answer; the math task needs one (set data.answer_key to the "
            "field holding the ground truth)"
        )
    info = {"ground_truth": str(datum_dict["answer"])}
    return _prompt_datum(datum_dict, task_data_spec, tokenizer, max_seq_length, idx, info)


def prompt_only_processor(
    datum_dict: dict[str, Any],
    task_data_spec: TaskDataSpec,
    tokenizer: Any,
    max_seq_length: int,
    idx: int,
) -> DatumSpec:
    """A prompt with no ground truth (environments that judge on their own, e.g. games);
    every other field of the row goes to ``extra_env_info``."""
    info = {k: v for k, v in datum_dict.items() if k not in ("prompt", "task_name")}
    return _prompt_datum(datum_dict, task_data_spec, tokenizer, max_seq_length, idx, info)


def sft_data_processor(
    datum_dict: dict[str, Any],
    task_data_spec: TaskDataSpec,
    tokenizer: Any,
    max_seq_length: int,
    idx: int,
) -> DatumSpec:
    """A prompt plus its reference reply ``datum_dict["response"]``, for supervised
    warm-start: a text, as one assistant message (ending with the tokenizer's eos token), or a
    list of ``{"role", "content"}`` messages continuing the conversation (an agent's exchange:
    assistant turns with the tool results between them), rendered by the chat template.

    Train on it with :func:`nemo_rl.data.llm_message_utils.message_logs_to_flat`, whose
    ``token_mask`` selects the assistant tokens: a tool result in the reply is context, never
    a target (the model would learn to make tool results up rather than to read them).
    """
    if datum_dict.get("response") is None:
        raise KeyError(f"row {idx} has no 'response'; an SFT row needs the reference reply")
    datum = _prompt_datum(datum_dict, task_data_spec, tokenizer, max_seq_length, idx, {})
    if datum["loss_multiplier"] == 0.0:
        return datum
    reply = datum_dict["response"]
    if isinstance(reply, str):
        text = reply + (tokenizer.eos_token or "")
        replies = [Message(role="assistant", content=text, token_ids=tokenize_text(tokenizer, text))]
    else:
        replies = _reply_messages(datum_dict["prompt"], reply, task_data_spec, tokenizer, idx)
    log = datum["message_log"] + replies
    if message_log_length(log) > max_seq_length:
        datum["message_log"] = truncate_message_log(log, max_seq_length, tokenizer)
        datum["length"], datum["loss_multiplier"] = max_seq_length, 0.0
    else:
        datum["message_log"], datum["length"] = log, message_log_length(log)
    if "answer" in datum_dict:
        datum["extra_env_info"] = {"ground_truth": str(datum_dict["answer"])}
    return datum


def _reply_messages(
    prompt: Any, reply: Any, task_data_spec: TaskDataSpec, tokenizer: Any, idx: int
) -> LLMMessageLogType:
    """The messages of a reply given as a list of messages, rendered as the chat template
    renders them after the prompt (the prompt's messages are rendered as
    :func:`~nemo_rl.data.templates.build_prompt_message_log` renders them).

    Raises:
        DataError: the reply is not a list of messages with at least one assistant message.
    """
    where = f"row {idx}: 'response'"
    try:
        check_chat_messages(reply, where)
    except ValueError as err:
        raise DataError(str(err)) from None
    if not any(m["role"] == "assistant" for m in reply):
        raise DataError(f"{where} has no assistant message to train on")
    prompt_messages = prompt_chat_messages(
        prompt, task_data_spec["prompt"], task_data_spec["system_prompt"]
    )
    texts = render_conversation_texts(tokenizer, prompt_messages + list(reply))
    return [
        Message(role=role, content=text, token_ids=tokenize_text(tokenizer, text))
        for role, text in texts[len(prompt_messages):]
    ]


def reward_fn_processor(
    datum_dict: dict[str, Any],
    task_data_spec: TaskDataSpec,
    tokenizer: Any,
    max_seq_length: int,
    idx: int,
) -> DatumSpec:
    """A prompt for a reward function (``env.<task>.reward_fn``): ``extra_env_info`` holds the
    row's ``"prompt"`` (as in the data, before any template), its ``"answer"`` (None when the
    row has none) and ``"metadata"``: every field of the row but ``prompt``, ``answer`` and
    ``task_name``, under the file's names (a prompt or answer column named otherwise, e.g.
    ``instruction``, is in it too)."""
    rest = {k: v for k, v in datum_dict.items() if k not in ("prompt", "answer", "task_name")}
    info = {"prompt": datum_dict["prompt"], "answer": datum_dict.get("answer"), "metadata": rest}
    return _prompt_datum(datum_dict, task_data_spec, tokenizer, max_seq_length, idx, info)


# Registered processors by name; an environment section's ``processor`` (or its environment
# class's ``default_processor``) names one of them or gives an import path.
PROCESSORS: dict[str, TaskDataProcessFnCallable] = {
    "math": math_data_processor,
    "prompt": prompt_only_processor,
    "reward_fn": reward_fn_processor,
    "sft": sft_data_processor,
}

PROCESSOR_SIGNATURE = "processor(datum_dict, task_data_spec, tokenizer, max_seq_length, idx)"


def get_processor(name: str, field: str = "processor") -> TaskDataProcessFnCallable:
    """The processor registered as ``name``, or the function at import path ``name``
    (``"package.module:function"``, called like the built-ins: see
    :class:`~nemo_rl.data.interfaces.TaskDataProcessFnCallable`).

    Args:
        name: a key of :data:`PROCESSORS` or an import path.
        field: the recipe field holding ``name``, named in errors.

    Raises:
        KeyError: naming the unknown name and the registered ones.
        nemo_rl.utils.plugins.PluginError: an import path that does not resolve to a function
            of five arguments.
    """
    if name in PROCESSORS:
        return PROCESSORS[name]
    if ":" in name:
        return load_function(name, 5, field, PROCESSOR_SIGNATURE)
    raise KeyError(
        f"{field}={name!r}: no data processor is registered under that name (registered: "
        f"{sorted(PROCESSORS)}); use one of them or an import path 'package.module:function'"
    )
