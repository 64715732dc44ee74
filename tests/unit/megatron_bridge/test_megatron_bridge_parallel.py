"""HF -> Megatron -> HF on real gloo process groups: TP=1, TP=2, PP=2, dist-checkpoint resharding.

Each spawn converts every family at once (spawning costs more than converting tiny models).
References are independent: transformers' own logits, and the original safetensors files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from mb_fixtures import MISTRAL_WINDOW, hf_reference_logits, sample_input_ids
from nemo_rl.models.megatron import find_free_port

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "llama3rope")
CKPT_FAMILIES = ("llama", "qwen2")  # untied and tied embeddings
ATOL = 1e-5


def _worker(rank: int, world: int, tp: int, pp: int, port: int, paths: dict, out_dir: str,
            save_from: dict | None, load_from: dict | None) -> None:
    """Convert every family on this rank; rank 0 writes logits and exported tensors."""
    from megatron_bridge import (
        export_hf_weights,
        load_hf_into_megatron,
        load_megatron_checkpoint,
        megatron_logits,
        save_megatron_checkpoint,
    )
    from nemo_rl.models.megatron import destroy_megatron_parallel, initialize_megatron_parallel

    initialize_megatron_parallel(rank, world, tp=tp, pp=pp, master_port=port)
    results = {}
    for name, path in paths.items():
        model, bridge = load_hf_into_megatron(path)
        ids = sample_input_ids(bridge.vocab_size)
        exported = list(export_hf_weights(model, bridge))
        results[name] = {"logits": megatron_logits(model, ids, bridge.vocab_size),
                         "exported": dict(exported), "order": [n for n, _ in exported]}
        if save_from and name in save_from:
            save_megatron_checkpoint(model, bridge, save_from[name], assets_dir=path)
        if load_from and name in load_from:
            loaded, bridge = load_megatron_checkpoint(load_from[name])
            results[name]["ckpt_logits"] = megatron_logits(loaded, ids, bridge.vocab_size)
        # Every rank yields the same stream: compare a checksum against rank 0's.
        results[name]["checksum"] = [float(t.double().sum()) for _, t in exported]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    destroy_megatron_parallel()


def _run(tp: int, pp: int, paths: dict, out_dir: Path, save_from=None, load_from=None) -> list:
    world = tp * pp
    str_paths = {k: str(v) for k, v in paths.items()}
    mp.spawn(_worker, args=(world, tp, pp, find_free_port(), str_paths, str(out_dir),
                            save_from, load_from), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def references(family_checkpoints):
    return {
        name: hf_reference_logits(path, sample_input_ids(
            json.loads((path / "config.json").read_text())["vocab_size"]))
        for name, path in family_checkpoints.items()
    }


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mb_dist_ckpt")
    return {name: str(root / name) for name in CKPT_FAMILIES}


@pytest.fixture(scope="module")
def tp2_results(family_checkpoints, ckpt_dirs, tmp_path_factory):
    return _run(2, 1, family_checkpoints, tmp_path_factory.mktemp("tp2"), save_from=ckpt_dirs)


def _check_conversion(results: list, family_checkpoints: dict, references: dict) -> None:
    for name, path in family_checkpoints.items():
        mine = results[0][name]
        diff = (mine["logits"] - references[name]).abs().max().item()
        assert diff <= ATOL, f"{name}: megatron vs transformers logits differ by {diff}"
        original = load_file(str(path / "model.safetensors"))
        assert sorted(mine["exported"]) == sorted(original), name
        for key, tensor in original.items():
            assert torch.equal(mine["exported"][key], tensor), f"{name}: {key} changed"
        for other in results[1:]:
            assert other[name]["order"] == mine["order"]
            assert other[name]["checksum"] == mine["checksum"]
            assert torch.equal(other[name]["logits"], mine["logits"])


def test_tp1_matches_transformers_and_roundtrips(family_checkpoints, references, tmp_path):
    _check_conversion(_run(1, 1, family_checkpoints, tmp_path), family_checkpoints, references)


@pytest.mark.slow
def test_tp2_matches_transformers_and_roundtrips(tp2_results, family_checkpoints, references):
    _check_conversion(tp2_results, family_checkpoints, references)


@pytest.mark.slow
def test_pp2_matches_transformers_and_loads_tp2_checkpoint(
    tp2_results, family_checkpoints, references, ckpt_dirs, tmp_path
):
    results = _run(1, 2, family_checkpoints, tmp_path, load_from=ckpt_dirs)
    _check_conversion(results, family_checkpoints, references)
    for name in CKPT_FAMILIES:
        saved_at_tp2 = tp2_results[0][name]["logits"]
        loaded_at_pp2 = results[0][name]["ckpt_logits"]
        diff = (saved_at_tp2 - loaded_at_pp2).abs().max().item()
        assert diff <= ATOL, f"{name}: TP=2 checkpoint loaded at PP=2 differs by {diff}"


def test_mistral_reference_depends_on_the_sliding_window(family_checkpoints, references):
    # Guards the Mistral check above: the window must change the reference, or matching it
    # would not show that Megatron's window is set right.
    from transformers import AutoConfig, AutoModelForCausalLM

    path = family_checkpoints["mistral"]
    config = AutoConfig.from_pretrained(path)
    assert config.sliding_window == MISTRAL_WINDOW
    config.sliding_window = None
    full = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = full(sample_input_ids(config.vocab_size)).logits
    assert (logits - references["mistral"]).abs().max().item() > 1e-3
