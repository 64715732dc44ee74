"""Fixtures for the megatron_bridge tests: tiny checkpoints of every supported family."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The helpers live next to this file; spawned ranks import them by module name.
sys.path.insert(0, str(Path(__file__).parent))

from mb_fixtures import build_family_checkpoints, build_moe_checkpoints  # noqa: E402


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family name -> HF checkpoint folder (llama, qwen2, qwen3, mistral, llama3rope)."""
    return build_family_checkpoints(tmp_path_factory.mktemp("mb_families"))


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> HF checkpoint folder of the mixture-of-experts models (qwen3_moe, mixtral)."""
    return build_moe_checkpoints(tmp_path_factory.mktemp("mb_moe"))
