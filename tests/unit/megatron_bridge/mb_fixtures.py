"""Tiny HF checkpoints of every supported family and option, built locally (no downloads).

Llama and Qwen2 come from ``nemo_rl.models.tiny``; the others are built here from transformers
configs with a fixed seed and ``save_pretrained``, one per option the conversion implements:
Qwen3 (QK-norm), Mistral (sliding window of 5 tokens), Llama with llama3-scaled RoPE, Llama
with attention biases, with MLP biases, with both, tied embeddings with linear RoPE, Qwen2 with
a sliding window on its upper layer only (``max_window_layers``), Qwen3 with attention biases
and a window on every layer. Their norms and biases are drawn away from 1 and 0 (transformers
initialises them to exactly that), so a dropped bias or a swapped norm changes the logits.
Every window is shorter than the test sequences.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nemo_rl.models.tiny import build_tiny_model
from random_checkpoints import perturb_norms_and_biases

if TYPE_CHECKING:
    from megatron_bridge import BridgeConfig

SIZES = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
# Test token sequences are this long; every window below is shorter so it matters.
SEQ_LEN = 20
MISTRAL_WINDOW = 5
VOCAB = dict(vocab_size=1000, eos_token_id=2, pad_token_id=0, bos_token_id=None)


def tiny_bridge(
    architecture: str = "LlamaForCausalLM", drop: tuple[str, ...] = (), **fields
) -> BridgeConfig:
    """A :class:`BridgeConfig` of a tiny model of ``architecture`` (sizes only, no
    checkpoint), with ``fields`` added to or replacing its config.json fields and the fields
    ``drop`` left out."""
    from megatron_bridge import BridgeConfig

    sizes = {k: v for k, v in SIZES.items() if k not in ("max_position_embeddings", "rms_norm_eps")}
    config = {"architectures": [architecture], **sizes, "vocab_size": 1000, **fields}
    return BridgeConfig({k: v for k, v in config.items() if k not in drop})


def _variants() -> dict:
    """name -> transformers config of each checkpoint built here."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return {
        "qwen3": Qwen3Config(**SIZES, **VOCAB, tie_word_embeddings=True, attention_bias=False),
        "mistral": MistralConfig(
            **SIZES, **VOCAB, tie_word_embeddings=False, sliding_window=MISTRAL_WINDOW
        ),
        "llama3rope": LlamaConfig(**SIZES, **VOCAB, rope_parameters=llama3_rope),
        "llama_attention_bias": LlamaConfig(**SIZES, **VOCAB, attention_bias=True),
        "llama_mlp_bias": LlamaConfig(**SIZES, **VOCAB, mlp_bias=True),
        "llama_all_bias": LlamaConfig(**SIZES, **VOCAB, attention_bias=True, mlp_bias=True),
        "llama_tied_linear_rope": LlamaConfig(
            **SIZES, **VOCAB, tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
        # Layer 0 full attention, layer 1 a 6-token window.
        "qwen2_window": Qwen2Config(
            **SIZES, **VOCAB, use_sliding_window=True, sliding_window=6, max_window_layers=1
        ),
        "qwen3_bias_window": Qwen3Config(
            **SIZES, **VOCAB, attention_bias=True, use_sliding_window=True, sliding_window=7,
            max_window_layers=0,
        ),
    }


def _save(
    config, out_dir: Path, tokenizer_src: Path | None, router_scale: float = 1.0
) -> Path:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4321)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):  # MoE routers
                param.mul_(router_scale)
    model.save_pretrained(out_dir)
    if tokenizer_src is None:
        return out_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_src / name).is_file():
            shutil.copy2(tokenizer_src / name, out_dir / name)
    return out_dir


def build_family_checkpoints(root: Path) -> dict[str, Path]:
    """name -> HF checkpoint folder: llama, qwen2 and every variant of :func:`_variants`."""
    llama = build_tiny_model("llama", cache_dir=root / "tiny")
    qwen2 = build_tiny_model("qwen2", cache_dir=root / "tiny")
    paths = {"llama": llama, "qwen2": qwen2}
    for name, config in _variants().items():
        out = root / name
        if not (out / "config.json").is_file():
            out.mkdir(parents=True, exist_ok=True)
            _save(config, out, llama)
        paths[name] = out
    return paths


# Mixture-of-experts models: sizes unlike the dense ones above, 4 layers (a dense one between
# sparse ones, and 2 per stage at PP=2), 4 (Qwen3-MoE) or 8 (Mixtral) experts, top-2 routing.
MOE_SIZES = dict(
    hidden_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    num_experts_per_tok=2,
)
MOE_VOCAB = dict(vocab_size=500, eos_token_id=2, pad_token_id=0, bos_token_id=None)
# Router weights are drawn this much larger than transformers' init, so the top-2 experts of
# every token are chosen by a wide margin: a near tie would let a 1e-7 rounding difference
# pick another expert.
ROUTER_SCALE = 20.0


def _moe_variants() -> dict:
    """name -> transformers config of each mixture-of-experts checkpoint."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    return {
        # Layer 1 dense (mlp_only_layers, intermediate_size 160), top-2 weights not
        # renormalised; the tied embeddings cover the head's other path.
        "qwen3_moe": Qwen3MoeConfig(
            **MOE_SIZES, **MOE_VOCAB, num_experts=4, moe_intermediate_size=48,
            intermediate_size=160, mlp_only_layers=[1], norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
        # Every layer sparse, 8 experts of 40, top-2 renormalised, a 6-token window.
        "mixtral": MixtralConfig(
            **MOE_SIZES, **MOE_VOCAB, num_local_experts=8, intermediate_size=40,
            sliding_window=6, tie_word_embeddings=False,
        ),
    }


def build_moe_checkpoints(root: Path) -> dict[str, Path]:
    """name -> HF checkpoint folder of each mixture-of-experts model of :func:`_moe_variants`
    (built once per ``root``), router weights scaled by :data:`ROUTER_SCALE`; no tokenizer
    (the tiny models' tokenizer has more ids than these vocabularies)."""
    paths = {}
    for name, config in _moe_variants().items():
        out = root / name
        if not (out / "config.json").is_file():
            out.mkdir(parents=True, exist_ok=True)
            _save(config, out, None, router_scale=ROUTER_SCALE)
        paths[name] = out
    return paths


def hf_reference_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits ``[batch, seq, vocab]`` for ``input_ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def sample_input_ids(vocab_size: int, batch: int = 2) -> torch.Tensor:
    """Fixed random token ids ``[batch, SEQ_LEN]``."""
    return torch.randint(0, vocab_size, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(0))


def checkpoint_contents(path: Path) -> tuple[dict, dict]:
    """What a ``torch_dist`` checkpoint folder holds, read independently of megatron_bridge.

    Returns:
        ``({key: (global shape, dtype, sorted chunk (offsets, sizes))} or "bytes" for
        objects, {(key, chunk offsets): stored tensor or unpickled object})``.
    """
    import io

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    layout = {
        key: (tuple(md.size), md.properties.dtype,
              sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        if hasattr(md, "chunks") else "bytes"
        for key, md in metadata.state_dict_metadata.items()
    }
    files = {}
    data = {}
    for index, info in metadata.storage_data.items():
        if info.relative_path not in files:
            files[info.relative_path] = (path / info.relative_path).read_bytes()
        raw = files[info.relative_path][info.offset : info.offset + info.length]
        offset = None if index.offset is None else tuple(index.offset)
        data[(index.fqn, offset)] = torch.load(io.BytesIO(raw), weights_only=True)
    return layout, data


def assert_same_checkpoint(mine: Path, built: Path, label: str) -> None:
    """``mine`` holds the same tensors (keys, shapes, dtypes, chunks, bytes) and objects as
    ``built``, and the same megatron-core ``metadata.json``."""
    built_md, built_data = checkpoint_contents(built)
    my_md, my_data = checkpoint_contents(mine)
    assert my_md == built_md, label
    assert sorted(my_data, key=str) == sorted(built_data, key=str), label
    for index, value in built_data.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(my_data[index], value), f"{label}: {index}"
        else:
            assert my_data[index] == value, f"{label}: {index}"
    assert (mine / "metadata.json").read_text() == (built / "metadata.json").read_text()


def main_replica_layout(model: torch.nn.Module) -> list[tuple]:
    """What this rank writes to a dist checkpoint, per megatron-core: tensor chunks as
    ``("T", key, global shape, offset, chunk shape)`` and objects as ``("O", unique key)``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        apply_factories,
        is_main_replica,
    )

    state = model.sharded_state_dict()
    apply_factories(state)
    return sorted(
        ("T", v.key, tuple(v.global_shape), tuple(v.global_offset),
         (1,) * v.prepend_axis_num + tuple(v.local_shape))
        if isinstance(v, ShardedTensor) else ("O", v.unique_key)
        for v in nested_values(state)
        if is_main_replica(v.replica_id)
    )


def expected_rank_layout(
    bridge: "BridgeConfig", tp: int, pp: int, rank: int, ep: int = 1
) -> list[tuple]:
    """:func:`~megatron_bridge.dist_ckpt_layout.rank_layout` of global rank ``rank`` of a
    ``tp * ep * pp`` world (megatron's rank order: TP fastest, then EP, then PP), in
    :func:`main_replica_layout`'s form."""
    from megatron_bridge.dist_ckpt_layout import TensorChunk, rank_layout

    tp_rank, ep_rank, pp_rank = rank % tp, rank // tp % ep, rank // (tp * ep)
    return sorted(
        ("T", e.key, e.global_shape, e.offset, e.shape) if isinstance(e, TensorChunk)
        else ("O", e.unique_key)
        for e in rank_layout(bridge, tp, pp, tp_rank, pp_rank, ep, ep_rank)
    )
