"""Streamed conversion in one process: header-first safetensors shards, HF -> dist checkpoint
at any TP/PP -> HF without building a model, and the errors on inconsistent input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.checkpoint import checkpoint_bridge
from megatron_bridge.dist_ckpt_reader import checkpoint_hf_weights
from megatron_bridge.dist_ckpt_writer import convert_hf_to_dist_checkpoint
from megatron_bridge.safetensors_stream import SafetensorsStreamWriter


def test_stream_writer_writes_the_header_first_and_checks_each_tensor(tmp_path):
    a, b = torch.arange(6, dtype=torch.bfloat16).view(2, 3), torch.ones(4)
    specs = [("a", a.dtype, (2, 3)), ("b", b.dtype, (4,))]
    writer = SafetensorsStreamWriter(tmp_path / "x.safetensors", specs, {"format": "pt"})
    writer.add("a", a)
    writer.add("b", b)
    writer.close()
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)

    writer = SafetensorsStreamWriter(tmp_path / "y.safetensors", specs)
    with pytest.raises(ValueError, match="header lists 'a'"):
        writer.add("a", a.float())
    with pytest.raises(ValueError, match="1 of the 2 tensors"):
        writer.add("a", a)
        writer.close()


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_streamed_roundtrip_is_bitwise_for_every_family(
    family_checkpoints, moe_checkpoints, tmp_path, tp, pp
):
    for name, path in {**family_checkpoints, **moe_checkpoints}.items():
        ckpt = tmp_path / name
        convert_hf_to_dist_checkpoint(path, ckpt, tp=tp, pp=pp, sync_files=False)
        assert json.loads((ckpt / "bridge.json").read_text())["dtype"] == "float32"
        exported = list(checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt), torch.bfloat16))
        original = load_file(str(path / "model.safetensors"))
        assert sorted(n for n, _ in exported) == sorted(original), name
        for key, tensor in exported:
            assert torch.equal(tensor, original[key].bfloat16()), f"{name}: {key}"


def test_hf_tensor_that_disagrees_with_the_config_is_refused(family_checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(family_checkpoints["llama"], src)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] //= 2  # the gate/up/down weights no longer fit
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mlp.down_proj.weight has shape"):
        convert_hf_to_dist_checkpoint(src, tmp_path / "out", sync_files=False)


def test_an_error_while_writing_is_raised_as_itself(family_checkpoints, tmp_path, monkeypatch):
    # DCP wraps errors raised while it writes; the caller (the CLI) sees the original one.
    def fail(*args):
        raise ValueError("unreadable tensor")

    monkeypatch.setattr("megatron_bridge.dist_ckpt_writer.chunk_data", fail)
    with pytest.raises(ValueError, match="unreadable tensor"):
        convert_hf_to_dist_checkpoint(family_checkpoints["llama"], tmp_path / "o", sync_files=False)


def test_checkpoint_whose_config_disagrees_with_its_tensors_is_refused(
    family_checkpoints, tmp_path
):
    ckpt = tmp_path / "ckpt"
    convert_hf_to_dist_checkpoint(family_checkpoints["llama"], ckpt, sync_files=False)
    meta = json.loads((ckpt / "bridge.json").read_text())
    meta["padded_vocab_size"] += 128
    (ckpt / "bridge.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="embedding.word_embeddings.weight has shape"):
        list(checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt)))


def _variant(src, dst, config_changes: dict | None = None, tensors=None):
    """A copy of checkpoint ``src`` in ``dst`` with config fields changed (None deletes one)
    and its tensors replaced by ``tensors(original) -> dict`` (tokenizer files kept)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    config = {**json.loads((dst / "config.json").read_text()), **(config_changes or {})}
    config = {key: value for key, value in config.items() if value is not None}
    (dst / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        original = load_file(str(src / "model.safetensors"))
        save_file(tensors(original), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "variant, config_changes, dropped, option",
    [
        ("llama_attention_bias", {"attention_bias": False}, "self_attn.q_proj.bias",
         "attention_bias=False in config.json"),
        ("llama_all_bias", {"mlp_bias": False}, "mlp.gate_proj.bias",
         "mlp_bias=False in config.json"),
        # Qwen2's o_proj has no bias whatever the config: a checkpoint with one is another model.
        ("llama_attention_bias", {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                  "attention_bias": None, "mlp_bias": None},
         "self_attn.o_proj.bias", "which Qwen2ForCausalLM models do not have"),
    ],
)
def test_tensors_the_config_does_not_explain_are_refused(
    family_checkpoints, tmp_path, variant, config_changes, dropped, option
):
    src = _variant(family_checkpoints[variant], tmp_path / "src", config_changes)
    with pytest.raises(ValueError, match="the conversion would drop") as err:
        convert_hf_to_dist_checkpoint(src, tmp_path / "out", sync_files=False)
    assert dropped in str(err.value) and option in str(err.value)
    assert not (tmp_path / "out" / ".metadata").exists()


def test_tensors_the_config_implies_must_be_there(family_checkpoints, tmp_path):
    src = _variant(family_checkpoints["llama"], tmp_path / "src", {"attention_bias": True})
    with pytest.raises(ValueError, match="lacks tensors") as err:
        convert_hf_to_dist_checkpoint(src, tmp_path / "out", sync_files=False)
    assert "model.layers.0.self_attn.q_proj.bias" in str(err.value)
    assert "attention_bias=True in config.json" in str(err.value)


def test_a_tied_head_must_equal_the_embedding(family_checkpoints, tmp_path):
    tied = family_checkpoints["llama_tied_linear_rope"]

    def with_head(scale: float):
        def tensors(original):
            head = original["model.embed_tokens.weight"] * scale
            return {**original, "lm_head.weight": head}
        return tensors

    same = _variant(tied, tmp_path / "same", tensors=with_head(1.0))
    ckpt = tmp_path / "ckpt"
    convert_hf_to_dist_checkpoint(same, ckpt, sync_files=False)
    exported = dict(checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt)))
    assert "lm_head.weight" not in exported
    other = _variant(tied, tmp_path / "other", tensors=with_head(2.0))
    with pytest.raises(ValueError, match="set tie_word_embeddings to false"):
        convert_hf_to_dist_checkpoint(other, tmp_path / "out", sync_files=False)


def test_old_rotary_buffers_are_accounted_for(family_checkpoints, tmp_path):
    # transformers < 4.31 saved each layer's rotary inv_freq; Megatron derives it.
    def tensors(original):
        return {**original, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}

    src = _variant(family_checkpoints["llama"], tmp_path / "src", tensors=tensors)
    convert_hf_to_dist_checkpoint(src, tmp_path / "out", sync_files=False)
    assert (tmp_path / "out" / ".metadata").is_file()


def test_the_policy_load_refuses_left_over_tensors_too(family_checkpoints, tmp_path):
    # The policy worker loads HF checkpoints with load_hf_weights: same check as convert.
    from megatron_bridge import load_hf_into_megatron
    from megatron_bridge.parallel_state import (
        destroy_megatron_parallel,
        find_free_port,
        initialize_megatron_parallel,
    )

    src = _variant(family_checkpoints["llama_all_bias"], tmp_path / "src", {"mlp_bias": False})
    initialize_megatron_parallel(0, 1, tp=1, pp=1, master_port=find_free_port())
    try:
        with pytest.raises(ValueError, match="mlp_bias=False in config.json"):
            load_hf_into_megatron(src)
    finally:
        destroy_megatron_parallel()


def test_a_megatron_checkpoint_with_tensors_its_config_lacks_is_not_exported(
    family_checkpoints, tmp_path
):
    ckpt = tmp_path / "ckpt"
    convert_hf_to_dist_checkpoint(family_checkpoints["llama_mlp_bias"], ckpt, sync_files=False)
    meta = json.loads((ckpt / "bridge.json").read_text())
    meta["hf_config"]["mlp_bias"] = False
    (ckpt / "bridge.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="export would drop them") as err:
        list(checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt)))
    assert "decoder.layers.mlp.linear_fc1.bias" in str(err.value)
