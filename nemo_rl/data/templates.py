"""Prompt templates, system prompts and chat-template rendering into tokenized messages.

A prompt becomes a list of :class:`~nemo_rl.data.interfaces.Message` whose ``content`` is the
text exactly as it appears in the model's input and whose ``token_ids`` are that text's tokens.
With a chat template, each message's text is the part the template adds for it (rendering the
conversation one message longer each time); the last user message also carries the generation
prompt (e.g. ``<|im_start|>assistant\\n``). Without one, the system prompt and the prompt are
joined as plain text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from nemo_rl.data.interfaces import LLMMessageLogType, Message


def load_prompt_file(path: Optional[str], config_key: str) -> Optional[str]:
    """Text of a prompt file (``data.prompt_file`` / ``data.system_prompt_file``), or None.

    Raises:
        FileNotFoundError: naming ``config_key`` when the file does not exist.
    """
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"{config_key}: file {path!r} does not exist; fix the path or set null"
        )
    return file.read_text(encoding="utf-8")


def apply_prompt_template(template: Optional[str], prompt: str) -> str:
    """``template`` with its ``{}`` placeholder replaced by ``prompt``; ``prompt`` if None.

    Raises:
        ValueError: when the template has no ``{}`` placeholder or other unescaped braces.
    """
    if template is None:
        return prompt
    if "{}" not in template:
        raise ValueError(
            f"prompt template {template[:60]!r} has no '{{}}' placeholder for the prompt; "
            "add one (write literal braces as '{{' and '}}')"
        )
    try:
        return template.format(prompt)
    except (IndexError, KeyError, ValueError) as err:
        raise ValueError(
            f"prompt template {template[:60]!r} is not a valid str.format template with one "
            f"'{{}}' ({err}); write literal braces as '{{{{' and '}}}}'"
        ) from err


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders conversations with a chat template."""
    return getattr(tokenizer, "chat_template", None) is not None


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


ChatMessages = list[dict[str, str]]


def check_chat_messages(messages: Any, where: str) -> ChatMessages:
    """``messages`` if it is a non-empty list of ``{"role": str, "content": str}`` dicts.

    Raises:
        ValueError: naming ``where`` (e.g. the file and row) and the first bad message.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a chat prompt must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"{where}: message {i} must be {{\"role\": str, \"content\": str}}, got "
                f"{str(m)[:80]}"
            )
    return messages


def _with_system_prompt(user_text: str | ChatMessages, system_prompt: Optional[str]) -> ChatMessages:
    """The prompt's messages: ``user_text`` (one user message, or messages) after the system
    prompt, unless they start with a system message."""
    turns = [{"role": "user", "content": user_text}] if isinstance(user_text, str) else user_text
    chat = [dict(m) for m in turns]
    if system_prompt is not None and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": system_prompt})
    return chat


def render_prompt_texts(
    tokenizer: Any, user_text: str | ChatMessages, system_prompt: Optional[str]
) -> list[tuple[str, str]]:
    """(role, rendered text) per prompt message; the texts concatenate to the model's input.

    ``user_text`` is one user message, or a list of ``{"role", "content"}`` messages (chat
    format; the system prompt goes first unless the list starts with a system message).
    With a chat template the conversation is rendered one message longer each time and each
    message gets the added text; if the template does not render prefixes consistently (e.g.
    it injects a default system prompt), the whole rendering becomes one ``user`` message.
    Without a chat template: the system prompt plus a blank line, then each message's text
    (separated by blank lines); the tokenizer's bos token, if any, starts the first message.
    """
    chat = _with_system_prompt(user_text, system_prompt)
    if not has_chat_template(tokenizer):
        bos = getattr(tokenizer, "bos_token", None) or ""
        texts = [
            (m["role"], m["content"] + ("\n\n" if i < len(chat) - 1 else ""))
            for i, m in enumerate(chat)
        ]
        texts[0] = (texts[0][0], bos + texts[0][1])
        return texts
    texts = _render_by_message(tokenizer, chat, [False] * (len(chat) - 1) + [True])
    return texts if texts is not None else [("user", _render(tokenizer, chat, True))]


def _render_by_message(
    tokenizer: Any, chat: ChatMessages, generation_prompts: list[bool]
) -> list[tuple[str, str]] | None:
    """(role, added text) per message of ``chat``: the conversation rendered one message longer
    each time, ``chat[:i + 1]`` with the generation prompt when ``generation_prompts[i]``; None
    when a rendering does not start with the previous one (the template does not render
    prefixes consistently)."""
    texts, previous = [], ""
    for end, generation_prompt in enumerate(generation_prompts, start=1):
        rendered = _render(tokenizer, chat[:end], generation_prompt)
        if not rendered.startswith(previous):
            return None
        texts.append((chat[end - 1]["role"], rendered[len(previous):]))
        previous = rendered
    return texts


def render_conversation_texts(tokenizer: Any, messages: ChatMessages) -> list[tuple[str, str]]:
    """(role, rendered text) per message of a whole conversation (for training on it).

    Each message before an assistant message also carries the template's generation prompt
    (e.g. ``<|im_start|>assistant\\n``), so an assistant message's text is only what the model
    writes: its content and the end-of-turn tokens.

    Raises:
        ValueError: the tokenizer has no chat template, or its template does not render the
            conversation's prefixes consistently (assistant tokens cannot be told apart).
    """
    if not has_chat_template(tokenizer):
        raise ValueError(
            "chat data needs a tokenizer with a chat template (to mark the assistant tokens); "
            "set policy.tokenizer.chat_template or use a chat model"
        )
    flags = [messages[i + 1]["role"] == "assistant" for i in range(len(messages) - 1)] + [False]
    texts = _render_by_message(tokenizer, messages, flags)
    if texts is None:
        raise ValueError(
            "the chat template does not render the conversation message by message (a prefix "
            "renders differently inside the whole); use a template without such rewrites"
        )
    return texts


def tokenize_text(tokenizer: Any, text: str) -> torch.Tensor:
    """``[n]`` int64 token ids of ``text`` without added special tokens (the text has them)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def build_prompt_message_log(
    tokenizer: Any,
    prompt: str | ChatMessages,
    prompt_template: Optional[str],
    system_prompt: Optional[str],
) -> LLMMessageLogType:
    """The tokenized prompt messages of one row: template applied, then chat-rendered.

    ``prompt`` is a text, or a list of ``{"role", "content"}`` messages (chat format; the
    template then applies to the content of its last user message).
    """
    return [
        Message(role=role, content=text, token_ids=tokenize_text(tokenizer, text))
        for role, text in render_prompt_texts(
            tokenizer, _templated(prompt, prompt_template), system_prompt
        )
    ]


def _templated(prompt: str | ChatMessages, prompt_template: Optional[str]) -> str | ChatMessages:
    """``prompt`` with the template applied to it (a text) or to its last user message."""
    if isinstance(prompt, str):
        return apply_prompt_template(prompt_template, prompt)
    user_text = [dict(m) for m in check_chat_messages(prompt, "chat prompt")]
    last_user = max((i for i, m in enumerate(user_text) if m["role"] == "user"), default=None)
    if last_user is not None:
        content = user_text[last_user]["content"]
        user_text[last_user]["content"] = apply_prompt_template(prompt_template, content)
    return user_text


def prompt_chat_messages(
    prompt: str | ChatMessages, prompt_template: Optional[str], system_prompt: Optional[str]
) -> ChatMessages:
    """The ``{"role", "content"}`` messages :func:`build_prompt_message_log` renders."""
    return _with_system_prompt(_templated(prompt, prompt_template), system_prompt)


def truncate_message_log(
    message_log: LLMMessageLogType, max_tokens: int, tokenizer: Any
) -> LLMMessageLogType:
    """Keep the first ``max_tokens`` tokens of the conversation (later messages cut first);
    a cut message's ``content`` is re-decoded from its kept tokens, emptied messages are dropped."""
    kept: LLMMessageLogType = []
    budget = max_tokens
    for message in message_log:
        if budget <= 0:
            break
        n = int(message["token_ids"].numel())
        if n <= budget:
            kept.append(message)
        else:
            ids = message["token_ids"][:budget]
            cut = Message(role=message["role"], content=tokenizer.decode(ids), token_ids=ids)
            if "generation_logprobs" in message:
                cut["generation_logprobs"] = message["generation_logprobs"][:budget]
            kept.append(cut)
        budget -= min(n, budget)
    return kept
