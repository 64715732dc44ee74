"""Prompt templates, prompt files and chat rendering into tokenized messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.data.templates import (
    apply_prompt_template,
    build_prompt_message_log,
    load_prompt_file,
    render_prompt_texts,
    truncate_message_log,
)


def test_apply_prompt_template() -> None:
    assert apply_prompt_template(None, "What is 1 + 2?") == "What is 1 + 2?"
    assert apply_prompt_template("Q: {} A in \\boxed{{}}", "x") == "Q: x A in \\boxed{}"
    with pytest.raises(ValueError, match="placeholder"):
        apply_prompt_template("no placeholder", "x")
    with pytest.raises(ValueError, match="str.format"):
        apply_prompt_template("{} and {name}", "x")


def test_load_prompt_file(tmp_path: Path) -> None:
    file = tmp_path / "prompt.txt"
    file.write_text("Solve: {}\n", encoding="utf-8")
    assert load_prompt_file(str(file), "data.prompt_file") == "Solve: {}\n"
    assert load_prompt_file(None, "data.prompt_file") is None
    with pytest.raises(FileNotFoundError, match="data.system_prompt_file"):
        load_prompt_file(str(tmp_path / "missing.txt"), "data.system_prompt_file")


@pytest.mark.parametrize("system_prompt", [None, "You are a calculator."])
def test_chat_template_rendering_matches_the_tokenizer(
    chat_tokenizer: Any, system_prompt: str | None
) -> None:
    log = build_prompt_message_log(chat_tokenizer, "What is 2 + 3?", "{} Answer:", system_prompt)
    chat = [{"role": "user", "content": "What is 2 + 3? Answer:"}]
    if system_prompt is not None:
        chat.insert(0, {"role": "system", "content": system_prompt})
    expected = chat_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert [m["role"] for m in log] == [c["role"] for c in chat]
    assert "".join(m["content"] for m in log) == expected
    assert log[-1]["content"].endswith("<|im_start|>assistant\n")
    for message in log:
        assert message["token_ids"].dtype == torch.int64
        assert message["token_ids"].tolist() == chat_tokenizer(
            message["content"], add_special_tokens=False
        )["input_ids"]
        assert chat_tokenizer.decode(message["token_ids"]) == message["content"]
    if system_prompt is not None:
        assert log[0]["content"] == f"<|im_start|>system\n{system_prompt}<|im_end|>\n"


def test_plain_text_without_chat_template(plain_tokenizer: Any) -> None:
    log = build_prompt_message_log(plain_tokenizer, "What is 2 + 3?", None, "Be brief.")
    assert [(m["role"], m["content"]) for m in log] == [
        ("system", "Be brief.\n\n"),
        ("user", "What is 2 + 3?"),
    ]
    assert "<|im_start|>" not in "".join(m["content"] for m in log)
    assert log[1]["token_ids"].tolist() == plain_tokenizer(
        "What is 2 + 3?", add_special_tokens=False
    )["input_ids"]


def test_inconsistent_template_becomes_one_user_message(chat_tokenizer: Any) -> None:
    class DefaultSystemPrompt:
        """A template that injects a system prompt only when the user speaks."""

        chat_template = "x"

        def apply_chat_template(
            self, messages: list, tokenize: bool, add_generation_prompt: bool
        ) -> str:
            text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
            return ("[default]" + text) if messages[-1]["role"] == "user" else text

    texts = render_prompt_texts(DefaultSystemPrompt(), "hi", "sys")
    assert texts == [("user", "[default][system]sys[user]hi")]


def test_truncate_message_log(chat_tokenizer: Any) -> None:
    log = build_prompt_message_log(chat_tokenizer, "What is 2 + 3?", None, "You are a calculator.")
    first = int(log[0]["token_ids"].numel())
    cut = truncate_message_log(log, first + 3, chat_tokenizer)
    assert len(cut) == 2 and cut[0] is log[0]
    assert cut[1]["token_ids"].tolist() == log[1]["token_ids"][:3].tolist()
    assert cut[1]["content"] == chat_tokenizer.decode(log[1]["token_ids"][:3])
    assert [m["role"] for m in truncate_message_log(log, first, chat_tokenizer)] == ["system"]
