"""Mixture-of-experts families (Qwen3-MoE, Mixtral) through the bridge, on gloo.

One spawn of 2 ranks runs every layout in turn (re-initialising megatron's groups in the same
process group; spawning costs more than converting the tiny models): EP=2, then EP=1 (2
data-parallel ranks, which also loads the checkpoint saved at EP=2 and the one streamed from
HF), TP=2 and PP=2. Each layout's logits are compared with transformers' and with EP=1's, its
export with the original safetensors files, bit for bit, and what each rank writes to a dist
checkpoint with :func:`~megatron_bridge.dist_ckpt_layout.rank_layout`, the streamed
conversion's layout (its checkpoint equals the one saved at EP=2, byte for byte).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from mb_fixtures import (
    assert_same_checkpoint,
    expected_rank_layout,
    hf_reference_logits,
    main_replica_layout,
    sample_input_ids,
)
from megatron_bridge.checkpoint import checkpoint_bridge
from megatron_bridge.dist_ckpt_reader import checkpoint_hf_weights
from megatron_bridge.dist_ckpt_writer import convert_hf_to_dist_checkpoint
from megatron_bridge.parallel_state import find_free_port

ATOL = 1e-5
WORLD = 2
# (tp, pp, ep) in run order: EP=2 first, so EP=1 can load the checkpoint it saved.
LAYOUTS = [(1, 1, 2), (1, 1, 1), (2, 1, 1), (1, 2, 1)]
EP1 = (1, 1, 1)


def _worker(rank: int, paths: dict, streamed: dict, port: int, out_dir: str) -> None:
    """Run every layout of :data:`LAYOUTS` on this rank; save logits, the export's checksums,
    what the rank writes to a checkpoint and (rank 0) the exported tensors to
    ``out_dir/rank<rank>.pt``. At EP=1, also the logits of the checkpoint saved at EP=2 and
    of the streamed one (``streamed``: family -> folder)."""
    from megatron.core import parallel_state

    from megatron_bridge import (
        export_hf_weights,
        load_hf_into_megatron,
        load_megatron_checkpoint,
        megatron_logits,
        save_megatron_checkpoint,
    )
    from megatron_bridge.parallel_state import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )

    results: dict = {}
    for tp, pp, ep in LAYOUTS:
        initialize_megatron_parallel(rank, WORLD, tp=tp, pp=pp, ep=ep, master_port=port)
        for name, path in paths.items():
            model, bridge = load_hf_into_megatron(path)
            ids = sample_input_ids(bridge.vocab_size)
            exported = list(export_hf_weights(model, bridge))
            result = {
                "logits": megatron_logits(model, ids, bridge.vocab_size),
                "checksum": [(n, float(t.double().sum())) for n, t in exported],
                "local_params": sorted(n for n, _ in model.named_parameters()),
                "layout": main_replica_layout(model),
            }
            if rank == 0:
                result["exported"] = dict(exported)
            ckpt = Path(out_dir) / f"{name}_ep2"
            if ep == 2:
                save_megatron_checkpoint(model, bridge, ckpt)
            if (tp, pp, ep) == EP1:
                loaded, _ = load_megatron_checkpoint(ckpt)
                result["ckpt_logits"] = megatron_logits(loaded, ids, bridge.vocab_size)
                loaded, _ = load_megatron_checkpoint(streamed[name])
                result["streamed_logits"] = megatron_logits(loaded, ids, bridge.vocab_size)
            results[(tp, pp, ep, name)] = result
        parallel_state.destroy_model_parallel()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    destroy_megatron_parallel()


@pytest.fixture(scope="module")
def streamed(moe_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """family -> dist checkpoint streamed from HF (no model built)."""
    root = tmp_path_factory.mktemp("moe_streamed")
    for name, path in moe_checkpoints.items():
        convert_hf_to_dist_checkpoint(path, root / name, sync_files=False)
    return {name: root / name for name in moe_checkpoints}


@pytest.fixture(scope="module")
def run_dir(moe_checkpoints, streamed, tmp_path_factory) -> Path:
    """The folder of :func:`_worker`'s results and of the checkpoints saved at EP=2
    (``<family>_ep2``)."""
    out = tmp_path_factory.mktemp("moe_layouts")
    paths = {k: str(v) for k, v in moe_checkpoints.items()}
    streamed_paths = {k: str(v) for k, v in streamed.items()}
    mp.spawn(_worker, args=(paths, streamed_paths, find_free_port(), str(out)), nprocs=WORLD,
             join=True)
    return out


@pytest.fixture(scope="module")
def runs(run_dir) -> list[dict]:
    """Per-rank results of :func:`_worker`, keyed ``(tp, pp, ep, family)``."""
    return [torch.load(run_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def references(moe_checkpoints) -> dict[str, torch.Tensor]:
    from megatron_bridge import BridgeConfig

    return {
        name: hf_reference_logits(path, sample_input_ids(BridgeConfig.from_hf(path).vocab_size))
        for name, path in moe_checkpoints.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}_pp{}_ep{}".format(*l))
def test_logits_equal_transformers_and_ep1(runs, references, moe_checkpoints, layout):
    for name in moe_checkpoints:
        for rank, results in enumerate(runs):
            logits = results[(*layout, name)]["logits"]
            diff = (logits - references[name]).abs().max().item()
            assert diff <= ATOL, f"{name} {layout} rank {rank}: vs transformers {diff}"
            ep1 = results[(*EP1, name)]["logits"]
            diff = (logits - ep1).abs().max().item()
            assert diff <= ATOL, f"{name} {layout} rank {rank}: vs EP=1 {diff}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}_pp{}_ep{}".format(*l))
def test_export_is_bitwise_the_hf_checkpoint(runs, moe_checkpoints, layout):
    for name, path in moe_checkpoints.items():
        exported = runs[0][(*layout, name)]["exported"]
        original = load_file(str(path / "model.safetensors"))
        assert sorted(exported) == sorted(original), name
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), f"{name} {layout}: {key} changed"
        # Every rank yields the same stream, in the same order.
        assert runs[1][(*layout, name)]["checksum"] == runs[0][(*layout, name)]["checksum"]


@pytest.mark.slow
def test_ep2_holds_half_the_experts_and_its_checkpoint_loads_at_ep1(runs, moe_checkpoints):
    for name in moe_checkpoints:
        ep2 = [r[(1, 1, 2, name)]["local_params"] for r in runs]
        ep1 = runs[0][(*EP1, name)]["local_params"]
        experts = [p for p in ep1 if ".local_experts." in p]
        assert experts and all(len([p for p in r if ".local_experts." in p]) * 2 == len(experts)
                               for r in ep2), name
        # Expert-parallel ranks number their experts locally from 0.
        assert ep2[0] == ep2[1]
        diff = (runs[0][(*EP1, name)]["ckpt_logits"] - runs[0][(*EP1, name)]["logits"])
        assert diff.abs().max().item() <= ATOL, f"{name}: EP=2 checkpoint loaded at EP=1"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}_pp{}_ep{}".format(*l))
def test_layout_is_megatrons_sharded_state_dict(runs, moe_checkpoints, layout):
    from megatron_bridge import BridgeConfig

    tp, pp, ep = layout
    for name, path in moe_checkpoints.items():
        bridge = BridgeConfig.from_hf(path)
        for rank, results in enumerate(runs):
            expected = expected_rank_layout(bridge, tp, pp, rank, ep)
            assert expected == results[(*layout, name)]["layout"], f"{name} rank {rank}"


@pytest.mark.slow
def test_streamed_checkpoint_equals_the_one_saved_at_ep2(run_dir, runs, streamed):
    for name, mine in streamed.items():
        assert_same_checkpoint(mine, run_dir / f"{name}_ep2", name)
        ep1 = runs[0][(*EP1, name)]
        assert torch.equal(ep1["streamed_logits"], ep1["ckpt_logits"]), name


@pytest.mark.slow
def test_streamed_export_of_the_ep2_checkpoint_is_bitwise(run_dir, moe_checkpoints):
    # Each expert-parallel rank wrote its own experts' chunks into its own file.
    for name, path in moe_checkpoints.items():
        ckpt = run_dir / f"{name}_ep2"
        assert len(list(ckpt.glob("*.distcp"))) == WORLD
        exported = dict(checkpoint_hf_weights(ckpt, checkpoint_bridge(ckpt)))
        original = load_file(str(path / "model.safetensors"))
        assert sorted(exported) == sorted(original), name
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), f"{name}: {key} changed"


# ---- config time: fields, sparse layers, parallel sizes ---------------------------------------


def _moe_bridge(architecture: str = "Qwen3MoeForCausalLM", **fields):
    from mb_fixtures import tiny_bridge

    if architecture == "Qwen3MoeForCausalLM":
        experts = {"num_experts": 4, "moe_intermediate_size": 64}
    else:  # Mixtral's experts use intermediate_size
        experts = {"num_local_experts": 4}
    return tiny_bridge(architecture, num_experts_per_tok=2, **{**experts, **fields})


def test_sparse_layers_are_read_as_transformers_builds_them():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    fields = dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    bridge = _moe_bridge(**fields)
    config = Qwen3MoeConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, intermediate_size=8, moe_intermediate_size=8,
                            num_experts=4, vocab_size=32, **fields)
    model = AutoModelForCausalLM.from_config(config)
    expected = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert bridge.features.sparse_layers == expected == (False, True, False, False, False, True)
    assert bridge.moe_config(1, 1)["moe_layer_freq"] == [0, 1, 0, 0, 0, 1]
    plan = [m.megatron_name for m in bridge.plan()]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in plan
    assert "decoder.layers.1.mlp.router.weight" in plan
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in plan
    assert not any(n.startswith("decoder.layers.1.mlp.linear_fc") for n in plan)


def test_router_matches_each_familys_top_k_normalisation():
    qwen = _moe_bridge(norm_topk_prob=False).moe_config(1, 1)
    qwen_norm = _moe_bridge(norm_topk_prob=True).moe_config(1, 1)
    mixtral = _moe_bridge("MixtralForCausalLM").moe_config(1, 1)
    assert qwen["moe_router_pre_softmax"] is True  # softmax over all, top-k as they are
    assert qwen_norm["moe_router_pre_softmax"] is False  # renormalised over the top k
    assert mixtral["moe_router_pre_softmax"] is False
    assert mixtral["moe_ffn_hidden_size"] == 256  # Mixtral's experts use intermediate_size
    assert qwen["moe_ffn_hidden_size"] == 64
    assert _moe_bridge(norm_topk_prob=False).transformer_config(1, 1).num_moe_experts == 4


@pytest.mark.parametrize(
    "bridge_fields, tp, ep, message",
    [
        ({}, 1, 3, "num_local_experts (4) must be divisible by expert_model_parallel_size (ep=3)"),
        ({"moe_intermediate_size": 7}, 2, 1,
         "moe_intermediate_size (7) must be divisible by tp (2)"),
        ({}, 1, 0, "tp, pp and ep must be >= 1"),
    ],
)
def test_expert_layouts_that_do_not_fit_are_refused(bridge_fields, tp, ep, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _moe_bridge(**bridge_fields).validate_parallelism(tp, 1, ep)


def test_expert_parallelism_needs_experts_and_enough_ranks():
    from mb_fixtures import tiny_bridge

    from megatron_bridge.parallel_state import check_parallel_sizes

    with pytest.raises(ValueError, match=r"ep=2\) > 1 needs a mixture-of-experts model"):
        tiny_bridge().validate_parallelism(1, 1, 2)
    check_parallel_sizes(4, tp=2, pp=1, ep=2)
    with pytest.raises(ValueError, match=r"multiple of tp\*ep\*pp \(2\*2\*1\)"):
        check_parallel_sizes(2, tp=2, pp=1, ep=2)


@pytest.mark.parametrize(
    "architecture, fields, message",
    [
        ("Qwen3MoeForCausalLM", {"attention_bias": True}, "attention_bias=True"),
        ("MixtralForCausalLM", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ("Qwen3MoeForCausalLM", {"num_shared_experts": 1}, "num_shared_experts=1"),
    ],
)
def test_moe_fields_that_change_the_model_are_refused(architecture, fields, message):
    from megatron_bridge.families.config_fields import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match=message):
        _moe_bridge(architecture, **fields)


# ---- CLI and the streamed dist-checkpoint conversion -------------------------------------------


def test_info_lists_the_experts(moe_checkpoints, capsys):
    import json

    from megatron_bridge.cli import main

    assert main(["info", "--json", str(moe_checkpoints["qwen3_moe"])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Qwen3MoeForCausalLM"
    assert (info["experts"], info["experts_per_token"], info["expert_ffn"]) == (4, 2, 48)
    assert info["sparse_layers"] == [0, 2, 3]
    assert info["valid_ep"] == [1, 2, 4]


@pytest.mark.slow
def test_verify_at_ep2(moe_checkpoints, capsys):
    from megatron_bridge.cli import main

    path = str(moe_checkpoints["mixtral"])
    assert main(["verify", path, "--ep", "2", "--atol", str(ATOL)]) == 0
    assert "OK: max abs diff" in capsys.readouterr().out
    assert main(["verify", path, "--ep", "3"]) == 2
    assert "--ep 3: num_local_experts (8) must be divisible" in capsys.readouterr().err
