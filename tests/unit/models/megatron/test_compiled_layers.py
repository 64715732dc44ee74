"""Regional compilation (``megatron_cfg.compile_transformer_layers``): the key is off by
default; on, every decoder layer of the GPTModel is compiled in place (same parameter names).
Compiled against eager logits on the tiny Llama runs where CUDA is (a CPU compile of the
layer would cost inductor's C++ build in CI); docs/performance.md has the GPU command."""

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
from nemo_rl.models.megatron.compiled_layers import compile_transformer_layers
from nemo_rl.models.megatron.context_parallel_layer_specs import get_gpt_layer_spec
from nemo_rl.models.policy.config import PolicyConfig


@pytest.fixture(scope="module")
def one_rank():
    initialize_megatron_parallel(rank=0, world_size=1, master_port=find_free_port())
    yield
    destroy_megatron_parallel()


def _model(path: Path) -> torch.nn.Module:
    bridge = BridgeConfig.from_hf(path)
    model = gpt_model_stage(bridge, bridge.transformer_config(1, 1), get_gpt_layer_spec(use_te=False), 1)
    if torch.cuda.is_available():
        model.cuda()
    load_hf_weights(model, bridge, path)
    return model.eval()


def test_key_is_off_by_default() -> None:
    assert PolicyConfig().megatron_cfg.compile_transformer_layers is False
    assert PolicyConfig(megatron_cfg={"compile_transformer_layers": True}).megatron_cfg.compile_transformer_layers


def test_every_layer_compiled_in_place(one_rank, tiny_llama_path: Path) -> None:
    model = _model(tiny_llama_path)
    names = list(model.state_dict())
    assert compile_transformer_layers(model) == len(model.decoder.layers) > 0
    assert all(layer._compiled_call_impl is not None for layer in model.decoder.layers)
    assert list(model.state_dict()) == names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile equality runs on a GPU")
def test_compiled_layers_equal_eager(one_rank, tiny_llama_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(tiny_llama_path)
    ids = torch.randint(3, 1000, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(64, device="cuda").expand(2, 64)
    with torch.no_grad():
        eager = model(ids, positions, attention_mask=None)
        compile_transformer_layers(model)
        compiled = model(ids, positions, attention_mask=None)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
