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


def test_vocabulary_padding_is_out_of_every_softmax(one_rank, tmp_path):
    """Megatron pads the 300-token vocabulary to 384 rows; those rows are no tokens: the
    stage's logits give them -inf, and its logprobs (from the logits, and from the fused LM
    head) equal transformers' log-softmax over the 300 tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nemo_rl.models.megatron.lm_head import output_layer_returns_hidden, output_weight
    from nemo_rl.models.policy.workers.megatron.forward import (
        build_model_inputs,
        logprobs_from_hidden,
        logprobs_from_logits,
    )

    vocab = SIZES["vocab_size"]
    path = _checkpoint(LlamaConfig(**SIZES), tmp_path / "padded")
    bridge = BridgeConfig.from_hf(path)
    assert bridge.padded_vocab(1) == 384
    config = bridge.transformer_config(1, 1)
    model = gpt_model_stage(bridge, config, get_gpt_layer_spec(use_te=False), 1).eval()
    load_hf_weights(model, bridge, path)
    ids = torch.randint(0, vocab, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
    inputs = build_model_inputs(
        {"input_ids": ids, "input_lengths": torch.tensor([SEQ_LEN, SEQ_LEN - 5])}, False, 1, 0
    )
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=None)
        with output_layer_returns_hidden(model):
            hidden = model(ids, positions, attention_mask=None)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
    assert logits.shape[-1] == 384 and torch.isneginf(logits[..., vocab:]).all()
    expected = torch.zeros(2, SEQ_LEN)
    expected[:, 1:] = reference.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    expected[1, SEQ_LEN - 5 :] = 0.0
    weight, start = output_weight(model)
    assert weight.shape[0] == vocab and start == 0
    for mine in (
        logprobs_from_logits(logits, inputs, True),
        logprobs_from_hidden(hidden, weight, start, inputs, True, 7),
    ):
        assert (mine - expected).abs().max().item() <= 1e-5
    # the padding's share of the softmax is what the fix removes: with it, the logprobs differ
    with_padding = logits.masked_fill(torch.isneginf(logits), 0.0).log_softmax(-1)
    assert (with_padding[..., :vocab] - reference.log_softmax(-1)).abs().max().item() > 1e-3


def test_each_tensor_parallel_rank_knows_its_token_rows(monkeypatch):
    """Rows [start, start + rows) per rank; the padding (ids >= vocab_size) gets -inf."""
    from megatron.core import parallel_state

    from megatron_bridge.vocab_padding import exclude_vocab_padding, padding_mask_of

    class Layer(torch.nn.Module):
        output_size_per_partition = 128

        def forward(self, x):
            return x, None

    class Stage:
        post_process = True

    vocab = 300  # 3 ranks of 128 rows: 128 + 128 + 44 tokens, then 84 rows of padding
    shards = []
    for rank in range(3):
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda r=rank: r)
        stage = Stage()
        stage.output_layer = Layer()
        shards.append(exclude_vocab_padding(stage, vocab))
        logits, _ = stage.output_layer(torch.zeros(2, 128))
        assert torch.isneginf(logits).sum().item() == 2 * (128 - shards[-1].tokens)
        assert (padding_mask_of(stage.output_layer) is None) == (rank < 2)
    assert [(s.start, s.rows, s.tokens) for s in shards] == [(0, 128, 128), (128, 128, 128), (256, 128, 44)]
