"""The policy's GPTModel (our layer spec: CP-capable attention) on models with the optional
features megatron_bridge implements: its logits equal transformers' on checkpoints with
attention/MLP biases and with a sliding window on some layers only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_bridge import BridgeConfig, load_hf_weights
from megatron_bridge.load import gpt_model_stage
from megatron_bridge.parallel_state import (
    destroy_megatron_parallel,
    find_free_port,
    initialize_megatron_parallel,
)
from nemo_rl.models.megatron.context_parallel_layer_specs import get_gpt_layer_spec
from random_checkpoints import perturb_norms_and_biases

SIZES = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
)
SEQ_LEN = 24


def _checkpoint(config, path: Path) -> Path:
    """A random HF checkpoint whose norms and biases are away from 1 and 0."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model)
    model.save_pretrained(path)
    return path


def _configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config

    return {
        "llama_attention_bias": LlamaConfig(**SIZES, attention_bias=True),
        "llama_mlp_bias": LlamaConfig(**SIZES, mlp_bias=True),
        "qwen2_window_on_layer_1": Qwen2Config(
            **SIZES, use_sliding_window=True, sliding_window=7, max_window_layers=1
        ),
    }


@pytest.fixture(scope="module")
def one_rank():
    initialize_megatron_parallel(rank=0, world_size=1, master_port=find_free_port())
    yield
    destroy_megatron_parallel()


@pytest.mark.parametrize("name", list(_configs()))
def test_policy_model_matches_transformers(one_rank, tmp_path, name):
    from transformers import AutoModelForCausalLM

    path = _checkpoint(_configs()[name], tmp_path / name)
    bridge = BridgeConfig.from_hf(path)
    config = bridge.transformer_config(1, 1)
    model = gpt_model_stage(bridge, config, get_gpt_layer_spec(use_te=False), 1).eval()
    load_hf_weights(model, bridge, path)
    ids = torch.randint(0, SIZES["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
    with torch.no_grad():
        mine = model(ids, positions, attention_mask=None)[..., : SIZES["vocab_size"]]
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
    assert (mine - reference).abs().max().item() <= 1e-5
