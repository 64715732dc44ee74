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
def test_streamed_roundtrip_is_bitwise_for_every_family(family_checkpoints, tmp_path, tp, pp):
    for name, path in family_checkpoints.items():
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
