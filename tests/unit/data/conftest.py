"""Tokenizers of the tiny Llama for the data tests: with its ChatML template and without one."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_llama_path: Path) -> Any:
    """The tiny model's tokenizer (it has a ChatML chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    assert tokenizer.chat_template is not None
    return tokenizer


@pytest.fixture(scope="session")
def plain_tokenizer(chat_tokenizer: Any) -> Any:
    """The same tokenizer with its chat template removed."""
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = None
    return tokenizer
