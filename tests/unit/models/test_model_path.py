"""Tests for nemo_rl.models.model_path: what a config's model_name resolves to, and what a name
that resolves to nothing says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_rl.models.model_path import local_model_path, resolve_model_path
from nemo_rl.models.tiny import TINY_MODEL_NAMES
from nemo_rl.utils.errors import ModelNotFoundError


def logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    """The logits of ``ids`` from the checkpoint in ``path``, loaded through transformers."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model(ids).logits


def test_tiny_names_and_folders_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMO_RL_CACHE_DIR", str(tmp_path / "cache"))
    resolved = resolve_model_path("tiny-llama")
    assert Path(resolved).parent == tmp_path / "cache" / "tiny_models"
    assert resolve_model_path(resolved) == resolved
    assert local_model_path("tiny-llama") == resolved == local_model_path(resolved)

    empty = tmp_path / "not_a_model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=str(empty)):
        resolve_model_path(str(empty))
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        resolve_model_path(str(tmp_path / "does_not_exist"))


def test_tiny_name_resolves_to_a_build_transformers_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMO_RL_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("tiny-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The answer is 19.", return_tensors="pt")["input_ids"]
    assert logits(path, ids).shape == (1, ids.shape[1], len(tokenizer))


def test_the_agent_recipes_tiny_model_has_its_own_sizes_and_tool_tags() -> None:
    path = Path(resolve_model_path("tiny-qwen2-tools"))
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert config["tie_word_embeddings"] and config["vocab_size"] == 1024
    assert AutoTokenizer.from_pretrained(path).tokenize("<tool_call>") == ["<tool_call>"]


def test_hub_name_resolves_to_its_cached_snapshot(
    hub_tiny_llama: tuple[str, Path], tiny_llama_path: Path
) -> None:
    name, snapshot = hub_tiny_llama
    assert Path(resolve_model_path(name)) == snapshot
    assert local_model_path(name) == str(snapshot)
    ids = torch.tensor([[5, 17, 42]])
    assert torch.equal(logits(str(snapshot), ids), logits(str(tiny_llama_path), ids))


def test_unknown_hub_name_says_what_to_do(offline_hub_cache: Path) -> None:
    # Offline mode makes the hub lookup fail at once; without it, a machine with no network
    # fails the same way after ~45 s of huggingface_hub retries.
    name = "nemo-rl-test/definitely-not-a-model"
    assert local_model_path(name) is None  # checks before a run download nothing
    with pytest.raises(ModelNotFoundError, match="could not provide it") as info:
        resolve_model_path(name, field="policy.model_name")
    message = str(info.value)
    assert message.startswith("policy.model_name: ") and name in message
    assert "local checkpoint folder" in message and str(sorted(TINY_MODEL_NAMES)) in message
    assert info.value.__cause__ is not None
