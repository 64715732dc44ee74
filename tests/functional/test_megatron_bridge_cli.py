"""The ``megatron-bridge`` CLI end to end: convert both ways, verify, info, and bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.cli import main
from nemo_rl.models.tiny import build_tiny_model

from file_modes import modes_against_umask


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory) -> Path:
    return build_tiny_model("llama", cache_dir=tmp_path_factory.mktemp("cli_tiny"))


def _convert_both_ways(hf_src: Path, root: Path, layout: list[str]) -> tuple[Path, Path]:
    """HF -> Megatron at ``layout`` (CLI flags), then Megatron -> HF in ~100 KB shards."""
    mg, hf = root / "megatron", root / "hf"
    assert main(["convert", "--from", "hf", "--to", "megatron", *layout, str(hf_src), str(mg)]) == 0
    assert main(["convert", "--from", "megatron", "--to", "hf",
                 "--max-shard-gb", str(100_000 / 1024**3), str(mg), str(hf)]) == 0
    return mg, hf


@pytest.fixture(scope="module")
def converted(hf_src, tmp_path_factory):
    return _convert_both_ways(hf_src, tmp_path_factory.mktemp("cli_convert"), ["--tp", "2"])


def test_outputs_follow_the_umask(hf_src, tmp_path):
    """Both conversions' folders and files get the modes the user's umask gives (not
    mkdtemp's private 0700, not the source files' own modes): 0750 / 0640 under umask 027."""
    source = tmp_path / "source"
    shutil.copytree(hf_src, source)
    (source / "tokenizer.json").chmod(0o600)  # a private cache's file is copied as the umask says
    previous = os.umask(0o027)
    try:
        mg, hf = tmp_path / "out" / "megatron", tmp_path / "out" / "hf"
        assert main(["convert", "--from", "hf", "--to", "megatron", str(source), str(mg)]) == 0
        assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(hf)]) == 0
    finally:
        os.umask(previous)
    assert modes_against_umask(mg, 0o027) == [] and modes_against_umask(hf, 0o027) == []


def _load_sharded(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(path / file)))
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


def _assert_bitwise_roundtrip(hf_src: Path, hf: Path) -> None:
    """``hf`` holds ``hf_src``'s tensors bit for bit in several shards, its config and its
    tokenizer files, and no partial output is left."""
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
def test_roundtrip_is_bitwise_with_same_config_and_tokenizer(hf_src, converted):
    _assert_bitwise_roundtrip(hf_src, converted[1])


def test_moe_roundtrip_at_ep2_is_streamed_and_bitwise(tmp_path_factory):
    # Streamed both ways in the command's process (no model built): the checkpoint written
    # for EP=2 holds every expert as its own chunk, and the export reads them back.
    root = tmp_path_factory.mktemp("cli_moe")
    hf_src = build_tiny_model("qwen3_moe", cache_dir=root / "tiny")
    mg, hf = _convert_both_ways(hf_src, root, ["--ep", "2"])
    _assert_bitwise_roundtrip(hf_src, hf)
    assert main(["info", "--json", str(mg)]) == 0


@pytest.mark.slow
def test_verify_reports_small_logit_differences(hf_src, converted, capsys):
    mg, _ = converted
    assert main(["verify", str(hf_src), str(mg), "--pp", "2", "--atol", "1e-5"]) == 0
    out = capsys.readouterr().out
    # 3 default prompts, the random long sequence, the highest ids, and the verdict.
    assert out.count("max abs diff") == 6 and "OK" in out
    assert "random ids" in out and "highest ids" in out


@pytest.mark.slow
def test_info_describes_both_formats(converted, capsys):
    mg, hf = converted
    assert main(["info", "--json", str(hf)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "hf" and info["tensors"] == 21 and info["parameters"] == 557696
    assert main(["info", "--json", str(mg)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "megatron" and info["dtype"] == "float32"
    assert info["valid_tp"] == [1, 2] and info["features"] == {}


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_expert_parallelism_of_a_dense_model_is_refused(hf_src, tmp_path, capsys):
    err = _error(["convert", "--from", "hf", "--to", "megatron", "--ep", "2",
                  str(hf_src), str(tmp_path / "out")], capsys)
    assert "--ep 2: expert parallelism needs a mixture-of-experts model" in err
    assert not (tmp_path / "out").exists()


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


def _copy_with(src: Path, dst: Path, scale_norm: float | None = None, drop=()) -> Path:
    """A copy of HF checkpoint ``src`` without the files ``drop``, its final norm weight
    scaled by ``scale_norm`` (a different model with the same config)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink(missing_ok=True)
    if scale_norm is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * scale_norm
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_verify_exit_codes_mismatch_1_bad_input_2(hf_src, tmp_path, capsys):
    other = _copy_with(hf_src, tmp_path / "other", scale_norm=1.5)
    mg = tmp_path / "mg"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(other), str(mg)]) == 0
    assert main(["verify", str(hf_src), str(mg)]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    # A truncated shard of the Megatron checkpoint: one line, exit 2, before any model loads.
    shard = next(mg.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    err = _error(["verify", str(hf_src), str(mg)], capsys)
    assert "is truncated" in err and shard.name in err and len(err.strip().splitlines()) == 1
    err = _error(["convert", "--from", "megatron", "--to", "hf", str(mg), str(tmp_path / "o")],
                 capsys)
    assert "is truncated" in err


@pytest.mark.slow
def test_verify_works_without_a_tokenizer(hf_src, tmp_path, capsys):
    bare = _copy_with(hf_src, tmp_path / "bare",
                      drop=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
    assert main(["verify", str(bare), "--atol", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "no tokenizer" in out and out.count("max abs diff") == 3


@pytest.mark.slow
def test_verify_compares_past_the_sliding_window(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=500, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=100, max_window_layers=1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "qwen2")
    assert main(["verify", str(tmp_path / "qwen2"), "--tp", "2", "--atol", "1e-5"]) == 0
    out = capsys.readouterr().out
    # The random sequence outruns the 100-token window: 100 + 16 tokens.
    assert "  116 tokens" in out and "OK" in out
    assert main(["info", "--json", str(tmp_path / "qwen2")]) == 0
    features = json.loads(capsys.readouterr().out)["features"]
    assert features == {"qkv_bias": True, "window": 100, "window_layers": [False, True]}


def test_dtype_labels_are_honest_and_a_bf16_roundtrip_is_bitwise(hf_src, tmp_path, capsys):
    from safetensors.torch import save_file

    bf16 = _copy_with(hf_src, tmp_path / "bf16")
    tensors = {k: v.bfloat16() for k, v in load_file(str(bf16 / "model.safetensors")).items()}
    save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    # Default: a float32 Megatron checkpoint, and back to the source's bfloat16, bit for bit.
    assert main(["convert", "--from", "hf", "--to", "megatron", str(bf16), str(tmp_path / "m")]) == 0
    assert main(["convert", "--from", "megatron", "--to", "hf", str(tmp_path / "m"),
                 str(tmp_path / "back")]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert all(torch.equal(back[k], tensors[k]) and back[k].dtype == torch.bfloat16
               for k in tensors)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    # --dtype bfloat16 on a float32 source: the export restores float32 and says so.
    assert main(["convert", "--from", "hf", "--to", "megatron", "--dtype", "bfloat16",
                 str(hf_src), str(tmp_path / "m16")]) == 0
    assert main(["convert", "--from", "megatron", "--to", "hf", str(tmp_path / "m16"),
                 str(tmp_path / "f32")]) == 0
    f32 = load_file(str(tmp_path / "f32" / "model.safetensors"))
    assert {t.dtype for t in f32.values()} == {torch.float32}
    assert json.loads((tmp_path / "f32" / "config.json").read_text())["dtype"] == "float32"
    assert main(["convert", "--from", "megatron", "--to", "hf", "--dtype", "bf16",
                 str(tmp_path / "m16"), str(tmp_path / "b16")]) == 0
    b16 = load_file(str(tmp_path / "b16" / "model.safetensors"))
    assert {t.dtype for t in b16.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "b16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_unsupported_config_and_layout_flags_on_export_are_refused(hf_src, tmp_path, capsys):
    gelu = _copy_with(hf_src, tmp_path / "gelu")
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    err = _error(["convert", "--from", "hf", "--to", "megatron", str(gelu), str(tmp_path / "o")],
                 capsys)
    assert "hidden_act='gelu'" in err and len(err.strip().splitlines()) == 1
    mg = tmp_path / "mg"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(hf_src), str(mg)]) == 0
    err = _error(["convert", "--from", "megatron", "--to", "hf", "--tp", "2", str(mg),
                  str(tmp_path / "x")], capsys)
    assert "--tp/--pp" in err
    err = _error(["convert", "--from", "megatron", "--to", "hf", "--ep", "2", str(mg),
                  str(tmp_path / "x")], capsys)
    assert "--tp/--pp/--ep set the layout" in err and not (tmp_path / "x").exists()
