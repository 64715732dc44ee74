"""LoRA adapters (:mod:`megatron_bridge.lora`) on every family's tiny checkpoint, in this
process at TP=1 (the layouts are compared in tests/unit/models/policy/test_lora_layouts.py):

* freshly attached (``B = 0``) the model's logits are the base model's, bit for bit;
* with non-zero adapters the logits change, switching them off gives the base back, and the
  merged export (``W + scale * B A``) loaded into transformers gives the adapted model's logits
  (1e-5): the merge folds each adapter into the right rows/columns of q/k/v, gate/up, o, down;
* the PEFT-layout adapter tensors export and load back unchanged, and a fused linear refuses
  projections with different ``A``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mb_fixtures import hf_reference_logits, sample_input_ids
from megatron_bridge.parallel_state import (
    destroy_megatron_parallel,
    find_free_port,
    initialize_megatron_parallel,
)

SETTINGS = dict(dim=4, alpha=8.0, dropout=0.0, dropout_position="pre", a_init="xavier", dtype=None)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    initialize_megatron_parallel(0, 1, tp=1, pp=1, master_port=find_free_port())
    yield
    destroy_megatron_parallel()


def _adapted(path: Path):
    from megatron_bridge import load_hf_into_megatron
    from megatron_bridge.lora import LoraSettings, LoraSpec, attach_lora
    from megatron_bridge.lora_targets import select_lora_targets

    model, bridge = load_hf_into_megatron(path)
    targets = select_lora_targets(bridge.num_layers, bridge.features.sparse_layers, [], [])
    attach_lora(model, LoraSpec(LoraSettings(**SETTINGS), tuple(targets)), seed=5)
    return model, bridge


def _random_b(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(v.shape, generator=gen) * 0.05 if k.endswith("lora_B.weight") else v
        for k, v in tensors.items()
    }


@pytest.mark.usefixtures("one_rank")
def test_merged_export_is_the_adapted_model(family_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from megatron_bridge import export_hf_weights, megatron_logits
    from megatron_bridge.lora import adapters_disabled
    from megatron_bridge.lora_weights import export_lora_weights, load_lora_weights

    for name, path in family_checkpoints.items():
        model, bridge = _adapted(path)
        ids = sample_input_ids(bridge.vocab_size)
        base = hf_reference_logits(path, ids)
        fresh = megatron_logits(model, ids, bridge.vocab_size)
        with adapters_disabled(model):
            assert torch.equal(megatron_logits(model, ids, bridge.vocab_size), fresh), name
        assert (fresh - base).abs().max() <= 1e-5, name

        adapters = _random_b(dict(export_lora_weights(model, bridge)))
        load_lora_weights(model, bridge, adapters)
        adapted = megatron_logits(model, ids, bridge.vocab_size)
        assert (adapted - fresh).abs().max() > 0.1, name  # the adapters matter
        with adapters_disabled(model):
            assert torch.equal(megatron_logits(model, ids, bridge.vocab_size), fresh), name
        exported = dict(export_lora_weights(model, bridge))
        assert sorted(exported) == sorted(adapters), name
        assert all(torch.equal(exported[k], adapters[k]) for k in adapters), name

        merged_dir = tmp_path / name
        merged_dir.mkdir()
        for f in ("config.json",):
            (merged_dir / f).write_text((path / f).read_text())
        save_file({k: v.contiguous() for k, v in export_hf_weights(model, bridge)},
                  str(merged_dir / "model.safetensors"))
        merged = hf_reference_logits(merged_dir, ids)
        diff = (merged - adapted).abs().max().item()
        assert diff <= 1e-5, f"{name}: merged export vs adapter forward differ by {diff}"


@pytest.mark.usefixtures("one_rank")
def test_fused_projections_must_share_a(family_checkpoints: dict[str, Path]) -> None:
    from megatron_bridge.lora_weights import export_lora_weights, load_lora_weights

    model, bridge = _adapted(family_checkpoints["llama"])
    adapters = dict(export_lora_weights(model, bridge))
    adapters["model.layers.1.mlp.up_proj.lora_A.weight"] = adapters[
        "model.layers.1.mlp.up_proj.lora_A.weight"] + 1
    with pytest.raises(ValueError, match=r"gate_proj', .*up_proj'\] have different lora_A.*linear_fc1"):
        load_lora_weights(model, bridge, adapters)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_adapter_folder_loads_in_peft_as_our_adapted_model(
    family: str, family_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint with adapters converts (``megatron-bridge convert --from megatron``) to a
    PEFT adapter folder (``--to peft``), which ``peft`` loads onto the base model in
    transformers with our adapted logits (1e-5), and to the merged HF model (``--to hf``),
    which gives them too. The folder's tensors are the live model's PEFT-layout export: fused
    q/k/v and gate/up adapters split into their projections (``A`` repeated, ``B`` by rows)."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_bridge import megatron_logits
    from megatron_bridge.checkpoint import save_megatron_checkpoint, write_lora_file
    from megatron_bridge.cli import main
    from megatron_bridge.lora import LoraSettings, LoraSpec
    from megatron_bridge.lora_targets import select_lora_targets
    from megatron_bridge.lora_weights import export_lora_weights, load_lora_weights

    path = family_checkpoints[family]
    model, bridge = _adapted(path)
    load_lora_weights(model, bridge, _random_b(dict(export_lora_weights(model, bridge))))
    ids = sample_input_ids(bridge.vocab_size)
    adapted = megatron_logits(model, ids, bridge.vocab_size)
    ckpt = tmp_path / "megatron"
    save_megatron_checkpoint(model, bridge, ckpt, assets_dir=path)
    targets = select_lora_targets(bridge.num_layers, bridge.features.sparse_layers, [], [])
    write_lora_file(ckpt, LoraSpec(LoraSettings(**SETTINGS), tuple(targets)))

    assert main(["convert", "--from", "megatron", "--to", "peft", "--base-model", str(path),
                 str(ckpt), str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert config["base_model_name_or_path"] == str(path)
    stored = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    live = dict(export_lora_weights(model, bridge))
    assert sorted(stored) == sorted(f"base_model.model.{k}" for k in live)
    assert all(torch.equal(stored[f"base_model.model.{k}"], v) for k, v in live.items())
    q_a = stored["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert torch.equal(q_a, stored["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"])
    assert stored["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"].shape == (
        bridge.dims(1).ffn, 4)

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        loaded = peft_model(ids).logits
    assert (loaded - adapted).abs().max() <= 1e-5
    assert (loaded - hf_reference_logits(path, ids)).abs().max() > 0.1  # the adapters matter

    assert main(["convert", "--from", "megatron", "--to", "hf", str(ckpt),
                 str(tmp_path / "merged")]) == 0
    assert (hf_reference_logits(tmp_path / "merged", ids) - adapted).abs().max() <= 1e-5
