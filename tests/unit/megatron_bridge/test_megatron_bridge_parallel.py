"""HF -> Megatron -> HF on real gloo process groups: TP=1, TP=2, PP=2, dist-checkpoint resharding.

Each spawn converts every family at once (spawning costs more than converting tiny models).
References are independent: transformers' own logits, and the original safetensors files.
Every spawn also saves each family's dist checkpoint from the built model and records the
sharded state dict megatron-core describes, the references for the streamed conversion
(:mod:`megatron_bridge.dist_ckpt_writer`), which builds no model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from mb_fixtures import (
    SEQ_LEN,
    assert_same_checkpoint,
    expected_rank_layout,
    hf_reference_logits,
    main_replica_layout,
    sample_input_ids,
)
from megatron_bridge import BridgeConfig
from megatron_bridge.checkpoint import checkpoint_bridge
from megatron_bridge.dist_ckpt_reader import checkpoint_hf_weights
from megatron_bridge.dist_ckpt_writer import convert_hf_to_dist_checkpoint
from megatron_bridge.parallel_state import find_free_port

ATOL = 1e-5


def _worker(rank: int, world: int, tp: int, pp: int, port: int, paths: dict, out_dir: str,
            load_from: dict | None, convert: bool) -> None:
    """Build every family on this rank and save its dist checkpoint to ``out_dir/<family>``;
    with ``convert``, rank 0 also writes logits and exported tensors."""
    from megatron_bridge import (
        export_hf_weights,
        load_hf_into_megatron,
        load_megatron_checkpoint,
        megatron_logits,
        save_megatron_checkpoint,
    )
    from megatron_bridge.parallel_state import destroy_megatron_parallel, initialize_megatron_parallel

    initialize_megatron_parallel(rank, world, tp=tp, pp=pp, master_port=port)
    results = {}
    for name, path in paths.items():
        model, bridge = load_hf_into_megatron(path)
        results[name] = {"layout": main_replica_layout(model)}
        save_megatron_checkpoint(model, bridge, Path(out_dir) / name, assets_dir=path)
        if not convert:
            continue
        ids = sample_input_ids(bridge.vocab_size)
        exported = list(export_hf_weights(model, bridge))
        results[name].update({"logits": megatron_logits(model, ids, bridge.vocab_size),
                              "exported": dict(exported), "order": [n for n, _ in exported]})
        for ckpt in (load_from or {}).get(name, []):
            loaded, bridge = load_megatron_checkpoint(ckpt)
            results[name].setdefault("ckpt_logits", []).append(
                megatron_logits(loaded, ids, bridge.vocab_size))
        # Every rank yields the same stream: compare a checksum against rank 0's.
        results[name]["checksum"] = [float(t.double().sum()) for _, t in exported]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    destroy_megatron_parallel()


def _run(tp: int, pp: int, paths: dict, out_dir: Path, load_from=None, convert=True) -> list:
    """Per-rank results of :func:`_worker`; the built models' checkpoints are in
    ``out_dir/<family>``."""
    world = tp * pp
    str_paths = {k: str(v) for k, v in paths.items()}
    mp.spawn(_worker, args=(world, tp, pp, find_free_port(), str_paths, str(out_dir),
                            load_from, convert), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def references(family_checkpoints):
    return {
        name: hf_reference_logits(path, sample_input_ids(
            json.loads((path / "config.json").read_text())["vocab_size"]))
        for name, path in family_checkpoints.items()
    }


@pytest.fixture(scope="module")
def streamed_tp2(family_checkpoints, tmp_path_factory):
    """family -> dist checkpoint streamed from HF at TP=2 (no model built)."""
    root = tmp_path_factory.mktemp("streamed_tp2")
    for name, path in family_checkpoints.items():
        convert_hf_to_dist_checkpoint(path, root / name, tp=2, sync_files=False)
    return {name: root / name for name in family_checkpoints}


@pytest.fixture(scope="module")
def layouts(family_checkpoints, tmp_path_factory, streamed_tp2):
    """(tp, pp) -> (run directory, per-rank results); runs are spawned on first use."""
    runs: dict = {}

    def get(tp: int, pp: int) -> tuple[Path, list]:
        if (tp, pp) not in runs:
            out = tmp_path_factory.mktemp(f"built_tp{tp}_pp{pp}")
            load_from = None
            if (tp, pp) == (1, 2):
                # The TP=2 checkpoints, saved from the built model and streamed, load at PP=2.
                built = get(2, 1)[0]
                load_from = {n: [str(built / n), str(streamed_tp2[n])] for n in family_checkpoints}
            convert = (tp, pp) != (2, 2)
            runs[(tp, pp)] = (out, _run(tp, pp, family_checkpoints, out, load_from, convert))
        return runs[(tp, pp)]

    return get


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


def test_tp1_matches_transformers_and_roundtrips(layouts, family_checkpoints, references):
    _check_conversion(layouts(1, 1)[1], family_checkpoints, references)


@pytest.mark.slow
def test_tp2_matches_transformers_and_roundtrips(layouts, family_checkpoints, references):
    _check_conversion(layouts(2, 1)[1], family_checkpoints, references)


@pytest.mark.slow
def test_pp2_matches_transformers_and_loads_tp2_checkpoints(
    layouts, family_checkpoints, references
):
    tp2 = layouts(2, 1)[1]
    results = layouts(1, 2)[1]
    _check_conversion(results, family_checkpoints, references)
    for name in family_checkpoints:
        saved_at_tp2 = tp2[0][name]["logits"]
        built, streamed = results[0][name]["ckpt_logits"]
        diff = (saved_at_tp2 - built).abs().max().item()
        assert diff <= ATOL, f"{name}: TP=2 checkpoint loaded at PP=2 differs by {diff}"
        assert torch.equal(streamed, built), f"{name}: streamed TP=2 checkpoint loads differently"


PARALLEL = [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
            pytest.param(1, 2, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("tp, pp", PARALLEL)
def test_layout_is_megatrons_sharded_state_dict(layouts, family_checkpoints, tp, pp):
    results = layouts(tp, pp)[1]
    for name, path in family_checkpoints.items():
        bridge = BridgeConfig.from_hf(path)
        for rank, result in enumerate(results):
            expected = expected_rank_layout(bridge, tp, pp, rank)
            assert expected == result[name]["layout"], f"{name} rank {rank}"


@pytest.mark.parametrize("tp, pp", PARALLEL)
def test_streamed_checkpoint_equals_the_built_models(
    layouts, family_checkpoints, tmp_path, tp, pp
):
    built_root = layouts(tp, pp)[0]
    for name, path in family_checkpoints.items():
        convert_hf_to_dist_checkpoint(path, tmp_path / name, tp=tp, pp=pp, sync_files=False)
        built, mine = built_root / name, tmp_path / name
        assert_same_checkpoint(mine, built, name)
        # The streamed checkpoint also knows its source's dtype (a built model does not).
        my_meta, built_meta = (json.loads((d / "bridge.json").read_text()) for d in (mine, built))
        assert my_meta.pop("source_dtype") == "float32" and built_meta.pop("source_dtype") is None
        assert my_meta == built_meta, name
        assert torch.load(mine / "common.pt") == torch.load(built / "common.pt")
        assert sorted(p.name for p in (mine / "hf_assets").iterdir()) == sorted(
            p.name for p in (built / "hf_assets").iterdir())


@pytest.mark.slow
def test_streamed_export_of_a_tp2_checkpoint_is_bitwise(layouts, family_checkpoints):
    # A checkpoint saved from a TP=2 model holds every TP-split tensor in two chunks.
    built_root = layouts(2, 1)[0]
    for name, path in family_checkpoints.items():
        ckpt = built_root / name
        exported = dict(checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt)))
        original = load_file(str(path / "model.safetensors"))
        assert sorted(exported) == sorted(original), name
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), f"{name}: {key} changed"


def _reference_with_layer_types(path: Path, layer_types: list[str] | None) -> torch.Tensor:
    """transformers' logits for the fixed inputs with the config's windows changed:
    ``layer_types`` None removes every window."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if layer_types is None:
        config.sliding_window = None
        layer_types = ["full_attention"] * config.num_hidden_layers
    if hasattr(config, "layer_types"):
        config.layer_types = layer_types
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(sample_input_ids(config.vocab_size)).logits


@pytest.mark.parametrize("name", ["mistral", "qwen2_window", "qwen3_bias_window"])
def test_references_depend_on_the_sliding_windows(family_checkpoints, references, name):
    # Guards the window checks above: the windows must change the reference (so matching it
    # shows Megatron's windows are set right), and for Qwen2 which layers slide must too.
    path = family_checkpoints[name]
    assert BridgeConfig.from_hf(path).features.window < SEQ_LEN
    full = _reference_with_layer_types(path, None)
    assert (full - references[name]).abs().max().item() > 1e-3
    if name == "qwen2_window":
        every_layer = _reference_with_layer_types(path, ["sliding_attention"] * 2)
        assert (every_layer - references[name]).abs().max().item() > 1e-3
