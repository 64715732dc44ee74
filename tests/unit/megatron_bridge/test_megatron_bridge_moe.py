"""Mixture-of-experts families (Qwen3-MoE, Mixtral) through the bridge, on gloo.

One spawn of 2 ranks runs every layout in turn (re-initialising megatron's groups in the same
process group; spawning costs more than converting the tiny models): EP=2, then EP=1 (2
data-parallel ranks, which also loads the checkpoint saved at EP=2), TP=2 and PP=2. Each
layout's logits are compared with transformers' and with EP=1's, and its export with the
original safetensors files, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from mb_fixtures import hf_reference_logits, sample_input_ids
from megatron_bridge.parallel_state import find_free_port

ATOL = 1e-5
WORLD = 2
# (tp, pp, ep) in run order: EP=2 first, so EP=1 can load the checkpoint it saved.
LAYOUTS = [(1, 1, 2), (1, 1, 1), (2, 1, 1), (1, 2, 1)]
EP1 = (1, 1, 1)


def _worker(rank: int, paths: dict, port: int, out_dir: str) -> None:
    """Run every layout of :data:`LAYOUTS` on this rank; save logits, the export's checksums
    and (rank 0) the exported tensors to ``out_dir/rank<rank>.pt``."""
    from megatron.core import parallel_state

    from megatron_bridge import (
        export_hf_weights,
        load_hf_into_megatron,
        load_megatron_checkpoint,
        megatron_logits,
        save_megatron_checkpoint,
    )
    from megatron_bridge.parallel_state import destroy_megatron_parallel, initialize_megatron_parallel

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
            }
            if rank == 0:
                result["exported"] = dict(exported)
            ckpt = Path(out_dir) / f"{name}_ep2"
            if ep == 2:
                save_megatron_checkpoint(model, bridge, ckpt)
            if (tp, pp, ep) == EP1:
                loaded, _ = load_megatron_checkpoint(ckpt)
                result["ckpt_logits"] = megatron_logits(loaded, ids, bridge.vocab_size)
            results[(tp, pp, ep, name)] = result
        parallel_state.destroy_model_parallel()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    destroy_megatron_parallel()


@pytest.fixture(scope="module")
def runs(moe_checkpoints, tmp_path_factory) -> list[dict]:
    """Per-rank results of :func:`_worker`, keyed ``(tp, pp, ep, family)``."""
    out = tmp_path_factory.mktemp("moe_layouts")
    paths = {k: str(v) for k, v in moe_checkpoints.items()}
    mp.spawn(_worker, args=(paths, find_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


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
