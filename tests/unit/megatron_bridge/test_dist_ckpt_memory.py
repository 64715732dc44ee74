"""Memory of streamed conversion: the dist-checkpoint writer and reader hold one chunk or
tensor at a time, not one per key, layer or expert (the count must not grow with the model).

Tensors are tracked by weak references to their storages, which die when the last tensor on
them does; the number alive while the next one is made is what the process holds beyond
metadata.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import megatron_bridge.dist_ckpt_writer as writer_module
from megatron_bridge import BridgeConfig
from megatron_bridge.checkpoint import checkpoint_bridge
from megatron_bridge.dist_ckpt_reader import checkpoint_hf_weights

# A Qwen3-MoE small enough to write in well under a second, with many experts so that most
# chunks are experts' (each layer its own checkpoint keys, as megatron-core saves a MoE model).
MOE_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=32,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
    moe_intermediate_size=8, num_experts=16, num_experts_per_tok=2, vocab_size=64,
    tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=64,
)


def _random_moe_checkpoint(out: Path, num_layers: int) -> Path:
    """An HF checkpoint of :data:`MOE_CONFIG` with ``num_layers`` layers, random weights."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({**MOE_CONFIG, "num_hidden_layers": num_layers}))
    bridge = BridgeConfig.from_hf(out)
    gen = torch.Generator().manual_seed(num_layers)
    tensors = {
        name: torch.randn(shape, generator=gen)
        for mapping in bridge.plan()
        for name, shape in zip(mapping.hf_names, mapping.hf_shapes(bridge.dims(1)))
    }
    save_file(tensors, str(out / "model.safetensors"))
    return out


class _LiveStorages:
    """Weak references to the storages of tensors seen so far."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self.seen = 0
        self.most_alive = 0

    def add(self, tensor: torch.Tensor) -> None:
        """Track ``tensor``, then record how many tracked storages (it included) are alive."""
        self._refs.append(weakref.ref(tensor.untyped_storage()))
        self.seen += 1
        self.most_alive = max(self.most_alive, sum(ref() is not None for ref in self._refs))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[int, tuple[Path, _LiveStorages]]:
    """layers -> (dist checkpoint, the chunks its writer made), for 2 and 4 layers."""
    root = tmp_path_factory.mktemp("moe_memory")
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        for layers in (2, 4):
            live = _LiveStorages()
            make = writer_module.chunk_data

            def tracked(*args, live=live, make=make):
                chunk = make(*args)
                live.add(chunk)
                return chunk

            patch.setattr(writer_module, "chunk_data", tracked)
            ckpt = root / f"mcore_{layers}"
            writer_module.convert_hf_to_dist_checkpoint(
                _random_moe_checkpoint(root / f"hf_{layers}", layers), ckpt, sync_files=False
            )
            patch.setattr(writer_module, "chunk_data", make)
            out[layers] = ckpt, live
    return out


def test_the_writer_holds_no_chunk_it_has_written(converted):
    (_, small), (_, large) = converted[2], converted[4]
    # Two more layers: at least their experts' gate, up and down chunks more.
    assert large.seen - small.seen >= 2 * MOE_CONFIG["num_experts"] * 3
    # While a chunk is made, every chunk written before it has been freed (torch's own
    # FileSystemWriter kept each key's last one: with a key per layer, 2x the chunks).
    assert small.most_alive == large.most_alive == 1


def test_the_reader_holds_one_tensor_group_at_a_time(converted):
    alive = {}
    for layers, (ckpt, _) in converted.items():
        live = _LiveStorages()
        for _, tensor in checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt)):
            live.add(tensor)
            del tensor
        alive[layers] = live.most_alive
    # At most the HF tensors of one Megatron tensor (q, k and v of one fused QKV).
    assert alive[2] == alive[4] <= 3
