"""Layout transforms, family registry and config validation (single process, no torch.distributed)."""

from __future__ import annotations

import json

import pytest
import torch

from fresh_process import last_line_printed
from mb_fixtures import tiny_bridge
from megatron_bridge.config import BridgeConfig
from megatron_bridge.families import FAMILIES, get_family
from megatron_bridge.transforms import (
    gate_up_shard,
    gate_up_unshard,
    padded_vocab_size,
    qkv_shard,
    qkv_unshard,
    split_unshard,
    vocab_shard,
    vocab_unshard,
)


class DictReader:
    """In-memory TensorReader over a dict of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, name, dim=None, start=0, stop=None):
        t = self.tensors[name]
        if dim is None:
            return t
        return t[start:stop] if dim == 0 else t[:, start:stop]

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype


def _heads(n: int, head_dim: int, base: float, hidden: int = 3) -> torch.Tensor:
    """``[n*head_dim, hidden]`` whose rows of head i are all ``base + i``."""
    return torch.cat([torch.full((head_dim, hidden), base + i) for i in range(n)])


def test_qkv_interleaves_query_groups_per_kv_head():
    # 4 query heads share 2 KV heads: Megatron's rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    reader = DictReader({"q": _heads(4, 2, 0.0), "k": _heads(2, 2, 10.0), "v": _heads(2, 2, 20.0)})
    full = qkv_shard(reader, ("q", "k", "v"), 4, 2, 2, tp_rank=0, tp_size=1)
    assert full[::2, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    rank1 = qkv_shard(reader, ("q", "k", "v"), 4, 2, 2, tp_rank=1, tp_size=2)
    assert rank1[::2, 0].tolist() == [2, 3, 11, 21]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_roundtrip_weights_and_biases(tp):
    gen = torch.Generator().manual_seed(0)
    nq, nkv, d = 8, 4, 3
    for tail in ((5,), ()):
        q, k, v = (torch.randn(n * d, *tail, generator=gen) for n in (nq, nkv, nkv))
        reader = DictReader({"q": q, "k": k, "v": v})
        shards = [qkv_shard(reader, ("q", "k", "v"), nq, nkv, d, r, tp) for r in range(tp)]
        assert all(s.shape[0] == (nq + 2 * nkv) * d // tp for s in shards)
        back = qkv_unshard(shards, nq, nkv, d)
        assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_gate_up_each_rank_holds_its_gate_then_up_rows():
    gate = torch.arange(8.0).unsqueeze(1)
    up = 100 + torch.arange(8.0).unsqueeze(1)
    reader = DictReader({"g": gate, "u": up})
    rank1 = gate_up_shard(reader, ("g", "u"), 8, tp_rank=1, tp_size=2)
    assert rank1[:, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]
    shards = [gate_up_shard(reader, ("g", "u"), 8, r, 2) for r in range(2)]
    g2, u2 = gate_up_unshard(shards)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_vocab_padding_rows_are_zero_and_never_exported():
    assert padded_vocab_size(1000, 128, 1) == 1024
    assert padded_vocab_size(1000, 128, 2) == 1024
    assert padded_vocab_size(1025, 128, 2) == 1280
    emb = torch.randn(1000, 4, generator=torch.Generator().manual_seed(1))
    reader = DictReader({"e": emb})
    shards = [vocab_shard(reader, "e", 1000, 1280, r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [640, 640]
    assert torch.equal(shards[1][1000 - 640 :], torch.zeros(280, 4))
    (back,) = vocab_unshard(shards, 1000)
    assert torch.equal(back, emb)


def test_unknown_architecture_lists_supported_ones():
    with pytest.raises(ValueError, match="supported") as err:
        get_family("GPT2LMHeadModel")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in str(err.value) and arch in FAMILIES


def _config(**overrides) -> BridgeConfig:
    return tiny_bridge(**{"tie_word_embeddings": False, **overrides})


def test_plan_covers_every_hf_tensor_once():
    plan = _config().plan()
    names = [n for m in plan for n in m.hf_names]
    assert len(names) == len(set(names)) == 3 + 2 * 9
    tied = _config(tie_word_embeddings=True).plan()
    assert "lm_head.weight" not in {n for m in tied for n in m.hf_names}


@pytest.mark.parametrize(
    "overrides, tp, pp, field",
    [
        ({}, 3, 1, "num_attention_heads"),
        ({"num_attention_heads": 8}, 4, 1, "num_key_value_heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 192}, 2, 1, "num_key_value_heads"),
        ({}, 1, 3, "num_hidden_layers"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, 1, 1, "rope_type"),
    ],
)
def test_parallel_sizes_are_validated_before_building(overrides, tp, pp, field):
    with pytest.raises(ValueError, match=field):
        _config(**overrides).validate_parallelism(tp, pp)


def test_cpu_compat_redirects_cuda_and_is_idempotent():
    # A subprocess, so the patches never leak into this test session.
    code = (
        "import json, torch\n"
        "from megatron_bridge.cpu_compat import apply_cpu_compat\n"
        "first, second = apply_cpu_compat(), apply_cpu_compat()\n"
        "t = torch.zeros(2, device='cuda', pin_memory=True).pin_memory()\n"
        "torch.cuda.manual_seed(3); a = torch.cuda.get_rng_state()\n"
        "torch.manual_seed(3); b = torch.get_rng_state()\n"
        "print(json.dumps([first, second, str(t.device), str(torch.ones(1).cuda().device),\n"
        "  str(torch.cuda.current_device()), bool(torch.equal(a, b)), torch.cuda.is_available()]))\n"
    )
    assert json.loads(last_line_printed(code)) == [
        True, True, "cpu", "cpu", "cpu", True, False
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the deferral is a CPU accommodation")
def test_the_policy_workers_import_defers_megatron_cores_compiles():
    # A policy worker first imports megatron-core with its model set-up: megatron-core's
    # import-time torch.compile decorators must stay deferred there (inductor never imported).
    code = (
        "import sys\n"
        "import nemo_rl.models.policy.workers.megatron.model_setup\n"
        "import megatron_bridge.grouped_experts\n"
        "print(sorted(m for m in ('torch._inductor.compile_fx', 'megatron.core.fusions."
        "fused_bias_geglu') if m in sys.modules))\n"
    )
    assert last_line_printed(code) == "['megatron.core.fusions.fused_bias_geglu']"


def test_tp1_unshard_views_the_shard_except_qkv():
    # At TP=1 the export hands the parameter's own memory on (no copy) wherever the HF
    # tensor is a contiguous piece of it; q/k/v are copied once out of the interleave.
    gen = torch.Generator().manual_seed(2)
    shard = torch.randn(24, 5, generator=gen)
    base = shard.untyped_storage().data_ptr()

    def shares(t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.untyped_storage().data_ptr() == base

    assert all(shares(t) for t in gate_up_unshard([shard]))
    assert all(shares(t) for t in vocab_unshard([shard], 20))
    assert all(shares(t) for t in split_unshard([shard], 0) + split_unshard([shard], 1))
    q, k, v = qkv_unshard([shard], 4, 2, 3)  # 2 groups of [q q k v] heads of 3 rows
    assert not any(t.untyped_storage().data_ptr() == base for t in (q, k, v))
    assert all(t.is_contiguous() for t in (q, k, v))
    assert torch.equal(k, torch.cat([shard[6:9], shard[18:21]]))
