"""The ``megatron-bridge`` CLI end to end: convert both ways, verify, info, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.cli import main
from nemo_rl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory) -> Path:
    return build_tiny_model("llama", cache_dir=tmp_path_factory.mktemp("cli_tiny"))


@pytest.fixture(scope="module")
def converted(hf_src, tmp_path_factory):
    """HF -> Megatron at TP=2, then Megatron -> HF at PP=2 in ~100 KB shards."""
    root = tmp_path_factory.mktemp("cli_convert")
    mg, hf = root / "megatron", root / "hf"
    assert main(["convert", "--from", "hf", "--to", "megatron", "--tp", "2", str(hf_src), str(mg)]) == 0
    assert main(["convert", "--from", "megatron", "--to", "hf", "--pp", "2",
                 "--max-shard-gb", str(100_000 / 1024**3), str(mg), str(hf)]) == 0
    return mg, hf


def _load_sharded(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(path / file)))
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


@pytest.mark.slow
def test_roundtrip_is_bitwise_with_same_config_and_tokenizer(hf_src, converted):
    _, hf = converted
    original = load_file(str(hf_src / "model.safetensors"))
    roundtrip = _load_sharded(hf)
    assert len(list(hf.glob("model-*.safetensors"))) > 1
    assert sorted(roundtrip) == sorted(original)
    assert all(torch.equal(roundtrip[k], original[k]) for k in original)
    assert json.loads((hf / "config.json").read_text()) == json.loads(
        (hf_src / "config.json").read_text()
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf / name).read_bytes() == (hf_src / name).read_bytes()
    assert not list(hf.parent.glob(".*partial*"))


@pytest.mark.slow
def test_verify_reports_small_logit_differences(hf_src, converted, capsys):
    mg, _ = converted
    assert main(["verify", str(hf_src), str(mg), "--pp", "2", "--atol", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert out.count("max abs diff") == 4 and "OK" in out


@pytest.mark.slow
def test_info_describes_both_formats(converted, capsys):
    mg, hf = converted
    assert main(["info", "--json", str(hf)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "hf" and info["tensors"] == 21 and info["parameters"] == 557696
    assert main(["info", "--json", str(mg)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "megatron" and info["dtype"] == "float32"
    assert info["valid_tp"] == [1, 2]


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "tp, message",
    [("3", "num_attention_heads"), ("4", "num_key_value_heads")],
)
def test_tp_that_does_not_fit_the_heads_is_refused(hf_src, tmp_path, capsys, tp, message):
    err = _error(["convert", "--from", "hf", "--to", "megatron", "--tp", tp,
                  str(hf_src), str(tmp_path / "out")], capsys)
    assert message in err and not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(hf_src, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    err = _error(["convert", "--from", "hf", "--to", "megatron", str(hf_src),
                  str(tmp_path / "out")], capsys)
    assert "--overwrite" in err


def test_missing_and_corrupt_shards_are_refused(hf_src, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(hf_src, broken)
    # Corrupt: the header claims more bytes than the truncated file holds.
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    err = _error(["convert", "--from", "hf", "--to", "megatron", str(broken),
                  str(tmp_path / "o1")], capsys)
    assert "corrupt" in err
    # Missing: an index naming a shard that is not there.
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    err = _error(["convert", "--from", "hf", "--to", "megatron", str(broken),
                  str(tmp_path / "o2")], capsys)
    assert "missing shard" in err and "model-00001-of-00002.safetensors" in err


@pytest.mark.slow
def test_dtype_mismatch_and_wrong_source_kind_are_refused(hf_src, converted, capsys):
    mg, _ = converted
    err = _error(["verify", str(hf_src), str(mg), "--dtype", "bfloat16"], capsys)
    assert "dtype mismatch" in err and "float32" in err
    err = _error(["convert", "--from", "hf", "--to", "megatron", str(mg), str(mg) + "x"], capsys)
    assert "megatron checkpoint" in err
    err = _error(["convert", "--from", "hf", "--to", "megatron", "--dtype", "int8",
                  str(hf_src), str(mg) + "y"], capsys)
    assert "--dtype" in err


def test_hub_model_names_are_resolved_through_the_hub_cache(hub_tiny_llama, tmp_path, capsys):
    name, snapshot = hub_tiny_llama
    assert main(["info", "--json", name]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(snapshot) and info["format"] == "hf"
    mg, hf = tmp_path / "megatron", tmp_path / "hf"
    assert main(["convert", "--from", "hf", "--to", "megatron", name, str(mg)]) == 0
    assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(hf)]) == 0
    original = load_file(str(snapshot / "model.safetensors"))
    roundtrip = load_file(str(hf / "model.safetensors"))
    assert sorted(roundtrip) == sorted(original)
    assert all(torch.equal(roundtrip[k], original[k]) for k in original)
    # Offline, an unknown name fails at once, naming the way out.
    err = _error(["info", "nemo-rl-test/not-a-model"], capsys)
    assert "could not provide it" in err and "HF_HUB_OFFLINE=1" in err
