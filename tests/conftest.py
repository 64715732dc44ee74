"""Fixtures shared by the unit and functional suites."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    """Tiny random Llama checkpoint (untied embeddings, GQA), built once and cached."""
    return build_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path() -> Path:
    """Tiny random Qwen2 checkpoint (tied embeddings, QKV bias, GQA), built once and cached."""
    return build_tiny_model("qwen2")
